"""FSDP2 on CPU: the reference model's engine without pinned memory.

verl's FSDP2 engine builds every forward-only engine (the reference model, ``use_kl_loss=true``) with
``CPUOffloadPolicy(pin_memory=True)``; pinning host memory needs an accelerator, so on CPU the reference worker
fails at start-up ("Cannot access accelerator device when none is available"). In CPU mode, right after verl's
engine module executes, its ``CPUOffloadPolicy`` name is rebound to a subclass that never pins: the parameters
stay in host memory as they would anyway. Nothing else changes, and nothing happens outside CPU mode (installed
by :mod:`verl_tokensel_cpu.platform`).
"""

from __future__ import annotations

import logging
from typing import Any

from verl_tokensel.import_hook import after_import

logger = logging.getLogger(__name__)

#: verl's FSDP engine module, whose ``CPUOffloadPolicy`` global the forward-only engines call
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def unpinned_offload_policy(module: Any) -> bool:
    """Rebind ``module.CPUOffloadPolicy`` to a subclass whose ``pin_memory`` is always False. Idempotent."""
    base = getattr(module, "CPUOffloadPolicy", None)
    if base is None:
        return False
    if getattr(base, "_tokensel_unpinned", False):
        return True

    class CPUOffloadPolicy(base):  # torch's dataclass: its one field is pin_memory
        _tokensel_unpinned = True

        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    CPUOffloadPolicy.__doc__ = "verl_tokensel (CPU mode): torch's CPUOffloadPolicy without pinned memory."
    module.CPUOffloadPolicy = CPUOffloadPolicy
    logger.info("verl-tokensel: FSDP2 offload without pinned memory (CPU mode)")
    return True


def install() -> None:
    """Arm :func:`unpinned_offload_policy` for verl's engine module (now, or when it is imported)."""
    after_import(ENGINE_MODULE, unpinned_offload_policy)


__all__ = ["ENGINE_MODULE", "install", "unpinned_offload_policy"]
