"""verl 0.9's REAL actor training path, in-process on CPU (or one GPU): the harness behind ``cpu-step``.

Why one file over 400 lines: process set-up, config, the worker, the old-log-prob pass and the training
step share :class:`CpuActor` and the env priming that must run before verl is imported. Batches are in
:mod:`verl_tokensel_cpu.batches`.

:func:`make_training_worker` builds ``verl.workers.engine_workers.TrainingWorker`` (what
``ActorRolloutRefWorker.init_model`` builds) with the FSDP2 engine, or verl's Megatron engine on the test bed of
:mod:`verl_tokensel_cpu.megatron` (``engine="megatron"``), from verl's own Hydra tree with CPU settings; the
loss is set through ``set_loss_fn`` as ``init_model`` does. :func:`run_train_step` feeds it what the drivers
send to ``update_actor``. Use, side effects (importing this module selects the CPU platform and imports verl)
and the GPU mode (``VERL_TOKENSEL_HARNESS_DEVICE=cuda`` before the import): ``docs/cpu.md``::

    from verl_tokensel_cpu.batches import make_update_batch
    from verl_tokensel_cpu.worker import make_training_worker, run_train_step
    actor = make_training_worker(model_dir, use_dynamic_bsz=True, use_remove_padding=False)
    result = run_train_step(actor, make_update_batch(actor, n=8, seed=0), loss_fn=my_loss, capture_grads=True)
"""

from __future__ import annotations

import copy
import functools
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

_PLATFORM_MODULE = "verl_tokensel_cpu.platform"


def _prime_cpu_env() -> None:
    """Select verl's CPU platform before verl is imported in this process.

    An installed ``verl.plugins`` entry point may import verl's engines during ``import verl``, which
    resolves the platform; ``cpu`` must be registered by then, so verl itself has to import the platform
    module first (``VERL_USE_EXTERNAL_MODULES`` runs before entry points). If verl was already imported
    (another test module), ``enable_cpu_mode()`` switches the resolved fallback platform instead.
    """
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    mods = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    if _PLATFORM_MODULE not in mods:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([_PLATFORM_MODULE, *mods])


HARNESS_DEVICE_ENV = "VERL_TOKENSEL_HARNESS_DEVICE"


def harness_device() -> str:
    """``cpu`` (default: verl's CPU platform, gloo) or ``cuda`` (verl's own platform), from the environment."""
    return os.environ.get(HARNESS_DEVICE_ENV, "cpu").strip().lower() or "cpu"


if harness_device() == "cpu":
    _prime_cpu_env()

import torch  # noqa: E402
import verl  # noqa: E402,F401  (imports the CPU platform module first, see _prime_cpu_env)

from verl_tokensel_cpu import tiny_model  # noqa: E402

from verl_tokensel_cpu import platform as cpu_platform  # noqa: E402

# ----------------------------------------------------------------------------------------------------
# process setup
# ----------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_cpu_process(
    rank: int = 0,
    world_size: int = 1,
    master_port: Optional[int] = None,
    master_addr: str = "127.0.0.1",
    num_threads: Optional[int] = None,
) -> dict[str, str]:
    """Make this process a verl worker rank on the CPU platform. Returns the env vars it set.

    Call before importing verl's workers (``make_training_worker`` does). If a default process group
    already exists in this process (an earlier worker), the rank/world env are left as they are, because
    verl reuses that group.
    """
    env = cpu_platform.enable_cpu_mode() if harness_device() == "cpu" else {}
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return env
    if (
        master_port is None
        and os.environ.get("MASTER_PORT")
        and os.environ.get("RANK") == str(rank)
        and os.environ.get("WORLD_SIZE") == str(world_size)
    ):
        master_port = int(os.environ["MASTER_PORT"])  # a launcher (run_distributed) already chose it
    values = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port if master_port is not None else free_port()),
    }
    os.environ.update(values)
    env.update(values)
    if world_size == 1 and harness_device() == "cpu":
        # One rank needs no rendezvous: a FileStore instead of a TCP store on MASTER_PORT, so a port
        # taken between free_port() and the bind (Ray processes open ports all the time) cannot fail
        # the run. verl then reuses this default group instead of creating its own.
        store = tempfile.NamedTemporaryFile(prefix="tokensel_pg_", delete=False)
        store.close()
        os.unlink(store.name)
        torch.distributed.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    return env


