"""Run verl 0.9's REAL actor training path on CPU, in-process (helper module, not a test file).

What it drives: ``verl.workers.engine_workers.TrainingWorker`` (the actor that
``ActorRolloutRefWorker.init_model`` builds) with the FSDP2 engine, fed with the ``TensorDict`` that verl's
drivers send to ``update_actor`` (``TrainingWorker.train_mini_batch``), with a loss function set through
``set_loss_fn`` exactly as ``init_model`` does (``partial(ppo_loss, config=actor_config)`` by default).

Typical use (one process, world size 1)::

    from verl_tokensel.testing.cpu_worker import make_training_worker, make_update_batch, run_train_step
    actor = make_training_worker(model_dir, use_dynamic_bsz=True, use_remove_padding=False)
    batch = make_update_batch(actor, n=8, seed=0)                # what the driver sends
    result = run_train_step(actor, batch, loss_fn=my_loss, capture_grads=True)
    result.loss, result.metrics, result.grads["lm_head.weight"], result.param_delta

GPU: with ``VERL_TOKENSEL_HARNESS_DEVICE=cuda`` in the environment BEFORE this module is imported, none
of the CPU set-up below happens and verl resolves its own CUDA platform (nccl); pass
``dtype="bf16"``, ``attn_implementation="sdpa"``/``"flash_attention_2"`` and
``gradient_checkpointing=True`` to :func:`make_training_worker` for verl's usual GPU settings
(``benchmarks/gpu_check.py`` does).

Side effects: importing this module sets ``VERL_PLATFORM=cpu``, ``VERL_ENGINE_DEVICE=cuda`` and prepends
``verl_tokensel.verl_glue.platform_cpu`` to ``VERL_USE_EXTERNAL_MODULES`` in ``os.environ``, then imports
verl (so test modules must skip on a missing verl BEFORE importing this one, e.g. with
``importlib.util.find_spec``); building a worker sets ``torch.set_num_threads(1)`` (``num_threads``) and
creates the process-wide default gloo group, which later workers in the process reuse.

Steps this takes care of (see :func:`setup_cpu_process`):

* ``enable_cpu_mode()`` from :mod:`verl_tokensel.verl_glue.platform_cpu` (``VERL_PLATFORM=cpu``,
  ``VERL_ENGINE_DEVICE=cuda``, the ``cpu:gloo,cpu:gloo`` backend fix) BEFORE verl's workers are imported.
* The env vars ``verl.single_controller.base.Worker.__init__`` reads: ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (a free port); ``TrainingWorker``
  then calls ``initialize_global_process_group_ray`` itself (``init_method`` from ``DIST_INIT_METHOD``,
  default ``env://``), once per process: later workers in the same process reuse the group.
* Config from verl's own Hydra tree (``verl/trainer/config/ppo_trainer.yaml``), converted with verl's
  ``omega_conf_to_dataclass`` into ``FSDPActorConfig`` / ``HFModelConfig``, with CPU settings:
  ``strategy=fsdp2``, fp32 (``model_dtype`` and ``mixed_precision``), eager attention
  (``model.override_config.attn_implementation``; verl's default is flash_attention_2),
  ``use_torch_compile=False``, no gradient checkpointing. The engine fields that ``init_model`` copies from
  the actor config (``use_dynamic_bsz``, ``max_token_len_per_gpu``, ``micro_batch_size_per_gpu``,
  ``use_remove_padding``) are copied the same way.

Batch formats (:func:`make_ppo_batch`): ``fmt="v1"`` is what the default TransferQueue driver
(``trainer.use_v1=true``) hands the worker: every per-sample field is a jagged nested tensor (prompts,
responses, response_mask, loss_mask, input_ids, position_ids, old_log_probs, advantages, ...).
``fmt="v0"`` is the legacy ``RayPPOTrainer._update_actor`` path: padded ``DataProto`` fields passed through
``verl.workers.utils.padding.left_right_2_no_padding`` (input_ids/position_ids nested, the rest padded,
``attention_mask`` kept). :func:`add_driver_meta` then adds the non-tensor keys the drivers add.
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

_PLATFORM_MODULE = "verl_tokensel.verl_glue.platform_cpu"


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

from verl_tokensel.testing import tiny_assets  # noqa: E402

from verl_tokensel.verl_glue import platform_cpu  # noqa: E402

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
    env = platform_cpu.enable_cpu_mode() if harness_device() == "cpu" else {}
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


def compose_ppo_config(overrides: Sequence[str] = ()) -> Any:
    """verl's ``ppo_trainer`` config (OmegaConf) composed with Hydra, plus ``overrides``. Cached."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    key = tuple(overrides)
    if key not in _COMPOSE_CACHE:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            _COMPOSE_CACHE[key] = compose(config_name="ppo_trainer", overrides=list(overrides))
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
) -> list[str]:
    """Hydra overrides of ``ppo_trainer`` that make the actor run on CPU with the tiny model.

    ``dtype`` is FSDP's compute (``mixed_precision.param_dtype``): ``fp32`` for CPU, ``bf16`` as verl
    runs on GPU; master weights, gradient reduction and buffers stay fp32 either way (verl's defaults).
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype={dtype!r}: the harness supports fp32 and bf16")
    a = "actor_rollout_ref.actor"
    m = "actor_rollout_ref.model"
    return [
        f"{m}.path={model_dir}",
        f"{m}.use_remove_padding={use_remove_padding}",
        f"{m}.enable_gradient_checkpointing={gradient_checkpointing}",
        f"+{m}.override_config.attn_implementation={attn_implementation}",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={use_dynamic_bsz}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={ppo_micro_batch_size_per_gpu}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={ppo_max_token_len_per_gpu}",
        f"{a}.strategy=fsdp2",
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
        f"{a}.fsdp_config.model_dtype=fp32",
        f"{a}.fsdp_config.use_torch_compile=False",
        f"+{a}.fsdp_config.mixed_precision.param_dtype={dtype}",
        f"+{a}.fsdp_config.mixed_precision.reduce_dtype=fp32",
        f"+{a}.fsdp_config.mixed_precision.buffer_dtype=fp32",
    ]


def make_actor_config(model_dir: str, overrides: Sequence[str] = (), **kwargs):
    """(FSDPActorConfig, HFModelConfig, composed OmegaConf) for the tiny model on CPU.

    ``kwargs`` go to :func:`cpu_actor_overrides`; ``overrides`` (Hydra syntax) are applied after them, e.g.
    ``["actor_rollout_ref.actor.policy_loss.loss_mode=my_loss"]`` or a plugin ``_target_``.
    """
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_ppo_config([*cpu_actor_overrides(model_dir, **kwargs), *overrides])
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config  # as ActorRolloutRefWorker.init_model does
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

    @property
    def engine(self):
        return self.worker.engine

    @property
    def tokenizer(self):
        return self.model_config.tokenizer

    @property
    def module(self):
        return self.worker.engine.module

    def set_loss_fn(self, loss_fn: Callable) -> None:
        self.worker.set_loss_fn(loss_fn)


def selecting_actor_config(actor: "CpuActor", preset: str, calculate_entropy: Optional[bool] = None, **knobs):
    """The actor's own config as our ``TokenselFSDPActorConfig`` with ``token_selector=preset``.

    ``knobs`` go to ``token_selection.*``. ``calculate_entropy`` defaults to ``True`` when the preset's
    score needs entropy (what the tokensel trainers turn on for ``score_source=current``; with ``prepass``
    or ``rollout`` they leave the update pass without it, and here it only feeds the entropy metrics).
    ``score_source=prepass`` works on any worker from :func:`make_training_worker`, which installs the
    pre-pass (:func:`verl_tokensel.verl_glue.prepass.install_prepass`).
    """
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass
    from verl_tokensel.core.config import PRESETS
    from verl_tokensel.core.scores import SCORE_REGISTRY

    if calculate_entropy is None:
        sel = PRESETS[preset]
        calculate_entropy = sel is not None and SCORE_REGISTRY[sel.score].needs_entropy
    node = actor.cfg.actor_rollout_ref.actor.copy()
    OmegaConf.set_struct(node, False)
    node._target_ = "verl_tokensel.verl_glue.actor_config.TokenselFSDPActorConfig"
    node.token_selector = preset
    node.calculate_entropy = calculate_entropy
    node.token_selection = {"_target_": "verl_tokensel.core.config.TokenSelectionConfig", **knobs}
    return omega_conf_to_dataclass(node)


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
    **config_kwargs,
) -> CpuActor:
    """Build verl's real ``TrainingWorker`` (FSDP2, CPU) for ``model_dir`` (default: the tiny model).

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
    if model_dir is None:
        model_dir = tiny_assets.build_tiny_model_dir()

    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    t0 = time.time()
    actor_config, model_config, cfg = make_actor_config(
        model_dir, use_dynamic_bsz=use_dynamic_bsz, use_remove_padding=use_remove_padding, overrides=overrides,
        **config_kwargs,
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
    )


