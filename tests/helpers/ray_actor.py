"""verl's REAL actor worker group on a local Ray cluster, CPU only (helper module, not a test file).

What :func:`build_actor_worker_group` builds is what ``verl.trainer.ppo.v1.trainer_base.PPOTrainer._setup``
builds (steps 1, 3 and 6 there): a ``ResourcePoolManager`` with one ``global_pool`` of
``trainer.n_gpus_per_node`` processes, ``ray.remote(ActorRolloutRefWorker)`` wrapped in
``RayClassWithInitArgs(config=config.actor_rollout_ref, role=..., distillation_config=...)``, fused by
``create_colocated_worker_cls`` into verl's ``WorkerDict`` actor, a ``RayWorkerGroup`` spawned per role, and
``init_model()`` on it. Nothing of verl is mocked; the CPU platform
(:mod:`verl_tokensel_cpu.platform`) reaches the Ray workers through the job's ``runtime_env``.

Typical use::

    from helpers import ray_actor as RA
    cfg = RA.compose_tokensel_config(model_dir, ["actor_rollout_ref.actor.token_selector=forking"])
    with RA.local_ray(cfg):                       # a NEW local Ray instance, shut down on exit
        wg = RA.build_actor_worker_group(cfg)     # role "actor": no rollout, no vLLM
        out = wg.update_actor(RA.make_driver_batch(cfg, n=8))
        RA.metric_values(out, "tokensel/selected_fraction")

Importing this module selects the CPU platform in this process (it imports
:mod:`verl_tokensel_cpu.worker`, see its side effects).
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Iterator, Optional, Sequence

from verl_tokensel_cpu import worker as H  # selects the CPU platform first
from verl_tokensel_cpu import batches as B
from verl_tokensel_cpu import platform as cpu_platform

ACTOR_ROLE = "actor"

_COMPOSE_CACHE: dict[tuple, Any] = {}


# ----------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------


def compose_tokensel_config(
    model_dir: str,
    overrides: Sequence[str] = (),
    *,
    config_name: str = "tokensel_trainer",
    **actor_kwargs,
):
    """OUR Hydra config (``verl_tokensel.config``/``tokensel_trainer``) with the CPU actor settings.

    The CPU settings are :func:`verl_tokensel_cpu.worker.cpu_actor_overrides` (fsdp2, fp32 incl.
    mixed precision, eager attention, no torch.compile, no gradient checkpointing, small micro-batches;
    ``actor_kwargs`` go there) plus one process on one node (``trainer.n_gpus_per_node=1``,
    ``trainer.nnodes=1``, ``trainer.device=cpu``). ``overrides`` come last. Cached per arguments; a deep
    copy is returned.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    key = (config_name, model_dir, tuple(overrides), tuple(sorted(actor_kwargs.items())))
    if key not in _COMPOSE_CACHE:
        all_overrides = [
            *H.cpu_actor_overrides(model_dir, **actor_kwargs),
            "trainer.n_gpus_per_node=1",
            "trainer.nnodes=1",
            "trainer.device=cpu",
            "trainer.logger=[console]",
            *overrides,
        ]
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        with initialize_config_module(config_module="verl_tokensel.config", version_base=None):
            _COMPOSE_CACHE[key] = compose(config_name=config_name, overrides=all_overrides)
        GlobalHydra.instance().clear()
    return copy.deepcopy(_COMPOSE_CACHE[key])


# ----------------------------------------------------------------------------------------------------
# Ray
# ----------------------------------------------------------------------------------------------------


def ray_runtime_env(config=None, extra_env: Optional[dict[str, str]] = None) -> dict:
    """verl's PPO runtime env (``get_ppo_ray_runtime_env``) plus the CPU platform's env vars (all str)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    env = get_ppo_ray_runtime_env(config)
    env_vars = dict(env.get("env_vars", {}))
    env_vars.update(cpu_platform.enable_cpu_mode())
    env_vars.setdefault("OMP_NUM_THREADS", "1")
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    env_vars.update(extra_env or {})
    bad = {k: v for k, v in env_vars.items() if not isinstance(v, str)}
    if bad:
        raise TypeError(f"Ray runtime_env env_vars must be strings, got {bad}")
    env["env_vars"] = env_vars
    return env


def start_local_ray(config=None, *, num_cpus: int = 4, num_gpus: int = 1, extra_env=None, **kwargs) -> dict:
    """Start a NEW local Ray instance (never connects to a cluster someone else started).

    ``num_cpus`` is a logical count (verl's placement-group bundles ask for ``max_colocate_count`` CPUs,
    3 for ``ResourcePoolManager``); ``num_gpus`` is logical too: the CPU platform's Ray resource is "GPU".
    Returns ``ray.init``'s context info as a dict.
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError("start_local_ray: Ray is already initialised in this process")
    ctx = ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        runtime_env=ray_runtime_env(config, extra_env),
        log_to_driver=kwargs.pop("log_to_driver", True),
        **kwargs,
    )
    return dict(ctx.address_info) if hasattr(ctx, "address_info") else {}


