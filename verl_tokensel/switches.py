"""The switches that decide which parts of verl_tokensel a process loads, read without importing those parts.

The bottom of the package (stdlib; omegaconf inside :func:`wants_cpu`), so every layer can ask:

* ``VERL_PLATFORM=cpu`` (:func:`cpu_platform_requested`): verl's CPU platform is asked for in this process;
  the CPU port's entry point (:mod:`verl_tokensel.cpu.plugin`) loads the port only then.
* ``trainer.device=cpu`` (:data:`CPU_SWITCH_KEY`, :func:`wants_cpu`): the one CPU switch of
  ``python -m verl_tokensel.main_ppo``, which fills every CPU setting (:mod:`verl_tokensel.cpu.pipeline`).

:func:`report_load_failure` is what both ``verl.plugins`` entry points do when their part fails to load: verl
swallows exceptions raised by plugin imports (a debug log line), so the failure is printed to stderr (it lands
in the driver's and each Ray worker's log) and warned, with the known cause of a broken stack when there is one.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

#: the env var verl reads to pick its platform, and the value of verl's CPU platform
PLATFORM_ENV = "VERL_PLATFORM"
CPU_PLATFORM = "cpu"
#: the one CPU switch of ``python -m verl_tokensel.main_ppo`` (:mod:`verl_tokensel.cpu.pipeline`)
CPU_SWITCH_KEY = "trainer.device"


def cpu_platform_requested(environ=None) -> bool:
    """True when this process is asked to run verl on the CPU platform (``VERL_PLATFORM=cpu``)."""
    environ = os.environ if environ is None else environ
    return environ.get(PLATFORM_ENV, "").strip().lower() == CPU_PLATFORM


def wants_cpu(config) -> bool:
    """True when the config carries the switch ``trainer.device=cpu`` (read without importing the CPU port)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(config, CPU_SWITCH_KEY, default="")).strip().lower() == CPU_PLATFORM


def load_failure_diagnosis() -> str:
    """The known cause of a load failure, one line each (:mod:`verl_tokensel.stack`), or ""."""
    try:
        from verl_tokensel.stack import check_stack

        return "".join(p.line() + "\n" for p in check_stack())
    except Exception:  # noqa: BLE001 - the traceback is still printed
        return ""


def report_load_failure(prefix: str) -> str:
    """Print ``prefix``, the diagnosis and the exception being handled to stderr and warn; returns the traceback.

    Call it from an ``except`` block. ``prefix`` names what is not active in this process and ends with a newline.
    """
    error = traceback.format_exc()
    msg = prefix + load_failure_diagnosis() + error
    print(msg, file=sys.stderr, flush=True)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return error


__all__ = ["CPU_PLATFORM", "CPU_SWITCH_KEY", "PLATFORM_ENV", "cpu_platform_requested", "load_failure_diagnosis",
           "report_load_failure", "wants_cpu"]