# ----------------------------------------------------------------------------------------------------
# batches
# ----------------------------------------------------------------------------------------------------


def _vocab_range(tokenizer_or_vocab) -> tuple[int, int]:
    """Token ids to sample from: skip the special tokens at the start of the tiny vocab."""
    if isinstance(tokenizer_or_vocab, int):
        return 0, tokenizer_or_vocab
    n = len(tokenizer_or_vocab)
    low = max(int(i) for i in tokenizer_or_vocab.all_special_ids) + 1 if tokenizer_or_vocab.all_special_ids else 0
    return (low if low < n else 0), n


def _lengths(spec, n: int, gen: torch.Generator) -> list[int]:
    if isinstance(spec, int):
        return [spec] * n
    lo, hi = spec
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


def make_ppo_batch(
    tokenizer_or_vocab: Any,
    n: int = 8,
    prompt_len: int | tuple[int, int] = (3, 8),
    resp_len: int | tuple[int, int] = (2, 10),
    seed: int = 0,
    fmt: str = "v1",
    old_log_probs: Optional[Sequence[torch.Tensor]] = None,
    response_mask_holes: bool = False,
    extra_token_fields: Optional[dict[str, Sequence[torch.Tensor]]] = None,
    group_size: int = 1,
):
    """A synthetic PPO update batch (tensor fields only; add driver meta with :func:`add_driver_meta`).

    ``tokenizer_or_vocab``: a tokenizer (ids sampled outside its special tokens) or a vocab size.
    ``prompt_len``/``resp_len``: an int or an inclusive (lo, hi) range per sample (ranges make the
    nested tensors genuinely jagged, like real rollouts). ``fmt``: "v1" (TransferQueue driver, all nested)
    or "v0" (legacy driver: padded + ``left_right_2_no_padding``). ``old_log_probs``: per-sample response
    log-probs (default: random in [-3, -0.1]; use :func:`compute_old_log_probs` for the real pass).
    ``response_mask_holes``: zero a few response tokens (multi-turn tool tokens). ``extra_token_fields``:
    more per-response-token fields (one 1-D tensor per sample), e.g. a ``token_select_mask``; they are
    nested in v1 and right-padded with 0 in v0, as each driver would store them. ``group_size``: samples
    per prompt (GRPO groups share ``uid`` and prompt).

    Fields: prompts, responses, response_mask, loss_mask (=response_mask), input_ids, position_ids,
    old_log_probs, advantages, returns, token_level_rewards, token_level_scores, uid (non-tensor); v0 also
    attention_mask and the non-tensor max_seq_len, max_response_len, indices.
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    assert fmt in ("v1", "v0"), fmt
    assert n % group_size == 0, (n, group_size)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = _vocab_range(tokenizer_or_vocab)
    n_groups = n // group_size
    p_lens = [pl for pl in _lengths(prompt_len, n_groups, gen) for _ in range(group_size)]
    r_lens = _lengths(resp_len, n, gen)
    group_prompts = [torch.randint(lo, hi, (p_lens[g * group_size],), generator=gen) for g in range(n_groups)]
    prompts = [group_prompts[i // group_size].clone() for i in range(n)]
    responses = [torch.randint(lo, hi, (r,), generator=gen) for r in r_lens]
    response_mask = [torch.ones(r, dtype=torch.int64) for r in r_lens]
    if response_mask_holes:
        for m in response_mask:
            if m.numel() >= 3:
                m[1 : 1 + max(1, m.numel() // 3)] = 0
    if old_log_probs is None:
        old_log_probs = [-(0.1 + 2.9 * torch.rand(r, generator=gen)) for r in r_lens]
    seq_scores = torch.randn(n, generator=gen)
    if group_size > 1:  # GRPO-style normalised outcome advantages
        g = seq_scores.view(n_groups, group_size)
        adv_seq = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
    else:
        adv_seq = seq_scores
    advantages = [torch.full((r,), float(adv_seq[i])) * response_mask[i] for i, r in enumerate(r_lens)]
    token_level_scores = [torch.zeros(r) for r in r_lens]
    for i, r in enumerate(r_lens):
        token_level_scores[i][-1] = seq_scores[i]
    uids = [f"uid-{seed}-{i // group_size}" for i in range(n)]
    extra_token_fields = dict(extra_token_fields or {})
    for k, vals in extra_token_fields.items():
        assert len(vals) == n and all(v.shape[0] == r for v, r in zip(vals, r_lens)), f"bad extra field {k}"

    if fmt == "v1":
        # AgentLoopWorkerTQ._agent_loop_postprocess stores 1-D per-sample tensors; TransferQueue returns
        # them to the worker as jagged nested tensors (list_of_dict_to_tensordict).
        def nt(xs):
            return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)

        input_ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        fields = {
            "prompts": nt(prompts),
            "responses": nt(responses),
            "response_mask": nt(response_mask),
            "loss_mask": nt(response_mask),
            "input_ids": nt(input_ids),
            "position_ids": nt(torch.arange(x.numel()) for x in input_ids),
            "old_log_probs": nt(x.float() for x in old_log_probs),
            "advantages": nt(advantages),
            "returns": nt(advantages),
            "token_level_scores": nt(token_level_scores),
            "token_level_rewards": nt(token_level_scores),
        }
        for k, vals in extra_token_fields.items():
            fields[k] = nt(vals)
        td = TensorDict(fields, batch_size=[n])
        td["uid"] = NonTensorStack(*[NonTensorData(u) for u in uids])
        return td

    # v0: DataProto with left-padded prompts and right-padded responses, then left_right_2_no_padding
    from verl.workers.utils.padding import left_right_2_no_padding

    P, R = max(p_lens), max(r_lens)
    pad_id = 0
    prompts_pad = torch.full((n, P), pad_id, dtype=torch.int64)
    prompt_attn = torch.zeros((n, P), dtype=torch.int64)
    resp_pad = torch.full((n, R), pad_id, dtype=torch.int64)
    resp_attn = torch.zeros((n, R), dtype=torch.int64)

    def rpad(xs, dtype=torch.float32):
        out = torch.zeros((n, R), dtype=dtype)
        for i, x in enumerate(xs):
            out[i, : x.numel()] = x.to(dtype)
        return out

    for i in range(n):
        prompts_pad[i, P - p_lens[i] :] = prompts[i]
        prompt_attn[i, P - p_lens[i] :] = 1
        resp_pad[i, : r_lens[i]] = responses[i]
        resp_attn[i, : r_lens[i]] = 1
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    fields = {
        "prompts": prompts_pad,
        "responses": resp_pad,
        "input_ids": torch.cat([prompts_pad, resp_pad], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": rpad(response_mask, torch.int64),
        "old_log_probs": rpad(old_log_probs),
        "advantages": rpad(advantages),
        "returns": rpad(advantages),
        "token_level_scores": rpad(token_level_scores),
        "token_level_rewards": rpad(token_level_scores),
    }
    for k, vals in extra_token_fields.items():
        fields[k] = rpad(vals, vals[0].dtype)
    td = TensorDict(fields, batch_size=[n])
    td["uid"] = NonTensorStack(*[NonTensorData(u) for u in uids])
    return left_right_2_no_padding(td)


def add_driver_meta(
    batch,
    *,
    ppo_mini_batch_size: int,
    rollout_n: int = 1,
    ppo_epochs: int = 1,
    data_loader_seed: int = 42,
    shuffle: bool = False,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    fmt: str = "v1",
    multi_turn: bool = False,
):
    """Add the non-tensor keys a driver's ``_update_actor`` adds before ``update_actor`` (in place).

    Both drivers: calculate_entropy, distillation_use_topk, distillation_only, global_batch_size and
    mini_batch_size (= ppo_mini_batch_size * rollout.n, i.e. GLOBAL over DP), epochs, seed,
    dataloader_kwargs, temperature. v0 additionally: compute_loss, multi_turn and global_token_num (from
    ``fit``). ``train_mini_batch`` pops mini_batch_size/epochs/seed/dataloader_kwargs and adds
    global_token_num/update_lr_scheduler per mini-batch; ``train_batch`` adds use_remove_padding,
    use_dynamic_bsz, max_token_len_per_gpu, micro_batch_size_per_gpu, use_fused_kernels; the engine adds
    sp_size, batch_num_tokens and dp_size.
    """
    from verl.utils import tensordict_utils as tu

    mini = ppo_mini_batch_size * rollout_n
    meta = dict(
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=ppo_epochs,
        seed=data_loader_seed,
        dataloader_kwargs={"shuffle": shuffle},
        temperature=temperature,
    )
    if fmt == "v0":
        meta.update(compute_loss=True, multi_turn=multi_turn)
        seq_lens = batch["input_ids"].offsets().diff().tolist()
        meta["global_token_num"] = seq_lens
    tu.assign_non_tensor(batch, **meta)
    return batch


def make_update_batch(
    actor: CpuActor,
    n: Optional[int] = None,
    seed: int = 0,
    fmt: str = "v1",
    calculate_entropy: Optional[bool] = None,
    **batch_kwargs,
):
    """:func:`make_config_batch` with the actor's own config and tokenizer. ``n`` defaults to one mini-batch."""
    return make_config_batch(actor.cfg, actor.tokenizer, n=n, seed=seed, fmt=fmt,
                             calculate_entropy=calculate_entropy, **batch_kwargs)


