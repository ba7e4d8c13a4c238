"""The outer-timeout launcher (verl_tokensel_cpu.launch) on a fake entry point: no verl, no Ray, a few seconds.

The fake ``main_ppo`` prints a pipeline stage, writes one metrics line the way verl's ``file`` logger does,
starts a grandchild in ITS OWN session (as Ray's raylet/workers may be) and then hangs. The launcher must
time out, report the stage it was stuck in, exit 124, and kill the grandchild too (found by the run marker).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

from verl_tokensel_cpu.launch import TIMEOUT_RETURNCODE, last_stage, read_metrics, run_main_ppo

FAKE = textwrap.dedent('''
    import json, os, subprocess, sys, time
    args = sys.argv[1:]
    path = os.environ["VERL_FILE_LOGGER_PATH"]
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "data": {"actor/pg_loss": 0.5}}) + "\\n")
    print("ARGS " + json.dumps(args), flush=True)
    print("(TaskRunnerV1 pid=1) INFO: reward loop manager initialized", flush=True)
    if os.environ.get("FAKE_MODE") == "ok":
        sys.exit(0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(os.environ["FAKE_PIDFILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _write_fake(tmp_path: Path) -> None:
    (tmp_path / "fake_main_ppo.py").write_text(FAKE)


def test_timeout_kills_the_run_and_what_it_started(tmp_path):
    _write_fake(tmp_path)
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    result = run_main_ppo(["a=1"], timeout_s=8, log_path=tmp_path / "run.log", entry="fake_main_ppo", cwd=tmp_path,
                          env={"FAKE_PIDFILE": str(pidfile)}, kill_grace_s=2)
    assert time.monotonic() - t0 < 30
    assert result.timed_out and result.returncode == TIMEOUT_RETURNCODE and not result.ok
    assert result.last_stage == "waiting for the vLLM server"
    assert "waiting for the vLLM server" in result.describe()
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(grandchild), "a process started by the run (own session) survived the timeout"
    assert result.steps == [{"step": 1, "actor/pg_loss": 0.5}]  # metrics written before the hang are kept
    assert "timed out" in result.log_path.read_text()


def test_success_adds_cpu_switch_and_file_logger(tmp_path):
    _write_fake(tmp_path)
    result = run_main_ppo(["x.y=2"], timeout_s=60, log_path=tmp_path / "ok.log", entry="fake_main_ppo",
                          cwd=tmp_path, env={"FAKE_MODE": "ok"})
    result.raise_for_status()
    args = json.loads(next(line[5:] for line in result.log_path.read_text().splitlines() if line.startswith("ARGS ")))
    assert args[0] == "x.y=2" and "trainer.device=cpu" in args and "trainer.logger=[console,file]" in args
    assert any(a.startswith("++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=") for a in args)
    assert "++ray_kwargs.ray_init.address=local" in args
    assert result.metric("actor/pg_loss") == [0.5]
    # cpu=False: no switch; an explicit trainer.logger keeps its loggers and gets `file` added
    result = run_main_ppo(["trainer.logger=['console', wandb]"], timeout_s=60, log_path=tmp_path / "gpu.log",
                          entry="fake_main_ppo", cwd=tmp_path, env={"FAKE_MODE": "ok"}, cpu=False)
    args = json.loads(next(line[5:] for line in result.log_path.read_text().splitlines() if line.startswith("ARGS ")))
    assert "trainer.device=cpu" not in args
    assert [a for a in args if a.startswith("trainer.logger")] == ["trainer.logger=[console,wandb,file]"]


def test_read_metrics_merges_lines_of_a_step_and_skips_cut_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 2, "data": {"a": 1}}\n{"step": 1, "data": {"a": 0}}\n{"step": 2, "data": {"b": 3}}\n'
                 '{"step": 3, "da')
    assert read_metrics(p) == [{"step": 1, "a": 0}, {"step": 2, "a": 1, "b": 3}]


def test_last_stage_names_the_hang():
    log = ("ray init kwargs: {}\n(WorkerDict pid=3) AttributeError: 'Parameter' object has no attribute "
           "'weight_loader'\n")
    assert "weight sync" in last_stage(log)
    assert last_stage("nothing here") is None
    assert last_stage("Training Progress:  50%|#####     | 1/2 [01:57<01:57]") .startswith("training (steps done: 1")


def test_cpu_with_the_stock_entry_point_is_refused_before_starting(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="verl_tokensel.main_ppo"):
        run_main_ppo([], timeout_s=5, log_path=tmp_path / "x.log", entry="verl.trainer.main_ppo")
    assert not (tmp_path / "x.log").exists()


def test_job_submission_command(tmp_path):
    from verl_tokensel_cpu.launch import _build_command

    cmd = _build_command("verl_tokensel.main_ppo", ["a=1"], cpu=True, metrics_path=tmp_path / "m.jsonl",
                         ray_address="local", python=sys.executable, ray_job_address="http://127.0.0.1:8265",
                         submission_id="tokensel-x")
    sep = cmd.index("--")
    assert cmd[1:sep] == ["job", "submit", "--address", "http://127.0.0.1:8265", "--submission-id", "tokensel-x"]
    assert cmd[sep + 1:sep + 4] == [sys.executable, "-m", "verl_tokensel.main_ppo"]
    assert "--runtime-env-json" not in cmd  # Ray refuses to merge a job env with the driver's ray.init env
    assert not any("ray_init.address" in a for a in cmd)  # the job's driver joins its own cluster


def test_job_runtime_env_travels_with_the_job_and_env_vars_are_refused(tmp_path):
    from verl_tokensel_cpu.launch import _build_command

    env = {"pip": ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}/verl_tokensel-0.1.0-py3-none-any.whl"]}
    cmd = _build_command("verl_tokensel.main_ppo", ["a=1"], cpu=True, metrics_path=tmp_path / "m.jsonl",
                         ray_address="local", python=sys.executable, ray_job_address="http://127.0.0.1:8265",
                         job_runtime_env=env, job_working_dir=tmp_path)
    sep = cmd.index("--")
    assert json.loads(cmd[cmd.index("--runtime-env-json") + 1]) == env
    assert cmd[cmd.index("--working-dir") + 1] == str(tmp_path) and cmd.index("--working-dir") < sep
    assert cmd[sep + 1:sep + 4] == ["python", "-m", "verl_tokensel.main_ppo"]  # the runtime env's interpreter
    import pytest

    with pytest.raises(ValueError, match="must not set 'env_vars'.*ray_kwargs.ray_init.runtime_env.env_vars"):
        run_main_ppo(["a=1"], timeout_s=5, log_path=tmp_path / "x.log", ray_job_address="http://127.0.0.1:8265",
                     job_runtime_env={"env_vars": {"A": "1"}})
    with pytest.raises(ValueError, match="needs ray_job_address"):
        run_main_ppo(["a=1"], timeout_s=5, log_path=tmp_path / "x.log", job_runtime_env=env)
    assert not (tmp_path / "x.log").exists()  # refused before anything started


#: excerpts of real logs of the fault tests (tests/test_faults_on_cpu.py), Ray 2.60 / vLLM 0.28
ACTOR_DEATH = """\
\x1b[33m(raylet)\x1b[0m A worker died or was killed while executing a task by an unexpected system error. \
To troubleshoot the problem, check the logs for the dead worker. Lease ID: 03000000a1f0 Worker ID: 6644654f \
Node ID: 33b61981 Worker IP address: 192.0.2.2 Worker port: 41107 Worker PID: 26701 Worker exit type: SYSTEM_ERROR
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict
\tactor_id: 00aeb196bc41a5f1fa6758f601000000
\tpid: 26701
\tname: DrERjuWorkerDict_0:0
\tnamespace: ff6aaaba-bc9a-462c-bb9a-477fd675c85f
\tip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR
"""
ENGINE_DEATH = """\
\x1b[36m(vLLMHttpServer pid=30626)\x1b[0m ERROR 12-01 22:22:22 [async_llm.py:744] \
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
RuntimeError: Sync replay buffer selected terminal groups with no materializable trajectories.
"""


def test_what_died_names_the_process():
    from verl_tokensel_cpu.launch import what_died

    assert what_died(ACTOR_DEATH) == "the Ray actor WorkerDict DrERjuWorkerDict_0:0 (pid 26701, node 192.0.2.2) died"
    assert what_died(ACTOR_DEATH.split("ray.exceptions")[0]) == (
        "a Ray worker process (pid 26701) died while running a task")
    assert what_died(ENGINE_DEATH) == "the vLLM engine process (EngineCore) died"
    assert what_died("Training Progress: 100%|##| 2/2\nFinal validation metrics: None\n") is None
