"""SIGTERM (``kill``, ``timeout``, a scheduler) and SIGINT (Ctrl-C) to a running ``verl-tokensel demo`` end the verl
run and the Ray cluster it started: nothing of it is left 30 s later, the demo prints one line and exits 143 / 130.

The demo runs for real (its launcher, verl's ``main_ppo``, Ray), with the random tiny model as its warm start (the
supervised warm-up is tested on its own, ``test_demo_on_cpu``) and one step of ``none``. The signal is sent once
the run's Ray instance is up (its log says so and a ``raylet`` of the run exists). The two demos, one per signal,
run at the same time (each with its own output folder and its own local Ray instance; the demo's start dominates the
test's time, and two starts overlap on 2 cores). Every process a demo starts, Ray's included, inherits a variable
unique to that demo, so the processes left are counted by it, independently of the launcher's own marker (the
cleanup below ends any that a failing run leaves, by PID).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from helpers.procs import alive

TAG_ENV = "TOKENSEL_SIGNAL_TEST"

DEMO = textwrap.dedent('''
    import sys
    from pathlib import Path

    from verl_tokensel_cpu.demo import warmup
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    def warm_model_dir(cfg, cache_dir=None, progress=None):
        return build_tiny_model_dir(), {"accuracy": 0.0, "problems": 223}

    warmup.warm_model_dir = warm_model_dir
    from verl_tokensel.cli.main import main

    sys.exit(main(["demo", "--out", sys.argv[1], "--presets", "none", "--steps", "1", "--timeout", "600"]))
''')


def tagged(tag: str) -> dict[int, str]:
    """``{pid: command name}`` of the live processes whose environment holds ``TAG_ENV=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and alive(int(d.name)):
                out[int(d.name)] = (d / "comm").read_text().strip()
        except OSError:
            continue
    return out


class _Demo:
    """One ``verl-tokensel demo`` (:data:`DEMO`) in ``work``, every process it starts tagged with ``TAG_ENV``."""

    def __init__(self, work: Path, sig: signal.Signals):
        self.work, self.sig, self.tag = work, sig, uuid.uuid4().hex
        self.log = work / "demo" / "logs" / "none.log"
        work.mkdir(parents=True)
        env = {**os.environ, TAG_ENV: self.tag, "RAY_ADDRESS": ""}
        with open(work / "stdout", "w") as so, open(work / "stderr", "w") as se:
            self.proc = subprocess.Popen([sys.executable, "-c", DEMO, str(work / "demo")], env=env, stdout=so,
                                         stderr=se, stdin=subprocess.DEVNULL, start_new_session=True)

    def stderr(self) -> str:
        return (self.work / "stderr").read_text()

    def ray_is_up(self) -> bool:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "Started a local Ray instance" in text and "raylet" in tagged(self.tag).values()

    def send(self) -> None:
        """Send the signal to the demo, which must still run, with its run's Ray instance up."""
        assert self.proc.poll() is None, (self.sig.name, self.proc.returncode, self.stderr()[-3000:])
        self.before = tagged(self.tag)
        assert "raylet" in self.before.values(), (self.sig.name, "the run's Ray instance did not come up",
                                                  self.stderr()[-3000:])
        self.t_sig = time.monotonic()
        self.proc.send_signal(self.sig)

    def check(self) -> None:
        """After :meth:`send`: the demo exits 128 + signal with its one line and no traceback, and none of its
        processes is left 30 s after the signal."""
        sig = self.sig
        self.proc.wait(timeout=max(1.0, 30 - (time.monotonic() - self.t_sig)))
        left = tagged(self.tag)
        while left and time.monotonic() - self.t_sig < 30:
            time.sleep(0.5)
            left = tagged(self.tag)
        err = self.stderr()
        assert not left, f"{len(left)} of the demo's {len(self.before)} processes left 30 s after {sig.name}: {left}"
        assert self.proc.returncode == 128 + sig, (sig.name, self.proc.returncode, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[demo ")]
        assert lines[-1].startswith(f"verl-tokensel demo: stopped by {sig.name}; the verl run in progress and the "
                                    "Ray processes it started were ended"), err[-3000:]
        assert "Traceback" not in err, err[-3000:]

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *tagged(self.tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(timeout=30)


@pytest.mark.timeout(420)
def test_sigterm_and_sigint_each_end_a_demo_and_its_ray_cluster(tmp_path):
    demos = [_Demo(tmp_path / sig.name, sig) for sig in (signal.SIGTERM, signal.SIGINT)]
    try:
        waiting, deadline = list(demos), time.monotonic() + 300
        # each demo gets its signal as soon as its run's Ray instance is up (the other one may still be starting)
        while waiting and time.monotonic() < deadline:
            for demo in [d for d in waiting if d.proc.poll() is not None or d.ray_is_up()]:
                waiting.remove(demo)
                demo.send()  # fails if the demo ended before its Ray instance came up
            time.sleep(1.0)
        for demo in waiting:  # not up within the deadline: send() says so
            demo.send()
        for demo in demos:
            demo.check()
    finally:
        for demo in demos:
            demo.kill_all()
