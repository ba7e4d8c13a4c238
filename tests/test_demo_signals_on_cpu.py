"""SIGTERM (``kill``, ``timeout``, a scheduler) and SIGINT (Ctrl-C) to a running ``verl-tokensel demo`` end the verl
run and the Ray cluster it started: nothing of it is left 30 s later, the demo prints one line and exits 143 / 130.

The demo runs for real (its launcher, verl's ``main_ppo``, Ray), with the random tiny model as its warm start (the
supervised warm-up is tested on its own, ``test_demo_on_cpu``) and one step of ``none``. The signal is sent once
the run's Ray instance is up (its log says so and a ``raylet`` of the run exists). Every process the demo starts,
Ray's included, inherits a variable unique to the test, so the processes left are counted by it, independently of
the launcher's own marker (the cleanup below ends any that a failing run leaves, by PID).
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


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_demo_and_its_ray_cluster(tmp_path, sig):
    tag = uuid.uuid4().hex
    out = tmp_path / "demo"
    env = {**os.environ, TAG_ENV: tag, "RAY_ADDRESS": ""}
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        demo = subprocess.Popen([sys.executable, "-c", DEMO, str(out)], env=env, stdout=so, stderr=se,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    log = out / "logs" / "none.log"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and demo.poll() is None:
            text = log.read_text(errors="replace") if log.is_file() else ""
            if "Started a local Ray instance" in text and "raylet" in tagged(tag).values():
                break
            time.sleep(1.0)
        assert demo.poll() is None, (demo.returncode, (tmp_path / "stderr").read_text()[-3000:])
        assert "raylet" in tagged(tag).values(), ("the run's Ray instance did not come up",
                                                  (tmp_path / "stderr").read_text()[-3000:])
        before = tagged(tag)
        t_sig = time.monotonic()
        demo.send_signal(sig)
        demo.wait(timeout=30)
        left = tagged(tag)
        while left and time.monotonic() - t_sig < 30:
            time.sleep(0.5)
            left = tagged(tag)
        err = (tmp_path / "stderr").read_text()
        assert not left, f"{len(left)} of the demo's {len(before)} processes left 30 s after {sig.name}: {left}"
        assert demo.returncode == 128 + sig, (demo.returncode, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[demo ")]
        assert lines[-1].startswith(f"verl-tokensel demo: stopped by {sig.name}; the verl run in progress and the "
                                    "Ray processes it started were ended"), err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        for pid in [demo.pid, *tagged(tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        demo.wait(timeout=30)