# ----------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------

_COMPOSE_CACHE: dict[tuple, Any] = {}


ENGINES = ("fsdp", "megatron")
#: verl's config, and the engine choice: ``ppo_trainer`` with ``model_engine=megatron`` is what verl 0.9.1's
#: deprecated ``ppo_megatron_trainer`` is
_ENGINE_OVERRIDES = {"fsdp": [], "megatron": ["model_engine=megatron"]}


def compose_ppo_config(overrides: Sequence[str] = (), engine: str = "fsdp") -> Any:
    """verl's ``ppo_trainer`` config (``engine="megatron"``: with ``model_engine=megatron``) composed with Hydra,
    plus ``overrides`` (OmegaConf). Cached."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    key = (engine, tuple(overrides))
    if key not in _COMPOSE_CACHE:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            _COMPOSE_CACHE[key] = compose(config_name="ppo_trainer",
                                          overrides=[*_ENGINE_OVERRIDES[engine], *overrides])
    return copy.deepcopy(_COMPOSE_CACHE[key])


def cpu_actor_overrides(
    model_dir: str,
    *,
    use_dynamic_bsz: bool = False,
    use_remove_padding: bool = True,
    ppo_mini_batch_size: int = 4,
    ppo_micro_batch_size_per_gpu: int = 2,
    ppo_max_token_len_per_gpu: int = 64,
    rollout_n: int = 1,
    lr: float = 1e-3,
    clip_grad: float = 1.0,
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    ppo_epochs: int = 1,
    temperature: float = 1.0,
    dtype: str = "fp32",
    attn_implementation: str = "eager",
    gradient_checkpointing: bool = False,
    engine: str = "fsdp",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> list[str]:
    """Hydra overrides of ``ppo_trainer`` (``engine="megatron"``: with ``model_engine=megatron``) that make the actor
    run on CPU with the tiny model.

    ``dtype`` is FSDP's compute (``mixed_precision.param_dtype``): ``fp32`` for CPU, ``bf16`` as verl
    runs on GPU; master weights, gradient reduction and buffers stay fp32 either way (verl's defaults).
    Megatron: ``dtype`` is the engine's (see :func:`verl_tokensel_cpu.megatron.megatron_cpu_overrides`),
    ``tensor_parallel`` / ``pipeline_parallel`` its TP / PP sizes (the rest of the world is DP).
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype={dtype!r}: the harness supports fp32 and bf16")
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: the harness supports {', '.join(ENGINES)}")
    a = "actor_rollout_ref.actor"
    m = "actor_rollout_ref.model"
    common = [
        f"{m}.path={model_dir}",
        f"{m}.use_remove_padding={use_remove_padding}",
        f"{m}.enable_gradient_checkpointing={gradient_checkpointing}",
        f"+{m}.override_config.attn_implementation={attn_implementation}",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={use_dynamic_bsz}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={ppo_micro_batch_size_per_gpu}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={ppo_max_token_len_per_gpu}",
        f"{a}.use_dynamic_bsz={use_dynamic_bsz}",
        f"{a}.ppo_mini_batch_size={ppo_mini_batch_size}",
        f"{a}.ppo_micro_batch_size_per_gpu={ppo_micro_batch_size_per_gpu}",
        f"{a}.ppo_max_token_len_per_gpu={ppo_max_token_len_per_gpu}",
        f"{a}.ppo_epochs={ppo_epochs}",
        f"{a}.loss_agg_mode={loss_agg_mode}",
        f"{a}.entropy_coeff={entropy_coeff}",
        f"{a}.use_torch_compile=False",
        f"{a}.optim.lr={lr}",
        f"{a}.optim.clip_grad={clip_grad}",
        f"{a}.optim.total_training_steps=100",
    ]
    if engine == "megatron":
        from verl_tokensel_cpu.megatron import megatron_cpu_overrides, megatron_gpu_overrides

        if harness_device() == "cpu":
            return [*common, *megatron_cpu_overrides(tensor_parallel, pipeline_parallel, dtype=dtype)]
        return [*common, *megatron_gpu_overrides(tensor_parallel, pipeline_parallel)]
    return [
        *common,
        f"{a}.strategy=fsdp2",
        f"{a}.fsdp_config.model_dtype=fp32",
        f"{a}.fsdp_config.use_torch_compile=False",
        f"+{a}.fsdp_config.mixed_precision.param_dtype={dtype}",
        f"+{a}.fsdp_config.mixed_precision.reduce_dtype=fp32",
        f"+{a}.fsdp_config.mixed_precision.buffer_dtype=fp32",
    ]


def make_actor_config(model_dir: str, overrides: Sequence[str] = (), engine: str = "fsdp", **kwargs):
    """(FSDPActorConfig or McoreActorConfig, HFModelConfig, composed OmegaConf) for the tiny model on CPU.

    ``kwargs`` go to :func:`cpu_actor_overrides`; ``overrides`` (Hydra syntax) are applied after them, e.g.
    ``["actor_rollout_ref.actor.policy_loss.loss_mode=my_loss"]`` or a plugin ``_target_``.
    """
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_ppo_config([*cpu_actor_overrides(model_dir, engine=engine, **kwargs), *overrides], engine=engine)
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config  # as ActorRolloutRefWorker.init_model does
    if engine == "megatron" and harness_device() == "cpu":
        from verl_tokensel_cpu.megatron import apply_engine_dtype

        apply_engine_dtype(actor_config, kwargs.get("dtype", "fp32"))
    return actor_config, model_config, cfg


# ----------------------------------------------------------------------------------------------------
# the worker
# ----------------------------------------------------------------------------------------------------


@dataclass
class CpuActor:
    """A real ``TrainingWorker`` plus the configs it was built from."""

    worker: Any  # verl.workers.engine_workers.TrainingWorker
    actor_config: Any  # FSDPActorConfig
    model_config: Any  # HFModelConfig
    cfg: Any  # composed OmegaConf ppo_trainer config
    use_dynamic_bsz: bool
    use_remove_padding: bool
    init_seconds: float = 0.0
    engine_name: str = "fsdp"  # "fsdp" (FSDP2) or "megatron"

    @property
    def engine(self):
        return self.worker.engine

    @property
    def tokenizer(self):
        return self.model_config.tokenizer

    @property
    def module(self):
        """The engine's model: an FSDP2 module, or Megatron's list of (DDP-wrapped) model chunks."""
        return self.worker.engine.module

    def set_loss_fn(self, loss_fn: Callable) -> None:
        self.worker.set_loss_fn(loss_fn)


def selecting_actor_config(actor: "CpuActor", preset: str, calculate_entropy: Optional[bool] = None, **knobs):
    """The actor's own config as our ``TokenselFSDPActorConfig`` with ``token_selector=preset``.

    ``knobs`` go to ``token_selection.*``. ``calculate_entropy`` defaults to ``True`` when the preset's score,
    shaping or rule (``Needs(entropy=True)``) needs entropy (what the tokensel trainers turn on for
    ``score_source=current``; with ``prepass`` or ``rollout`` they leave the update pass without it, and here it only
    feeds the entropy metrics). ``score_source=prepass`` works on any worker from :func:`make_training_worker`, which
    installs the
    pre-pass (:func:`verl_tokensel.verl_glue.prepass.install_prepass`).
    """
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass
    from verl_tokensel.core.resolve.presets import selection_for

    if calculate_entropy is None:
        sel = selection_for(preset)
        calculate_entropy = sel is not None and (sel.score_needs_entropy or sel.shaping_needs_entropy
                                                 or sel.impl.needs.entropy)
    node = actor.cfg.actor_rollout_ref.actor.copy()
    OmegaConf.set_struct(node, False)
    node._target_ = ("verl_tokensel.verl_glue.actor_config.TokenselMcoreActorConfig" if actor.engine_name == "megatron"
                     else "verl_tokensel.verl_glue.actor_config.TokenselFSDPActorConfig")
    node.token_selector = preset
    node.calculate_entropy = calculate_entropy
    node.token_selection = {"_target_": "verl_tokensel.core.config.TokenSelectionConfig", **knobs}
    out = omega_conf_to_dataclass(node)
    if actor.engine_name == "megatron":
        from verl_tokensel_cpu.megatron import apply_engine_dtype

        apply_engine_dtype(out, actor.actor_config.engine.dtype)
    return out


def default_loss_fn(actor_config) -> Callable:
    """verl's default actor loss as ``ActorRolloutRefWorker.init_model`` binds it."""
    from verl.workers.utils.losses import ppo_loss

    return functools.partial(ppo_loss, config=actor_config)


def make_training_worker(
    model_dir: Optional[str] = None,
    *,
    use_dynamic_bsz: bool = False,
    use_remove_padding: bool = True,
    loss_fn: Optional[Callable] = None,
    overrides: Sequence[str] = (),
    rank: int = 0,
    world_size: int = 1,
    master_port: Optional[int] = None,
    seed: int = 0,
    num_threads: Optional[int] = 1,
    engine: str = "fsdp",
    **config_kwargs,
) -> CpuActor:
    """Build verl's real ``TrainingWorker`` (FSDP2, CPU) for ``model_dir`` (default: the tiny model).

    ``engine="megatron"``: verl's Megatron engine instead (megatron-core + mbridge, the CPU shims of
    :mod:`verl_tokensel_cpu.megatron`), with ``tensor_parallel`` / ``pipeline_parallel`` in ``config_kwargs``
    (their product must divide ``world_size``; the rest is data parallelism).

    ``config_kwargs`` go to :func:`cpu_actor_overrides` (``ppo_mini_batch_size``,
    ``ppo_micro_batch_size_per_gpu``, ``ppo_max_token_len_per_gpu``, ``lr``, ``clip_grad``,
    ``loss_agg_mode``, ``entropy_coeff``, ``rollout_n``, ``ppo_epochs``, ``temperature``, ``dtype``,
    ``attn_implementation``, ``gradient_checkpointing``). The worker's
    loss is ``loss_fn`` if given, else ``partial(ppo_loss, config=actor_config)``. ``lr=0`` keeps the
    weights fixed (AdamW with lr 0 changes nothing), handy to compare gradients of several losses.
    ``num_threads`` sets ``torch.set_num_threads`` for the process (1 is fastest for the tiny model and
    robust when other jobs share the cores; None leaves it alone).
    """
    setup_cpu_process(rank=rank, world_size=world_size, master_port=master_port, num_threads=num_threads)
    if engine == "megatron" and harness_device() == "cpu":
        from verl_tokensel_cpu.megatron import install_megatron_cpu_shims

        install_megatron_cpu_shims()
    if model_dir is None:
        model_dir = tiny_model.build_tiny_model_dir()

    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    t0 = time.time()
    actor_config, model_config, cfg = make_actor_config(
        model_dir, use_dynamic_bsz=use_dynamic_bsz, use_remove_padding=use_remove_padding, overrides=overrides,
        engine=engine, **config_kwargs,
    )
    training_config = TrainingWorkerConfig(
        model_type=model_config.get("model_type", "language_model"),
        model_config=model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
        profiler_config=None,
    )
    # what ActorRolloutRefWorker.init_model copies into the engine config
    engine_config = training_config.engine_config
    engine_config.use_dynamic_bsz = cfg.actor_rollout_ref.actor.use_dynamic_bsz
    engine_config.infer_max_token_len_per_gpu = cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    engine_config.max_token_len_per_gpu = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    engine_config.micro_batch_size_per_gpu = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)

    torch.manual_seed(seed)
    worker = TrainingWorker(config=training_config)
    worker.reset()  # builds model + optimizer (engine.initialize)
    worker.set_loss_fn(loss_fn if loss_fn is not None else default_loss_fn(actor_config))
    # score_source=prepass: the per-mini-batch selection the tokensel actor workers install (a no-op for
    # any other loss; see verl_tokensel.verl_glue.prepass)
    from verl_tokensel.verl_glue.prepass import install_prepass

    install_prepass(worker)
    return CpuActor(
        worker=worker,
        actor_config=actor_config,
        model_config=model_config,
        cfg=cfg,
        use_dynamic_bsz=use_dynamic_bsz,
        use_remove_padding=use_remove_padding,
        init_seconds=time.time() - t0,
        engine_name=engine,
    )



