"""verl plugin entry point (``verl.plugins`` group), imported by ``import verl`` in every process.

Two steps, each guarded on its own, so that one cannot switch the other off:

1. Only when the CPU platform is asked for (``VERL_PLATFORM=cpu``): load the CPU port
   (:mod:`verl_tokensel.cpu.platform`) first, because the trainer modes below make verl resolve its
   platform and ``cpu`` must be registered by then. A failure is recorded in :data:`CPU_LOAD_ERROR`.
   On any other host the CPU port is never imported.
2. Always: register the V1 trainer modes ``tokensel_<mode>`` (:mod:`verl_tokensel.verl_glue.install`). A
   failure is recorded in :data:`LOAD_ERROR`.

verl swallows exceptions raised by plugin imports, so each failure is also printed to stderr (it lands in
the driver's and each Ray worker's log) with its own message; ``verl-tokensel env`` and the config
validation report :data:`LOAD_ERROR` too.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

LOAD_ERROR: str | None = None
CPU_LOAD_ERROR: str | None = None

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


def load() -> None:
    if cpu_platform_requested():
        load_cpu_port()
    load_selection()


load()
