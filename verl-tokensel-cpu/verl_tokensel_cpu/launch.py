"""Run verl's ``main_ppo`` in a subprocess with an outer wall-clock timeout, and read its metrics back.

Why one file over 400 lines: the launcher is one process-lifecycle story read top to bottom (command,
process group, optional Ray head and job submission, timeout and kill escalation, metrics), used by
``python -m verl_tokensel_cpu.launch``, the demo and the end-to-end tests.

Why: two failure modes of the verl pipeline hang instead of failing (a weight-sync error inside the vLLM
server, and Ray resources that never become available). :func:`run_main_ppo` always ends, on success,
failure, timeout or Ctrl-C, killing every process the run started (its process group and every process
carrying its marker variable, never anything else), and returns a :class:`RunResult` with the per-step
metrics, the last pipeline stage seen and, for a failed run, the process whose death ended it
(:data:`DEATHS`). :func:`start_ray_head` / :meth:`RayHead.add_node` start a private one- or two-node Ray
cluster on this host. Every argument, with examples: ``docs/cpu.md`` ("Unattended runs: the launcher").

Signals: under :func:`stop_on_signals` (the command line below and ``verl-tokensel demo``), SIGINT and SIGTERM
raise :class:`Interrupted` in the main thread; :func:`run_main_ppo` then kills the run as on a timeout (its process
group and every marked process: the ``main_ppo`` driver, the Ray instance it started, Ray's workers) and the
caller prints one line and exits 128 + the signal's number (130, 143).

Command line (exit code 124 on timeout, 130 / 143 on SIGINT / SIGTERM)::

    python -m verl_tokensel_cpu.launch --timeout 900 --log /tmp/run.log -- <hydra overrides>
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["RunResult", "run_main_ppo", "read_metrics", "last_stage", "PIPELINE_STAGES", "RUN_MARKER_ENV",
           "ENGINE_OVERRIDES", "HF_CHECKPOINT_DIRS", "RayHead", "RayNode", "start_ray_head", "kill_marked",
           "marked_pids", "what_died", "DEATHS", "Interrupted", "stop_on_signals", "STOP_SIGNALS"]

#: every process started by a run inherits this variable; the kill path finds them by it
RUN_MARKER_ENV = "VERL_TOKENSEL_RUN_ID"
TIMEOUT_RETURNCODE = 124

#: the overrides that choose the actor's engine: verl's config group ``model_engine`` (``dp``, verl's default,
#: runs as FSDP2 under ``trainer.device=cpu``); the demo's ``--engine`` and the pipeline tests use them
ENGINE_OVERRIDES: dict[str, tuple[str, ...]] = {"fsdp2": (), "megatron": ("model_engine=megatron",)}
#: where a step's checkpoint (``<trainer.default_local_dir>/global_step_<n>``) keeps the actor's HF weights when
#: ``actor.checkpoint.save_contents`` has ``hf_model``, per engine (Megatron writes them through mbridge)
HF_CHECKPOINT_DIRS: dict[str, str] = {"fsdp2": "actor/huggingface", "megatron": "actor/model/huggingface"}

#: (regex on one log line, what the pipeline is doing from then on; ``{1}`` = the regex's first group).
#: The stage of the LAST matching line is reported on timeout. Patterns are verl 0.9.1 / Ray 2.60 /
#: vLLM 0.28 log lines of a CPU run (driver, TaskRunner and worker output all reach the driver's log).
PIPELINE_STAGES: tuple[tuple[str, str], ...] = (
    (r"ray init kwargs", "starting Ray"),
    (r"Started a local Ray instance|Connecting to existing Ray cluster",
     "waiting for the TaskRunner (Ray resources: CPU)"),
    (r"colocated worker base class|create worker group",
     "waiting for Ray resources ({resources}) and building the actor workers (FSDP2 or Megatron)"),
    (r"actor and ref model engine initialized", "starting the reward workers"),
    (r"reward loop manager initialized|vLLMHttpServer pid=\d+\)\s+\['serve'", "waiting for the vLLM server"),
    (r"LLMServerManager:|checkpoint engine manager initialized", "initial weight sync (actor -> vLLM)"),
    (r"all initialize finished", "training step 1 (rollout)"),
    (r"Training Progress:.*\|\s*(\d+)/\d+", "training (steps done: {1}; rollout, reward, update, weight sync)"),
    (r"Final validation metrics", "shutting down"),
    # failures that make the trainer wait forever instead of exiting
    (r"cannot be scheduled right now|No available node types can fulfill|Waiting for.*resources",
     "waiting for Ray resources that do not exist (num_gpus / num_cpus too small?)"),
    (r"has no attribute 'weight_loader'",
     "weight sync (actor -> vLLM) failed in the vLLM worker; the trainer then waits forever"),
)


#: what verl's resource pools wait for, by device (``{resources}`` in :data:`PIPELINE_STAGES`): on a CPU host the
#: "GPU" of verl's placement-group bundles is a logical Ray resource that the CPU switch declares
STAGE_RESOURCES = {"cpu": "CPU cores and the logical GPUs trainer.device=cpu declares on this host",
                   "gpu": "GPU bundles"}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its "(Actor pid=N)" prefixes

#: what a scheduler, ``timeout`` or ``kill`` (SIGTERM) and Ctrl-C (SIGINT) send
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A signal of :data:`STOP_SIGNALS` arrived under :func:`stop_on_signals`. A :class:`BaseException`, as
    ``KeyboardInterrupt``: ``except Exception`` blocks let it through to the caller, which says so in one line and
    exits :attr:`exit_code`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        #: ``SIGINT`` / ``SIGTERM``
        self.name = signal.Signals(signum).name
        #: 128 + the signal's number, as a shell reports a process ended by it (130, 143)
        self.exit_code = 128 + signum


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread while inside (a run in progress is then
    killed by :func:`run_main_ppo` on its way out); a second signal during that kill is ignored, so the kill
    finishes. The previous handlers are restored on exit. Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


@dataclass
class RunResult:
    """Outcome of one :func:`run_main_ppo` call."""

    #: exit code of the run; 124 when it timed out
    returncode: int
    timed_out: bool
    #: wall-clock seconds from launch to exit (or kill)
    wall_s: float
    log_path: Path
    metrics_path: Path
    command: list[str]
    #: one dict per logged training step (verl's metric names plus "step"), in step order
    steps: list[dict] = field(default_factory=list)
    #: the last pipeline stage recognised in the log (see PIPELINE_STAGES), None if none
    last_stage: Optional[str] = None
    #: what died, when the log says a process of the run died (see :func:`what_died`), else None
    died: Optional[str] = None
    #: the run's marker (value of ``RUN_MARKER_ENV`` in every process it started; :func:`marked_pids`)
    run_id: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def metric(self, name: str) -> list[float]:
        """Values of metric ``name`` over the logged steps (steps without it are skipped)."""
        return [s[name] for s in self.steps if name in s]

    def log_tail(self, n_lines: int = 60) -> str:
        try:
            return log_tail(self.log_path, n_lines)
        except OSError:
            return ""

    def describe(self) -> str:
        if self.timed_out:
            return (f"main_ppo timed out after {self.wall_s:.0f} s, while {self.last_stage or 'starting up'} "
                    f"(log: {self.log_path})")
        if self.returncode != 0:
            died = f"; {self.died}" if self.died else ""
            return (f"main_ppo exited with code {self.returncode} after {self.wall_s:.0f} s{died} "
                    f"(last stage: {self.last_stage or 'unknown'}; log: {self.log_path})")
        return f"main_ppo finished in {self.wall_s:.0f} s, {len(self.steps)} steps logged"

    def raise_for_status(self) -> "RunResult":
        if not self.ok:
            raise RuntimeError(self.describe() + "\n--- log tail ---\n" + self.log_tail())
        return self


def read_metrics(path: Path) -> list[dict]:
    """Parse verl's ``file`` logger output (``{"step": n, "data": {...}}`` per line) into flat dicts."""
    steps: dict[int, dict] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        step = int(rec.get("step", -1))
        steps.setdefault(step, {"step": step}).update(rec.get("data", {}))
    return [steps[k] for k in sorted(steps)]