def _from_output_rank(out):
    """Megatron: ``infer_batch`` returns the outputs on the model-parallel source rank only (TP rank 0 of the
    last pipeline stage); verl's driver collects them there and sends them with the next call to every rank.
    Here every rank of the model-parallel group gets them from that rank."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return out
    mine = None if out is None else {k: out[k] for k in ("log_probs", "entropy")}
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, mine, group=group)
    return next(o for o in gathered if o is not None)


def compute_old_log_probs(actor: CpuActor, batch, write: bool = True):
    """Run the real old-log-prob pass (``TrainingWorker.infer_batch``, as ``compute_log_prob`` does) and,
    like the v1 driver, store ``old_log_probs`` and ``entropy`` (response part, nested) into ``batch``.

    Returns (old_log_probs, entropy) as nested tensors. Works for both batch formats (in v0 the fields are
    stored padded, as the legacy driver keeps them).
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    probe = batch.copy()
    for k in ("mini_batch_size", "epochs", "seed", "dataloader_kwargs", "global_token_num"):
        if k in probe.keys():
            probe.pop(k)
    tu.assign_non_tensor(
        probe,
        calculate_entropy=True,
        compute_loss=False,
        temperature=tu.get_non_tensor_data(batch, "temperature", 1.0),
        global_token_num=probe["input_ids"].offsets().diff().tolist(),
    )
    out = actor.worker.infer_batch(probe)
    if actor.engine_name == "megatron":
        out = _from_output_rank(out)
    log_probs, entropy = out["log_probs"], out["entropy"]
    if batch["responses"].is_nested:
        olp = response_from_nested(log_probs, batch["response_mask"])
        ent = response_from_nested(entropy, batch["response_mask"])
        if write:
            batch["old_log_probs"] = olp
            batch["entropy"] = ent
        return olp, ent
    olp = no_padding_2_padding(log_probs, batch)
    ent = no_padding_2_padding(entropy, batch)
    if write:
        batch["old_log_probs"] = olp * batch["response_mask"]
    return olp, ent