def make_config_batch(
    cfg,
    tokenizer,
    n: Optional[int] = None,
    seed: int = 0,
    fmt: str = "v1",
    calculate_entropy: Optional[bool] = None,
    **batch_kwargs,
):
    """:func:`make_ppo_batch` + :func:`add_driver_meta` with the meta a driver derives from ``cfg``
    (mini-batch size, rollout.n, epochs, seed, shuffle, temperature and ``calculate_entropy``, which
    defaults to ``actor.calculate_entropy or entropy_coeff != 0`` as in verl's drivers)."""
    a = cfg.actor_rollout_ref.actor
    rollout_n = int(cfg.actor_rollout_ref.rollout.n)
    if n is None:
        n = int(a.ppo_mini_batch_size) * rollout_n
    batch = make_ppo_batch(tokenizer, n=n, seed=seed, fmt=fmt, **batch_kwargs)
    if calculate_entropy is None:
        calculate_entropy = bool(a.calculate_entropy or a.entropy_coeff != 0)
    return add_driver_meta(
        batch,
        ppo_mini_batch_size=int(a.ppo_mini_batch_size),
        rollout_n=rollout_n,
        ppo_epochs=int(a.ppo_epochs),
        data_loader_seed=int(a.data_loader_seed),
        shuffle=bool(a.shuffle),
        temperature=float(cfg.actor_rollout_ref.rollout.temperature),
        calculate_entropy=calculate_entropy,
        fmt=fmt,
    )


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


