"""Faults in a real selecting run (verl's ``main_ppo`` on CPU, V1 driver, ``forking``): a process is killed
with SIGKILL while it works, and the run must end on its own: a non-zero exit, within a bounded time after
the kill, a message naming what died (:attr:`verl_tokensel_cpu.launch.RunResult.died`), and no process of the
run left behind (every process the run started carries its marker variable; none may survive).

- ``test_actor_worker_killed_during_the_update``: the FSDP2 actor worker (its pid is the one that
  announced the selecting loss) is killed after it has computed without pause for 1.5 s. With
  ``ppo_epochs=40`` the update of step 1 is the only such stretch (the old-log-prob pass of the tiny model
  takes a fraction of a second), so the kill lands in the update.
- ``test_vllm_engine_killed_during_generation``: vLLM's engine process (``EngineCore``, the server's child
  that runs the model) is killed once it has computed for 0.3 s after the trainer said it is ready to fit,
  i.e. during step 1's generation.

Both are ``slow`` (about 3 minutes on 2 cores, two runs up to their first step: over the default suite's budget);
run them before a release with ``python -m pytest -m slow tests/test_faults_on_cpu.py``. The default suite keeps the
launcher's end of a run and of every process it started (``test_launch_on_cpu.py``) and the driver-side scoring fault
(a Ray score worker killed during a scoring call, ``test_ray_scorer_on_cpu.py``).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from helpers.pipeline import loss_announcements, prepare_tiny_run
from helpers.procs import wait_until_busy
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
from verl_tokensel_cpu.launch import marked_pids, run_main_ppo

pytestmark = pytest.mark.requires("verl", "ray", "vllm")

RUN_TIMEOUT_S = 600
#: after the kill, the run must have ended (exit, and its processes gone) within this many seconds
END_WITHIN_S = 150
READY = "all initialize finished"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("faults_model") / "tiny"))


def _kill_when_busy(log_path: Path, find_pid, busy_s: float, stop: threading.Event, out: dict) -> None:
    """Wait for the trainer's READY line and ``find_pid(log text)``; then SIGKILL that pid once it has used
    a CPU core for ``busy_s`` seconds without a pause."""
    pid = None
    while not stop.is_set() and pid is None:
        time.sleep(0.2)
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            continue
        if READY in text:
            pid = find_pid(text)
    if pid is None:
        return
    if not wait_until_busy(pid, busy_s, stop=stop):
        out["error"] = f"pid {pid} vanished or never computed for {busy_s} s"
        return
    os.kill(pid, signal.SIGKILL)
    out.update(pid=pid, t=time.monotonic())


def _run_with_kill(tmp_path: Path, model_dir: Path, find_pid, busy_s: float, extra: list[str]):
    overrides = prepare_tiny_run(tmp_path, model_dir=model_dir, token_selector="forking", use_v1=True, steps=2)
    log_path = tmp_path / "main_ppo.log"
    stop, killed = threading.Event(), {}
    killer = threading.Thread(target=_kill_when_busy, args=(log_path, find_pid, busy_s, stop, killed), daemon=True)
    killer.start()
    try:
        result = run_main_ppo(overrides + extra, timeout_s=RUN_TIMEOUT_S, log_path=log_path)
    finally:
        stop.set()
        killer.join(timeout=5)
    ended = time.monotonic()
    assert "pid" in killed, f"nothing was killed ({killed.get('error', 'the target never showed up')}); " \
                            f"{result.describe()}"
    took = ended - killed["t"]
    print(f"killed pid {killed['pid']}; the run ended {took:.0f} s later: {result.describe()}")
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert took < END_WITHIN_S, (took, result.describe())
    assert marked_pids(result.run_id) == [], "processes of the run survived it"
    return result, killed["pid"]


def _actor_pid(text: str) -> int | None:
    said = [a for a in loss_announcements(text) if a["selector"] == "forking"]
    return said[0]["pid"] if said else None


@pytest.mark.slow  # ~90 s, over the default suite's budget (.ci/run < 35 min); the default suite keeps the launcher's
# own end of a run and of what it started (test_launch_on_cpu.py::test_timeout_kills_the_run_and_what_it_started) and a
# Ray worker SIGKILLed mid-call failing loudly (test_ray_scorer_on_cpu.py::test_worker_killed_during_a_scoring_call);
# a killed actor or vLLM engine in the whole pipeline runs here, before a release (-m slow)
def test_actor_worker_killed_during_the_update(model_dir, tmp_path):
    result, pid = _run_with_kill(tmp_path, model_dir, _actor_pid, busy_s=1.5,
                                 extra=["actor_rollout_ref.actor.ppo_epochs=40"])
    assert result.steps == [], "the update of step 1 cannot have finished"
    # the trainer's call that failed: verl 0.9.1's update (our trainer mode's _update_actor, then verl's)
    assert "in _update_actor" in result.log_path.read_text(errors="replace"), result.log_tail()
    assert result.died and "actor" in result.died.lower() and str(pid) in result.died, result.died
    assert result.died in result.describe()


def _engine_pid(text: str) -> int | None:
    m = re.search(r"\(EngineCore pid=(\d+)\)", text)
    return int(m[1]) if m else None


@pytest.mark.slow  # ~90 s; with test_actor_worker_killed_during_the_update (the same fault path: a Ray process
# SIGKILLed mid-step, the run failing with the dead process named), run before a release
def test_vllm_engine_killed_during_generation(model_dir, tmp_path):
    result, _ = _run_with_kill(tmp_path, model_dir, _engine_pid, busy_s=0.3, extra=[])
    assert result.steps == []
    assert result.died and "vLLM" in result.died, result.died
    assert result.died in result.describe()