# ----------------------------------------------------------------------------------------------------
# one training step
# ----------------------------------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True).float()


def _named_parameters(actor: CpuActor):
    """``(name, parameter)`` of the engine's model; Megatron: every chunk's, names prefixed by its index."""
    module = actor.module
    if isinstance(module, (list, tuple)):
        return [(f"{i}.{n}", p) for i, chunk in enumerate(module) for n, p in chunk.named_parameters()]
    return list(module.named_parameters())


def full_params(actor: CpuActor) -> dict[str, torch.Tensor]:
    """fp32 copies of all trainable parameters: full (unsharded) ones by HF name for FSDP (collective under
    DP>1); for Megatron, this rank's tensor-/pipeline-parallel shards by Megatron name (chunk index first)."""
    return {n: _full(p) for n, p in _named_parameters(actor) if p.requires_grad}


@dataclass
class StepResult:
    """What :func:`run_train_step` observed."""

    metrics: dict  # the worker's output["metrics"] (lists per mini-batch / micro-batch)
    loss: float  # metrics["loss"] summed over mini-batches
    grad_norm: Optional[float]
    seconds: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # per optimizer step, last one kept
    grads_per_step: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params_before: dict[str, torch.Tensor] = field(default_factory=dict)
    params_after: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def param_delta(self) -> dict[str, torch.Tensor]:
        return {k: self.params_after[k] - self.params_before[k] for k in self.params_before}

    @property
    def max_abs_param_delta(self) -> float:
        return max((d.abs().max().item() for d in self.param_delta.values()), default=0.0)