def log_tail(path: Path, n_lines: int = 60) -> str:
    """The last ``n_lines`` lines of a log (streamed, not read whole); OSError if it cannot be read."""
    with open(path, errors="replace") as f:
        return "".join(collections.deque(f, maxlen=n_lines)).rstrip("\n")


def default_metrics_path(log_path: Path) -> Path:
    """Where a run logged to ``log_path`` writes its per-step metrics unless told otherwise."""
    return log_path.with_name(log_path.stem + ".metrics.jsonl")


def last_stage(log_text: str, device: str = "gpu") -> Optional[str]:
    """The stage of :data:`PIPELINE_STAGES` whose pattern matched the latest line of ``log_text``, naming the
    resources of ``device`` (``cpu`` or ``gpu``, :data:`STAGE_RESOURCES`) that Ray waits for."""
    compiled = [(re.compile(p), s) for p, s in PIPELINE_STAGES]
    found = None
    for line in _ANSI.sub("", log_text).splitlines():
        for rx, stage in compiled:
            m = rx.search(line)
            if m:
                found = stage.format(None, *m.groups(), resources=STAGE_RESOURCES.get(device, device))
    return found


#: (regex on the log, what died) for the process deaths :func:`what_died` recognises, most specific first;
#: ``{name}`` fields are the regex's named groups. Ray 2.60 / vLLM 0.28 messages.
DEATHS: tuple[tuple[str, str], ...] = (
    (r"Task was killed due to the node running low on memory|OutOfMemoryError",
     "a process was killed for lack of memory (Ray's OOM killer)"),
    (r"The actor died unexpectedly before finishing this task\.\s+class_name: (?:\S+\.)?(?P<cls>[^.\s]+)\s+"
     r"actor_id: \S+\s+pid: (?P<pid>\d+)(?:\s+name: (?P<name>\S+))?(?:\s+namespace: \S+)?(?:\s+ip: (?P<ip>\S+))?",
     "the Ray actor {cls} {name} (pid {pid}, node {ip}) died"),
    (r"Engine core proc (?P<name>\S+) died unexpectedly|EngineDeadError",
     "the vLLM engine process (EngineCore) died"),
    (r"A worker died or was killed while executing a task[^\n]*?Worker PID: (?P<pid>\d+)",
     "a Ray worker process (pid {pid}) died while running a task"),
    (r"ActorDiedError|The actor is dead because", "a Ray actor died"),
    (r"NodeDiedError|node \S+ has been marked dead", "a Ray node died"),
)


