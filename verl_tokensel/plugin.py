"""verl plugin entry point (``verl.plugins`` group), imported by ``import verl`` in every process.

Registers the V1 trainer modes ``tokensel_<mode>`` (see :mod:`verl_tokensel.verl_glue.install`) and
verl's ``cpu`` platform (:mod:`verl_tokensel.verl_glue.platform_cpu`, used only with ``VERL_PLATFORM=cpu``). verl swallows exceptions raised by plugin imports,
so a failure here is printed to stderr (it lands in the driver's and each Ray worker's log) and
recorded in :data:`LOAD_ERROR`; ``verl-tokensel env`` and the config validation report it too.
"""

from __future__ import annotations

import sys
import traceback
import warnings

LOAD_ERROR: str | None = None


def _diagnosis() -> str:
    """The known cause of a load failure, one line each (:mod:`verl_tokensel.stack`), or ""."""
    try:
        from verl_tokensel.stack import check_stack

        return "".join(p.line() + "\n" for p in check_stack())
    except Exception:  # noqa: BLE001 - the traceback below is still printed
        return ""


def load() -> None:
    global LOAD_ERROR
    try:
        # register the `cpu` platform before anything below makes verl resolve its platform
        from verl_tokensel.verl_glue import platform_cpu

        platform_cpu.ensure_registered()
        from verl_tokensel.verl_glue.install import register_v1_trainers

        register_v1_trainers()
        LOAD_ERROR = None
    except Exception:  # noqa: BLE001 - verl would swallow it; we make it loud instead
        LOAD_ERROR = traceback.format_exc()
        msg = (
            "verl_tokensel: the verl plugin failed to load, token selection is NOT active in this process.\n"
            + _diagnosis()
            + LOAD_ERROR
        )
        print(msg, file=sys.stderr, flush=True)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)


load()
