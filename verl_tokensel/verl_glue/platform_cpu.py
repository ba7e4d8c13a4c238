"""A CPU platform for verl 0.9 (``VERL_PLATFORM=cpu``): run verl's real worker/engine code without a GPU.

verl 0.9 resolves every device question (device name, ``torch.<device>`` module, collective backend,
Ray resource, IPC) through one platform object looked up in
:class:`verl.plugin.platform.platform_manager.PlatformRegistry`. This module registers a platform named
``cpu`` in that registry (importing the module is enough) and :func:`enable_cpu_mode` switches a process
to it. Nothing in verl is edited or monkeypatched.

Usage, before verl resolves its platform (i.e. before ``verl.utils.device.get_platform()`` is first called,
which happens when verl's worker/engine modules are imported)::

    from verl_tokensel.verl_glue.platform_cpu import enable_cpu_mode
    enable_cpu_mode()

What :func:`enable_cpu_mode` does (idempotent):

* ``VERL_PLATFORM=cpu``: verl's platform manager picks the platform registered here. The CPU platform is
  never auto-detected (:meth:`PlatformCPU.is_platform_available` is ``False``), so merely importing this
  module never changes what verl picks on a GPU host.
* ``VERL_ENGINE_DEVICE=cuda``: verl registers its FSDP/FSDP2 engines only for ``cuda``/``npu``
  (``EngineRegistry``); this env var is verl's own override for the engine lookup. The engine code itself
  asks the platform for the device, so it then runs on ``cpu``.
* Makes ``torch.distributed.init_process_group`` accept the backend string verl builds. verl 0.9
  (``verl/utils/distributed.py``) always initialises with ``f"cpu:gloo,{device}:{backend}"``; with device
  ``cpu`` that is ``"cpu:gloo,cpu:gloo"``, which torch rejects ("Duplicate device type cpu"). The
  platform method alone cannot avoid it: whatever :meth:`PlatformCPU.communication_backend_name` returns,
  the second pair still starts with ``cpu:``. There is no seam in verl between building that string and
  calling torch, so :func:`install_process_group_fix` wraps ``torch.distributed.init_process_group``
  (torch's, not verl's) with a function that only removes *identical* duplicate ``device:backend`` pairs
  (``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``) and passes everything else through unchanged; a genuine conflict
  (``"cpu:gloo,cpu:nccl"``) still reaches torch and fails there. The wrap is also installed when this
  module is imported in a process whose environment already says ``VERL_PLATFORM=cpu`` (Ray workers that
  import the plugin through ``VERL_USE_EXTERNAL_MODULES`` or the ``verl.plugins`` entry point). Where the
  caller controls the process, initialising the default group with plain ``"gloo"`` before verl does
  also works without any wrap: verl skips ``init_process_group`` when a group already exists.

Platform answers (see :class:`PlatformCPU`): device name ``"cpu"``, ``current_device()`` -> ``"cpu"`` (verl
uses it as a ``.to()`` target, so an int would mean ``cuda:0``), one device, collective backend ``gloo``,
``is_ipc_supported()`` ``False`` (vLLM weight sync then goes through shared memory), Ray resource ``"GPU"``
(verl's resource pools and rollout servers ask Ray for an accelerator, so start Ray with a *logical*
``num_gpus``, e.g. ``ray.init(num_gpus=2)`` / ``+ray_kwargs.ray_init.num_gpus=...``), and a device module
(:data:`cpu_device_module`) that mimics ``torch.cuda``: memory statistics are 0, ``mem_get_info`` reports
host RAM, ``synchronize``/``empty_cache``/``set_device`` are no-ops, and the RNG calls act on the CPU
generator (which *is* the device generator here).

Limits of the CPU platform (it is for functional tests and tiny models, not for training):

* fp32 only: set ``model_dtype=fp32`` and ``mixed_precision.param_dtype=fp32`` (verl's FSDP default is
  bf16 params; bf16 matmuls on CPU are slow and some kernels are missing; fp16 is not supported).
* No flash-attention, no fused/Liger/Triton kernels (``use_fused_kernels=False``, ``use_liger=False``):
  load models with ``attn_implementation="eager"`` (or ``sdpa``). ``use_remove_padding=True`` works with
  transformers >= 5 because its mask utilities rebuild per-sequence causal masks from packed
  ``position_ids``; the attention is then O(total_tokens^2) per micro-batch.
* No ``torch.compile`` (``actor.use_torch_compile=False``, ``engine.use_torch_compile=False``).
* No Ulysses sequence parallelism, no Megatron, no NCCL/IPC paths, no CUDA graphs, no sleep mode for the
  rollout (``rollout.enable_sleep_mode=False``, ``free_cache_engine=False``, ``enforce_eager=True``).
* Memory metrics (``perf/max_memory_*``) read 0; MFU uses verl's nominal CPU FLOPS.
* Speed: roughly 1e9-1e10 FLOP/s per core; keep models in the 1e5-1e7 parameter range and sequences short.
* ``device_count()`` is 1 regardless of how many processes share the host; several ranks on one host
  share the CPU cores (set ``OMP_NUM_THREADS`` / ``torch.set_num_threads`` to avoid oversubscription).
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = [
    "PLATFORM_NAME",
    "PlatformCPU",
    "CPUDeviceModule",
    "cpu_device_module",
    "enable_cpu_mode",
    "install_process_group_fix",
    "dedupe_backend_string",
    "is_cpu_mode",
]

PLATFORM_NAME = "cpu"

# Env vars that enable_cpu_mode() sets. VERL_PLATFORM selects the platform; VERL_ENGINE_DEVICE makes
# verl's EngineRegistry find the FSDP engines (registered for cuda/npu only).
CPU_MODE_ENV = {"VERL_PLATFORM": PLATFORM_NAME, "VERL_ENGINE_DEVICE": "cuda"}

_FIX_MARKER = "_verl_tokensel_cpu_backend_fix"


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
    CPU-meaningful answers and falls back to ``torch.cpu`` for anything else (streams, events, ...).
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

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
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

    # -- everything else (Stream, Event, stream(), current_stream(), ...) from torch.cpu -------------
    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(torch.cpu, name)
        except AttributeError:
            raise AttributeError(f"CPU device module (verl_tokensel) has no attribute {name!r}") from None


cpu_device_module = CPUDeviceModule()


class PlatformCPU(PlatformBase):
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
        # Never auto-detected: CPU mode is opt-in through VERL_PLATFORM=cpu only.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        # verl uses this as a `.to()` target (e.g. `tensor.to(get_device_id())`): an int would mean cuda:N.
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
        # verl's resource pools and rollout servers require an accelerator resource; start Ray with a
        # logical num_gpus so that "GPU" bundles exist on a CPU-only host.
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


def _register() -> None:
    existing = PlatformRegistry.get(PLATFORM_NAME)
    if existing is not None and existing is not PlatformCPU:
        same_class = (
            getattr(existing, "__module__", None) == PlatformCPU.__module__
            and getattr(existing, "__qualname__", None) == PlatformCPU.__qualname__
        )
        if not same_class:  # a reload of this very module may re-register itself; anyone else may not
            raise RuntimeError(
                f"verl_tokensel: verl's PlatformRegistry already has a platform named {PLATFORM_NAME!r} "
                f"({existing.__module__}.{existing.__qualname__}); refusing to overwrite it with "
                f"{PlatformCPU.__module__}.{PlatformCPU.__qualname__}. Use one CPU platform per process "
                "(unregister the other plugin or do not import this module)."
            )
    PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)


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
    (see :func:`dedupe_backend_string`); every other call is passed through unchanged.
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


def is_cpu_mode() -> bool:
    """True when this process is configured (by env) to run verl on the CPU platform."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def enable_cpu_mode() -> dict[str, str]:
    """Switch this process (and children that inherit its env) to verl's CPU platform. Idempotent.

    Sets ``VERL_PLATFORM=cpu`` and ``VERL_ENGINE_DEVICE=cuda`` and installs the ``init_process_group``
    backend fix. Must run before verl resolves its platform singleton; raises RuntimeError if verl already
    resolved a different platform in this process (modules such as verl's FSDP engine capture the device
    name at import time, so switching later would leave a half-GPU, half-CPU process).

    Returns the env vars it set, e.g. to forward them to Ray workers through
    ``runtime_env={"env_vars": ...}`` (Ray workers must also import this module, e.g. via
    ``VERL_USE_EXTERNAL_MODULES=verl_tokensel.verl_glue.platform_cpu``).
    """
    from verl.plugin.platform import platform_manager

    current = platform_manager._current_platform
    if current is not None and not isinstance(current, PlatformCPU):
        raise RuntimeError(
            "verl_tokensel.enable_cpu_mode(): verl already resolved its platform to "
            f"{type(current).__name__} (device {current.device_name!r}) in this process. Call "
            "enable_cpu_mode() (or export VERL_PLATFORM=cpu and import this module) before importing "
            "verl's workers/engines."
        )
    _register()
    for key, value in CPU_MODE_ENV.items():
        os.environ[key] = value
    install_process_group_fix()
    return dict(CPU_MODE_ENV)


_register()
if is_cpu_mode():
    # Ray workers / subprocesses that import the plugin with VERL_PLATFORM=cpu in their env.
    os.environ.setdefault("VERL_ENGINE_DEVICE", CPU_MODE_ENV["VERL_ENGINE_DEVICE"])
    install_process_group_fix()
