"""verl plugin entry point (``verl.plugins`` group), imported by ``import verl`` in every process.

Two steps, each guarded on its own, so that one cannot switch the other off:

1. Only when the CPU platform is asked for (``VERL_PLATFORM=cpu``): load the CPU port
   (:mod:`verl_tokensel.cpu.platform`) first, because the trainer modes below make verl resolve its
   platform and ``cpu`` must be registered by then. A failure is recorded in :data:`CPU_LOAD_ERROR`.
   On any other host the CPU port is never imported.
2. Always: register the V1 trainer modes ``tokensel_<mode>`` (:mod:`verl_tokensel.verl_glue.install`), right
   after verl's trainer package (:data:`TRAINER_PACKAGE`) is imported, by whoever imports it first (verl's
   ``main_ppo`` does, in the process that builds the trainer), or at once if it is imported already. A
   failure is recorded in :data:`LOAD_ERROR`.

Step 2 is deferred so that ``import verl`` stays light in every process verl starts (the driver, the
TaskRunner, each worker): registering needs verl's trainer modules, which import vLLM and the checkpoint engines
and resolve the accelerator; a process that never builds a trainer never pays for them.
:func:`ensure_selection_loaded` forces the registration (``verl-tokensel env``, tests).

verl swallows exceptions raised by plugin imports, so each failure is also printed to stderr (it lands in
the driver's and each Ray worker's log) with its own message; ``verl-tokensel env`` and the config
validation report :data:`LOAD_ERROR` too.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import traceback
import warnings

LOAD_ERROR: str | None = None
CPU_LOAD_ERROR: str | None = None
#: verl's V1 trainer package: its import fills verl's trainer registry; ours are registered right after it
TRAINER_PACKAGE = "verl.trainer.ppo.v1"

SELECTION_FAILED = "verl_tokensel: the verl plugin failed to load, token selection is NOT active in this process.\n"
CPU_FAILED = (
    "verl_tokensel: the CPU port (verl_tokensel.cpu) failed to load under VERL_PLATFORM=cpu; verl's `cpu` "
    "platform is NOT registered in this process.\n"
)


#: the one CPU switch of ``python -m verl_tokensel.main_ppo`` (:mod:`verl_tokensel.cpu.pipeline`)
CPU_SWITCH_KEY = "trainer.device"


def wants_cpu(config) -> bool:
    """True when the config carries the switch ``trainer.device=cpu`` (read without importing the CPU port)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(config, CPU_SWITCH_KEY, default="")).strip().lower() == "cpu"


def cpu_platform_requested(environ=None) -> bool:
    """True when this process is asked to run verl on the CPU platform (``VERL_PLATFORM=cpu``)."""
    environ = os.environ if environ is None else environ
    return environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _diagnosis() -> str:
    """The known cause of a load failure, one line each (:mod:`verl_tokensel.stack`), or ""."""
    try:
        from verl_tokensel.stack import check_stack

        return "".join(p.line() + "\n" for p in check_stack())
    except Exception:  # noqa: BLE001 - the traceback is still printed
        return ""


def _report(prefix: str) -> str:
    error = traceback.format_exc()
    msg = prefix + _diagnosis() + error
    print(msg, file=sys.stderr, flush=True)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return error


def load_cpu_port() -> None:
    global CPU_LOAD_ERROR
    try:
        from verl_tokensel.cpu import platform as cpu_platform

        cpu_platform.ensure_registered()
        CPU_LOAD_ERROR = None
    except Exception:  # noqa: BLE001 - verl would swallow it; we make it loud instead
        CPU_LOAD_ERROR = _report(CPU_FAILED)


def load_selection() -> None:
    global LOAD_ERROR
    try:
        from verl_tokensel.verl_glue.install import register_v1_trainers

        register_v1_trainers()
        LOAD_ERROR = None
    except Exception:  # noqa: BLE001 - verl would swallow it; we make it loud instead
        LOAD_ERROR = _report(SELECTION_FAILED)


class _Loader(importlib.abc.Loader):
    """``base`` (the module's own loader), then ``callback`` once the module has executed."""

    def __init__(self, base, callback):
        self._base, self._callback = base, callback

    def create_module(self, spec):
        return self._base.create_module(spec)

    def exec_module(self, module):
        try:
            self._base.exec_module(module)
        finally:  # the module keeps its own loader
            module.__loader__ = self._base
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._base
        self._callback()

    def __getattr__(self, name):
        return getattr(self._base, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback`` right after module ``name`` is first imported (a post-import hook; once)."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        self.remove()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.callback)
                return spec
        return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _after_import(name: str, callback) -> None:
    """Run ``callback`` now if module ``name`` is imported, else right after its import."""
    if name in sys.modules:
        callback()
        return
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


def ensure_selection_loaded() -> str | None:
    """Import verl's trainer package, which registers the ``tokensel_`` trainer modes (once); returns
    :data:`LOAD_ERROR` (None when they are registered)."""
    import importlib

    try:
        importlib.import_module(TRAINER_PACKAGE)
    except Exception:  # noqa: BLE001 - verl's own package failed: selection cannot load either
        global LOAD_ERROR
        LOAD_ERROR = _report(SELECTION_FAILED)
        return LOAD_ERROR
    if LOAD_ERROR is None:
        load_selection()  # idempotent: registers whatever the post-import hook has not
    return LOAD_ERROR


def load() -> None:
    if cpu_platform_requested():
        load_cpu_port()
    _after_import(TRAINER_PACKAGE, load_selection)


load()