def _as_float(v) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        vals = [_as_float(x) for x in v]
        vals = [x for x in vals if x is not None]
        return float(sum(vals)) if vals else None
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().sum().item())
    if hasattr(v, "value"):  # verl Metric
        return _as_float(v.value)
    return float(v)


def run_train_step(
    actor: CpuActor,
    batch,
    loss_fn: Optional[Callable] = None,
    capture_grads: bool = False,
    capture_params: bool = True,
) -> StepResult:
    """One ``update_actor`` call: ``TrainingWorker.train_mini_batch(batch)`` (the RPC the drivers make).

    ``loss_fn`` (if given) is installed with ``set_loss_fn`` first (it stays installed). With
    ``capture_grads`` an optimizer step pre-hook copies every parameter's full gradient right before
    ``optimizer.step()``; that is AFTER verl's gradient clipping (``optim.clip_grad``), so build the worker
    with a large ``clip_grad`` to read raw gradients. Megatron: each parameter's ``main_grad`` (this rank's
    shard, DP-reduced) when ``step()`` starts, before Megatron's own clipping inside ``step``.
    ``params_before``/``params_after`` are full copies.
    The batch is consumed (verl pops keys from it): build a new one or pass ``batch.copy()``.
    """
    if loss_fn is not None:
        actor.set_loss_fn(loss_fn)
    result = StepResult(metrics={}, loss=float("nan"), grad_norm=None, seconds=0.0)
    if capture_params:
        result.params_before = full_params(actor)
    restore = None
    if capture_grads and actor.engine_name == "megatron":
        # Megatron's optimizer (Chained/Distributed) has no step hooks; its model parameters carry the
        # DP-reduced gradient in ``main_grad`` when ``step()`` starts (clipping happens inside ``step``)
        optimizer = actor.engine.optimizer
        named = _named_parameters(actor)
        base_step = optimizer.step

        def step(*args, **kwargs):
            result.grads_per_step.append({n: _full(p.main_grad) for n, p in named
                                          if getattr(p, "main_grad", None) is not None})
            return base_step(*args, **kwargs)

        optimizer.step = step

        def restore():
            del optimizer.step
    elif capture_grads:
        names = {id(p): n for n, p in _named_parameters(actor)}
        optimizer = actor.engine.optimizer

        def _pre_hook(opt, args, kwargs):
            grads = {}
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads[names[id(p)]] = _full(p.grad)
            result.grads_per_step.append(grads)

        restore = optimizer.register_step_pre_hook(_pre_hook).remove
    t0 = time.time()
    try:
        out = actor.worker.train_mini_batch(batch)
    finally:
        if restore is not None:
            restore()
    result.seconds = time.time() - t0
    if out is not None:
        from verl.utils import tensordict_utils as tu

        result.metrics = dict(tu.get(out, "metrics"))
    result.loss = _as_float(result.metrics.get("loss"))
    gn = result.metrics.get("grad_norm")
    result.grad_norm = _as_float(gn[-1] if isinstance(gn, list) and gn else gn)
    if result.grads_per_step:
        result.grads = result.grads_per_step[-1]
    if capture_params:
        result.params_after = full_params(actor)
    return result


__all__ = [
    "CpuActor",
    "StepResult",
    "compose_ppo_config",
    "compute_old_log_probs",
    "cpu_actor_overrides",
    "default_loss_fn",
    "free_port",
    "full_params",
    "make_actor_config",
    "make_training_worker",
    "run_train_step",
    "selecting_actor_config",
    "setup_cpu_process",
]