def full_params(actor: CpuActor) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 copies of all trainable parameters, by HF name. Collective under DP>1."""
    return {n: _full(p) for n, p in actor.module.named_parameters() if p.requires_grad}


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
    with a large ``clip_grad`` to read raw gradients. ``params_before``/``params_after`` are full copies.
    The batch is consumed (verl pops keys from it): build a new one or pass ``batch.copy()``.
    """
    if loss_fn is not None:
        actor.set_loss_fn(loss_fn)
    result = StepResult(metrics={}, loss=float("nan"), grad_norm=None, seconds=0.0)
    if capture_params:
        result.params_before = full_params(actor)
    handle = None
    if capture_grads:
        names = {id(p): n for n, p in actor.module.named_parameters()}
        optimizer = actor.engine.optimizer

        def _pre_hook(opt, args, kwargs):
            grads = {}
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads[names[id(p)]] = _full(p.grad)
            result.grads_per_step.append(grads)

        handle = optimizer.register_step_pre_hook(_pre_hook)
    t0 = time.time()
    try:
        out = actor.worker.train_mini_batch(batch)
    finally:
        if handle is not None:
            handle.remove()
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


# ----------------------------------------------------------------------------------------------------
# multi-process (gloo) helpers
# ----------------------------------------------------------------------------------------------------