def what_died(log_text: str) -> Optional[str]:
    """The most specific process death a run's log reports (:data:`DEATHS`), in words, or None."""
    text = _ANSI.sub("", log_text)
    # Ray prefixes each forwarded line with "(Actor pid=N) "; drop it so multi-line messages stay contiguous
    text = re.sub(r"^\(\S+ pid=\d+(?:, ip=[\d.]+)?\)\s?", "", text, flags=re.M)
    for pattern, words in DEATHS:
        m = re.search(pattern, text)
        if m:
            fields = {k: v or "?" for k, v in m.groupdict().items()}
            return re.sub(r"\s+", " ", words.format(**fields)).replace(" ? (", " (").replace(", node ?)", ")")
    return None


def _has_override(overrides: Sequence[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def _with_file_logger(overrides: list[str]) -> list[str]:
    """Make sure verl's ``file`` logger is on: add it to a ``trainer.logger`` override, or add
    ``trainer.logger=[console,file]`` (verl's default ``[console, wandb]`` fails without a wandb login)."""
    out, found = [], False
    for o in overrides:
        prefix, sep, value = o.partition("=")
        if prefix.lstrip("+") == "trainer.logger" and sep:
            found = True
            names = [n.strip().strip("'\"") for n in value.strip().strip("[]").split(",") if n.strip()]
            if "file" not in names:
                names.append("file")
            o = f"{prefix}=[{','.join(names)}]"
        out.append(o)
    if not found:
        out.append("trainer.logger=[console,file]")
    return out


def _ray_executable(python: str) -> str:
    candidate = Path(python).parent / "ray"
    return str(candidate) if candidate.exists() else "ray"


def _build_command(entry: str, overrides: Sequence[str], *, cpu: bool, metrics_path: Path,
                   ray_address: Optional[str], python: str, ray_job_address: Optional[str] = None,
                   submission_id: Optional[str] = None, job_runtime_env: Optional[dict] = None,
                   job_working_dir: Optional[Path] = None) -> list[str]:
    ov = list(overrides)
    if ray_job_address is not None:
        ray_address = None  # the job's driver joins the cluster it runs on (RAY_ADDRESS set by Ray)
    if cpu and not _has_override(ov, "trainer.device"):
        ov.append("trainer.device=cpu")
    ov = _with_file_logger(ov)
    ov.append(f"++ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={json.dumps(str(metrics_path))}")
    if ray_address is not None and not _has_override(ov, "ray_kwargs.ray_init.address"):
        ov.append(f"++ray_kwargs.ray_init.address={ray_address}")
    if ray_job_address is not None:
        # a job-level runtime env carries no env_vars (see _check_job_runtime_env)
        job = [_ray_executable(python), "job", "submit", "--address", ray_job_address]
        if submission_id:
            job += ["--submission-id", submission_id]
        if job_working_dir is not None:
            job += ["--working-dir", str(job_working_dir)]
        if job_runtime_env:
            job += ["--runtime-env-json", json.dumps(job_runtime_env)]
        # the job's own interpreter (the runtime env's, when it installs packages), not this process's
        return [*job, "--", "python" if job_runtime_env else python, "-m", entry, *ov]
    return [python, "-m", entry, *ov]


def _check_job_runtime_env(job_runtime_env: Optional[dict], ray_job_address: Optional[str]) -> None:
    """Refuse a job-level runtime env that Ray could not merge with the driver's, before anything starts."""
    if not job_runtime_env:
        return
    if ray_job_address is None:
        raise ValueError("run_main_ppo(job_runtime_env=...) needs ray_job_address: a runtime env is attached to a "
                         "submitted Ray job only")
    if "env_vars" in job_runtime_env:
        raise ValueError(
            "run_main_ppo(job_runtime_env=...) must not set 'env_vars': the job's driver calls "
            "ray.init(runtime_env={'env_vars': ...}) itself (the CPU switch and the metrics path go there) and "
            "Ray refuses to merge two runtime envs that both set a variable. Fix: pass them as overrides "
            "++ray_kwargs.ray_init.runtime_env.env_vars.<NAME>=<value>, or through env=... for the submitting "
            "process; keep pip, working_dir, py_modules etc. in job_runtime_env.")


def marked_pids(marker: str) -> list[int]:
    """PIDs of this user's processes whose environment carries ``RUN_MARKER_ENV=marker`` (a run's
    :attr:`RunResult.run_id`, a head's :attr:`RayHead.marker`)."""
    needle = f"{RUN_MARKER_ENV}={marker}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue  # gone, or not ours
    return pids


def _escalate(send, done, grace_s: float) -> None:
    """``send(SIGTERM)``, wait up to ``grace_s`` for ``done()``, then ``send(SIGKILL)`` and wait 5 s more."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        send(sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.2)


def _signal_marked(marker: str, sig: int) -> None:
    for pid in marked_pids(marker):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_run(proc: subprocess.Popen, marker: str, grace_s: float) -> None:
    """SIGTERM the run's process group and marked processes, SIGKILL what is left after ``grace_s``."""

    def send(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        _signal_marked(marker, sig)

    _escalate(send, lambda: proc.poll() is not None and not marked_pids(marker), grace_s)


def kill_marked(marker: str, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, every process carrying ``RUN_MARKER_ENV=marker``."""
    _escalate(lambda sig: _signal_marked(marker, sig), lambda: not marked_pids(marker), grace_s)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RayNode:
    """A node joined to a :class:`RayHead` by :meth:`RayHead.add_node`."""

    node_ip: str
    temp_dir: Path
    resources: dict


@dataclass
class RayHead:
    """A Ray head started by :func:`start_ray_head`; ``address`` is its dashboard (job submission) URL."""

    address: str
    gcs_address: str
    temp_dir: Path
    marker: str
    #: env vars a client (``ray job submit``, ``run_main_ppo(env=...)``) needs: Ray 2.60 token auth
    client_env: dict = field(default_factory=lambda: {"RAY_AUTH_MODE": "token"})
    #: remove ``temp_dir`` (Ray's session logs) on stop: True when start_ray_head created it
    owns_temp_dir: bool = False
    #: the Python whose ``ray`` command started the head (and starts added nodes)
    python: str = sys.executable
    #: environment of ``ray start`` (the marker included), reused by :meth:`add_node`
    start_env: dict = field(default_factory=dict, repr=False)
    #: nodes added with :meth:`add_node`
    nodes: list = field(default_factory=list)

    def add_node(self, *, num_cpus: int, num_gpus: int = 0, resources: Optional[dict] = None,
                 node_ip: str = "127.0.0.2", timeout_s: float = 120.0) -> "RayNode":
        """Join a second Ray node to this head, on this host (``ray start --address``): its own loopback IP
        (Linux routes all of 127.0.0.0/8 to ``lo``), ports and temp dir (so its runtime envs are built in
        its own folder, as on a separate machine), and custom ``resources`` to pin work there. It carries
        this head's marker: :meth:`stop` ends it too."""
        import tempfile

        temp_dir = Path(tempfile.mkdtemp(prefix="rayn", dir="/tmp"))
        cmd = [_ray_executable(self.python), "start", "--address", self.gcs_address, "--node-ip-address", node_ip,
               "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--temp-dir", str(temp_dir),
               "--disable-usage-stats"]
        if resources:
            cmd += ["--resources", json.dumps(resources)]
        for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                     "--metrics-export-port", "--node-manager-port", "--object-manager-port"):
            cmd += [flag, str(_free_port())]
        node = RayNode(node_ip=node_ip, temp_dir=temp_dir, resources=dict(resources or {}))
        self.nodes.append(node)
        out = subprocess.run(cmd, env=self.start_env or None, capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(f"`ray start --address {self.gcs_address}` (node {node_ip}) failed ({out.returncode}):"
                               f"\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return node

    def stop(self, grace_s: float = 10.0) -> None:
        """End every process this head started (Ray daemons and workers, jobs, added nodes), nothing else."""
        kill_marked(self.marker, grace_s)
        import shutil

        for node in self.nodes:
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        if self.owns_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayHead":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_ray_head(*, num_cpus: int = 16, num_gpus: int = 1, timeout_s: float = 120.0,
                   temp_dir: Optional[Path] = None, python: str = sys.executable,
                   env: Optional[dict] = None) -> RayHead:
    """Start a private single-node Ray head (``ray start --head``) for job submission; see module doc.

    ``num_gpus`` are logical on CPU (verl's resource pools request "GPU"). Every port is a free one and
    the temp dir is private (``ray.init()`` of other users on this host will not find this cluster).
    """
    import tempfile

    owns_temp_dir = temp_dir is None
    temp_dir = Path(temp_dir) if temp_dir else Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))  # short: socket paths
    marker = uuid.uuid4().hex
    gcs_port, dash_port = _free_port(), _free_port()
    ports = {flag: _free_port() for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                                               "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                                               "--metrics-export-port", "--node-manager-port",
                                               "--object-manager-port")}
    cmd = [_ray_executable(python), "start", "--head", "--port", str(gcs_port), "--node-ip-address", "127.0.0.1",
           "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
           "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--temp-dir", str(temp_dir),
           "--disable-usage-stats"]
    for flag, port in ports.items():
        cmd += [flag, str(port)]
    # token auth explicitly on (Ray 2.60's default for new clusters; the token is ~/.ray/auth_token, created if
    # missing): clients must then say RAY_AUTH_MODE=token too, see RayHead.client_env
    run_env = {**os.environ, "RAY_AUTH_MODE": "token", **(env or {}), RUN_MARKER_ENV: marker}
    run_env.pop("RAY_ADDRESS", None)
    head = RayHead(address=f"http://127.0.0.1:{dash_port}", gcs_address=f"127.0.0.1:{gcs_port}",
                   temp_dir=temp_dir, marker=marker, owns_temp_dir=owns_temp_dir, python=python, start_env=run_env)
    try:
        out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(
                f"`ray start --head` failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        _wait_for_dashboard(head.address, deadline=time.monotonic() + timeout_s)
    except BaseException:
        head.stop()
        raise
    return head


def _wait_for_dashboard(address: str, deadline: float) -> None:
    import urllib.error
    import urllib.request

    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(address + "/api/version", timeout=5):
                return
        except urllib.error.HTTPError:
            return  # it answers (401 when Ray's token authentication is on; `ray job submit` sends the token)
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
        time.sleep(1.0)
    raise TimeoutError(f"Ray dashboard {address} did not answer: {last}")


def _stop_job(python: str, address: Optional[str], submission_id: Optional[str], env: dict, log_fp) -> None:
    """``ray job stop`` the submitted job: killing the local ``ray job submit`` client does not end it."""
    if address is None or submission_id is None:
        return
    try:
        out = subprocess.run([_ray_executable(python), "job", "stop", "--address", address, submission_id],
                             env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
        log_fp.write(b"\n[verl_tokensel_cpu.launch] ray job stop " + submission_id.encode() + b"\n" + out.stdout[-2000:]
                     + out.stderr[-2000:])
    except (OSError, subprocess.TimeoutExpired) as e:
        log_fp.write(f"\n[verl_tokensel_cpu.launch] ray job stop {submission_id} failed: {e}\n".encode())


def _pump(stream, log_fp, echo: bool) -> None:
    for chunk in iter(lambda: stream.readline(), b""):
        log_fp.write(chunk)
        log_fp.flush()
        if echo:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()


def run_main_ppo(
    overrides: Sequence[str],
    *,
    timeout_s: float,
    log_path: Path,
    cpu: bool = True,
    metrics_path: Optional[Path] = None,
    entry: str = "verl_tokensel.main_ppo",
    ray_address: Optional[str] = "local",
    ray_job_address: Optional[str] = None,
    env: Optional[dict] = None,
    echo: bool = False,
    kill_grace_s: float = 10.0,
    python: str = sys.executable,
    cwd: Optional[Path] = None,
    job_runtime_env: Optional[dict] = None,
    job_working_dir: Optional[Path] = None,
) -> RunResult:
    """Run ``python -m <entry> <overrides>`` with a wall-clock timeout; see the module docstring."""
    _check_job_runtime_env(job_runtime_env, ray_job_address)
    if cpu and entry == "verl.trainer.main_ppo":
        raise ValueError(
            "run_main_ppo(cpu=True, entry='verl.trainer.main_ppo'): the CPU switch trainer.device=cpu is applied "
            "by verl_tokensel.main_ppo only (verl's stock driver has no hook before ray.init and rewrites "
            "trainer.device=cpu to cuda on a host without GPUs, after which Ray waits for GPUs forever). "
            "Fix: entry='verl_tokensel.main_ppo' (the default)."
        )
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path = Path(metrics_path) if metrics_path is not None else default_metrics_path(log_path)
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    if metrics_path.exists():
        metrics_path.unlink()  # never report a previous run's steps
    marker = uuid.uuid4().hex
    submission_id = f"tokensel-{marker[:12]}" if ray_job_address is not None else None
    cmd = _build_command(entry, overrides, cpu=cpu, metrics_path=metrics_path.resolve(), ray_address=ray_address,
                         python=python, ray_job_address=ray_job_address, submission_id=submission_id,
                         job_runtime_env=job_runtime_env, job_working_dir=job_working_dir)
    run_env = {**os.environ, **(env or {}), RUN_MARKER_ENV: marker, "PYTHONUNBUFFERED": "1",
               "VERL_FILE_LOGGER_PATH": str(metrics_path.resolve())}
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log_fp:
        log_fp.write(("$ " + " ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=run_env, cwd=cwd, start_new_session=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log_fp, echo), daemon=True)
        try:
            pump.start()
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_run(proc, marker, kill_grace_s)
                _stop_job(python, ray_job_address, submission_id, run_env, log_fp)
                returncode = TIMEOUT_RETURNCODE
            else:
                # the driver exited; Ray's processes of a local instance may linger a moment: stop them
                if marked_pids(marker):
                    _kill_run(proc, marker, kill_grace_s)
        except BaseException as exc:  # a signal (Interrupted, KeyboardInterrupt), or an exception raised into this
            # thread (e.g. pytest-timeout)
            why = exc.name if isinstance(exc, Interrupted) else type(exc).__name__
            log_fp.write(f"\n[verl_tokensel_cpu.launch] {why}: killing the run\n".encode())
            _kill_run(proc, marker, kill_grace_s)
            _stop_job(python, ray_job_address, submission_id, run_env, log_fp)
            raise
        finally:
            if pump.is_alive():
                pump.join(timeout=5.0)
        wall_s = time.monotonic() - t0
        if timed_out:
            log_fp.write(f"\n[verl_tokensel_cpu.launch] timed out after {timeout_s:.0f} s; process group killed\n"
                         .encode())
    log_text = log_path.read_text(errors="replace")
    return RunResult(returncode=returncode, timed_out=timed_out, wall_s=wall_s, log_path=log_path,
                     metrics_path=metrics_path, command=cmd, steps=read_metrics(metrics_path),
                     last_stage=last_stage(log_text, "cpu" if cpu else "gpu"),
                     died=what_died(log_text) if returncode != 0 else None, run_id=marker)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m verl_tokensel_cpu.launch",
        description="Run verl_tokensel.main_ppo with an outer timeout (kills the run and its Ray processes).",
        epilog="example: python -m verl_tokensel_cpu.launch --timeout 900 --log /tmp/run.log -- "
               "actor_rollout_ref.model.path=/tmp/tiny data.train_files=/tmp/d/train.parquet ...",
    )
    p.add_argument("--timeout", type=float, required=True, help="wall-clock limit in seconds")
    p.add_argument("--log", type=Path, required=True, help="log file (stdout+stderr of the run)")
    p.add_argument("--gpu", action="store_true", help="do not add trainer.device=cpu")
    p.add_argument("--entry", default="verl_tokensel.main_ppo", help="module run with python -m")
    p.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = p.parse_args(argv)
    with stop_on_signals():
        try:
            result = run_main_ppo(args.overrides, timeout_s=args.timeout, log_path=args.log, cpu=not args.gpu,
                                  entry=args.entry, echo=True)
        except Interrupted as stop:
            print(f"{p.prog}: stopped by {stop.name}; the run and the Ray processes it started were ended "
                  f"(log: {args.log})", file=sys.stderr, flush=True)
            return stop.exit_code
    print(result.describe(), file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
