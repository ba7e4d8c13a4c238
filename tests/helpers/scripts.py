"""Run a launch script (``examples/*.sh``) as a user would, with the guarantees of
:func:`verl_tokensel_cpu.launch.run_main_ppo` (helper, not a test).

:func:`run_script` runs ``bash <script> <args> <metrics overrides>`` in its own process group with an outer
timeout, kills every process of the run afterwards (the script, ``main_ppo``, a local Ray instance: they all
carry the run's marker variable :data:`~verl_tokensel_cpu.launch.RUN_MARKER_ENV`), and returns a
:class:`~verl_tokensel_cpu.launch.RunResult` with the per-step metrics. The script must hand its trailing
arguments to ``main_ppo`` as Hydra overrides (``"$@"``): the metrics overrides travel that way.

Example::

    result = run_script(["examples/run_dapo.sh", "trainer.device=cpu"], env={"TOKENSEL_MODEL_PATH": ...},
                        timeout_s=600, log_path=work / "run.log")
    result.raise_for_status()
    result.steps  # [{"step": 1, "actor/pg_loss": ..., ...}]
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

from verl_tokensel_cpu.launch import RUN_MARKER_ENV, RunResult, kill_marked, last_stage, marked_pids, read_metrics, \
    what_died

__all__ = ["metrics_overrides", "run_script"]

TIMEOUT_RETURNCODE = 124


def metrics_overrides(metrics_path: Path) -> list[str]:
    """Overrides that make verl's ``file`` logger write one JSON line per step to ``metrics_path`` (from the
    TaskRunner, wherever it runs: the path travels in the Ray runtime env, as in ``run_main_ppo``)."""
    return ["trainer.logger=[console,file]",
            f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={json.dumps(str(metrics_path))}"]


def run_script(argv: Sequence[str], *, env: dict, timeout_s: float, log_path: Path, cwd: Optional[Path] = None,
               inherit_env: bool = True, kill_grace_s: float = 10.0) -> RunResult:
    """``bash <argv> <metrics overrides>`` with ``env`` added to this process's environment (``inherit_env``)
    or as the whole environment; see the module docstring. The metrics go to ``<log_path
    stem>.metrics.jsonl`` (a previous run's file is removed first)."""
    log_path = Path(log_path).resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path = log_path.with_name(log_path.stem + ".metrics.jsonl")
    metrics_path.unlink(missing_ok=True)
    marker = uuid.uuid4().hex
    cmd = ["bash", *map(str, argv), *metrics_overrides(metrics_path)]
    run_env = {**(os.environ if inherit_env else {}), **env, RUN_MARKER_ENV: marker, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log_fp:
        log_fp.write(("$ " + " ".join(cmd) + "\n").encode())
        log_fp.flush()
        proc = subprocess.Popen(cmd, stdout=log_fp, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=run_env,
                                cwd=cwd, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, TIMEOUT_RETURNCODE
        finally:
            # the script's processes, and what outlives them (a local Ray instance's daemons and workers)
            if proc.poll() is None or marked_pids(marker):
                kill_marked(marker, kill_grace_s)
                proc.wait(timeout=30)
    log_text = log_path.read_text(errors="replace")
    return RunResult(returncode=returncode, timed_out=timed_out, wall_s=time.monotonic() - t0, log_path=log_path,
                     metrics_path=metrics_path, command=cmd, steps=read_metrics(metrics_path),
                     last_stage=last_stage(log_text), died=what_died(log_text) if returncode != 0 else None,
                     run_id=marker)