def split_for_dp(batch, world_size: int) -> list:
    """Split a driver batch across DP ranks like verl's dispatch (``BatchData(td).chunk``)."""
    from verl.protocol import BatchData

    # chunk_tensordict returns locked TensorDicts; the copies a Ray worker receives are not locked
    return [c.unlock_() if c.is_locked else c for c in BatchData(batch).chunk(chunks=world_size)]


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    setup_cpu_process(rank=rank, world_size=world_size, master_port=port, num_threads=1)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def dp_train_step(
    rank: int,
    world_size: int,
    model_dir: str,
    worker_kwargs: Optional[dict] = None,
    n: int = 8,
    seed: int = 0,
    fmt: str = "v1",
    real_old_log_probs: bool = True,
    batch_kwargs: Optional[dict] = None,
) -> dict:
    """One rank of a data-parallel update (use with :func:`run_distributed`).

    Every rank builds the same global driver batch (same seed), takes its DP shard like verl's dispatch,
    optionally runs the real old-log-prob pass on it, and runs one ``train_mini_batch`` capturing the
    full (all-reduced) gradients. Returns a picklable dict: loss, grad_norm, grads, max_abs_param_delta,
    n_local, metrics (plain values only).
    """
    actor = make_training_worker(model_dir, rank=rank, world_size=world_size, **(worker_kwargs or {}))
    full = make_update_batch(actor, n=n, seed=seed, fmt=fmt, **(batch_kwargs or {}))
    shard = split_for_dp(full, world_size)[rank]
    if real_old_log_probs:
        compute_old_log_probs(actor, shard)
    r = run_train_step(actor, shard, capture_grads=True)
    plain = {k: v for k, v in r.metrics.items() if isinstance(v, (int, float, str, list))}
    return {
        "loss": r.loss,
        "grad_norm": r.grad_norm,
        "grads": r.grads,
        "max_abs_param_delta": r.max_abs_param_delta,
        "n_local": int(shard.batch_size[0]),
        "metrics": plain,
    }


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes (gloo, CPU platform).

    ``fn`` must be importable (module level). Each rank's return value is saved with ``torch.save`` and
    returned in rank order. Raises if a rank fails or the run exceeds ``timeout`` seconds (the processes are
    then killed).
    """
    import tempfile

    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="verl_cpu_dist_") as out_dir:
        ctx = mp.start_processes(
            _spawn_entry,
            args=(world_size, port, fn, tuple(args), out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.time() + timeout
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.time()))):
            if time.time() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"run_distributed: {fn.__name__} did not finish within {timeout}s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


__all__ = [
    "CpuActor",
    "StepResult",
    "add_driver_meta",
    "compose_ppo_config",
    "compute_old_log_probs",
    "cpu_actor_overrides",
    "default_loss_fn",
    "dp_train_step",
    "free_port",
    "full_params",
    "make_actor_config",
    "make_ppo_batch",
    "make_training_worker",
    "make_update_batch",
    "run_distributed",
    "run_train_step",
    "setup_cpu_process",
    "split_for_dp",
]