@contextlib.contextmanager
def _sigalrm_deferred() -> Iterator[None]:
    """Hold back SIGALRM (pytest-timeout's ``signal`` method) for the duration; re-raise it on exit.

    ``ray.init`` interrupted halfway (inside ``ray._private.node.Node.__init__``) leaves Ray's
    DashboardAgent/RuntimeEnvAgent processes running with no way to reach them from ``ray.shutdown()``.
    ``ray.init`` has its own start-up timeouts, so deferring the alarm cannot turn a hang into a block.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    previous = signal.getsignal(signal.SIGALRM)
    if not callable(previous):
        yield
        return
    fired: list = []
    signal.signal(signal.SIGALRM, lambda signum, frame: fired.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)
        if fired:
            previous(*fired[0])


@contextlib.contextmanager
def local_ray(config=None, **kwargs) -> Iterator[dict]:
    """:func:`start_local_ray` ... ``ray.shutdown()`` (only the instance started here).

    The shutdown also runs when start-up fails or a timeout fires at any point after ``ray.init`` began.
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError("local_ray: Ray is already initialised in this process; not starting another")
    try:
        with _sigalrm_deferred():
            info = start_local_ray(config, **kwargs)
        yield info
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------------------------------
# the worker group
# ----------------------------------------------------------------------------------------------------


def build_actor_worker_group(config, role: str = ACTOR_ROLE, init_model: bool = True, worker_cls=None):
    """The actor ``RayWorkerGroup`` exactly as verl's V1 ``PPOTrainer._setup`` builds it, for ``role``.

    ``role="actor"`` builds the actor only (no rollout engine, hence no vLLM). ``init_model`` runs
    ``ActorRolloutRefWorker.init_model`` (engine, optimizer, stock ``partial(ppo_loss, ...)`` loss,
    checkpoint engine) on every rank. ``worker_cls``: the worker class (default verl's
    ``ActorRolloutRefWorker``), e.g. what a trainer's ``role_worker_mapping`` holds.
    """
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.single_controller.ray.base import ResourcePoolManager, create_colocated_worker_cls
    from verl.workers.engine_workers import ActorRolloutRefWorker

    pool_id = "global_pool"
    manager = ResourcePoolManager(
        resource_pool_spec={pool_id: [int(config.trainer.n_gpus_per_node)] * int(config.trainer.nnodes)},
        mapping={role: pool_id},
    )
    manager.create_resource_pool()
    pool = manager.get_resource_pool(role)
    actor_cls = RayClassWithInitArgs(
        cls=ray.remote(worker_cls or ActorRolloutRefWorker),
        config=config.actor_rollout_ref,
        distillation_config=config.get("distillation"),
        role=role,
    )
    class_dict = {role: actor_cls}
    wg_dict = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict),
        device_name=config.trainer.device,
    )
    wg = wg_dict.spawn(prefix_set=class_dict.keys())[role]
    if init_model:
        wg.init_model()
    return wg


def stock_actor_loss(config):
    """What ``ActorRolloutRefWorker.init_model`` binds: ``partial(ppo_loss, config=<actor dataclass>)``."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=omega_conf_to_dataclass(config.actor_rollout_ref.actor))


# ----------------------------------------------------------------------------------------------------
# batches and metrics
# ----------------------------------------------------------------------------------------------------


def make_driver_batch(config, n: Optional[int] = None, seed: int = 0, fmt: str = "v1", **batch_kwargs):
    """The TensorDict a driver hands ``update_actor`` (``make_ppo_batch`` + ``add_driver_meta``).

    ``fmt="v1"``: what the V1 worker gets from TransferQueue (all nested); ``fmt="v0"``: what
    ``RayPPOTrainer._update_actor`` sends (``left_right_2_no_padding`` of padded fields). The meta
    (mini-batch size, epochs, seed, shuffle, temperature, ``calculate_entropy``) is read from ``config``
    as the drivers do (``actor.calculate_entropy or entropy_coeff != 0``).
    """
    from verl_tokensel_cpu import tiny_model

    tokenizer = tiny_model.load_tiny_tokenizer(config.actor_rollout_ref.model.path)
    return B.make_config_batch(config, tokenizer, n=n, seed=seed, fmt=fmt, **batch_kwargs)


def metrics_of(output) -> dict:
    """The ``metrics`` dict of an ``update_actor`` output (a TensorDict from the worker group)."""
    from verl.utils import tensordict_utils as tu

    return dict(tu.get(output, "metrics"))


def metric_values(output_or_metrics, key: str) -> list[float]:
    """All values logged under ``key`` (flattened over mini-/micro-batches), as floats."""
    metrics = output_or_metrics if isinstance(output_or_metrics, dict) else metrics_of(output_or_metrics)
    if key not in metrics:
        raise KeyError(f"metric {key!r} not in update_actor output; keys: {sorted(metrics)}")

    def flat(v):
        if isinstance(v, (list, tuple)):
            for x in v:
                yield from flat(x)
        elif hasattr(v, "value") and not hasattr(v, "shape"):  # verl Metric
            yield from flat(v.value)
        elif hasattr(v, "tolist"):
            yield from flat(v.tolist())
        else:
            yield float(v)

    return list(flat(metrics[key]))


class Timer:
    """``with Timer() as t: ...; t.seconds``."""

    def __enter__(self):
        self.t0 = time.time()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc):
        self.seconds = time.time() - self.t0
        return False


__all__ = [
    "ACTOR_ROLE",
    "Timer",
    "build_actor_worker_group",
    "compose_tokensel_config",
    "local_ray",
    "make_driver_batch",
    "metric_values",
    "metrics_of",
    "ray_runtime_env",
    "start_local_ray",
    "stock_actor_loss",
]
