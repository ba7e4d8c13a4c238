"""One import hook for the CPU port: patch a module right after it executes, wherever it is first imported.

Used for vLLM-CPU's GEMM dispatch (:mod:`verl_tokensel.cpu.vllm_patch`) and for Megatron's modules
(:mod:`verl_tokensel.cpu.megatron`), which may be imported after the fix is installed (in Ray workers, in
vLLM's engine process, by verl's engine factory).
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module whose name ``matches``, it asks the other finders for the spec and makes
    the loader run ``patch(module)`` right after the module's code. ``name`` identifies the hook (idempotence)."""

    def __init__(self, name: str, matches: Callable[[str], bool], patch: Callable) -> None:
        self.name, self.matches, self.patch = name, matches, patch

    def find_spec(self, fullname, path=None, target=None):
        if not self.matches(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        patch = self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        # a fresh loader instance per spec (PathFinder's): shadow its exec_module, keep get_source etc.
        loader.exec_module = exec_and_patch
        return spec


def patch_after_import(name: str, matches: Callable[[str], bool], patch: Callable) -> None:
    """Put a :class:`PatchAfterImport` first on ``sys.meta_path`` unless one named ``name`` is there already."""
    if not any(isinstance(f, PatchAfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, PatchAfterImport(name, matches, patch))


__all__ = ["PatchAfterImport", "patch_after_import"]
