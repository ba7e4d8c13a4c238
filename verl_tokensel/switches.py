"""The switches that decide which parts of verl_tokensel a process loads, read without importing those parts.

The bottom of the package (stdlib; omegaconf inside :func:`wants_cpu`), so every layer can ask:

* ``VERL_PLATFORM=cpu`` (:func:`cpu_platform_requested`): verl's CPU platform is asked for in this process;
  the CPU port's entry point (``verl_tokensel_cpu.plugin``, distribution ``verl-tokensel-cpu``) loads the port
  only then.
* ``trainer.device=cpu`` (:data:`CPU_SWITCH_KEY`, :func:`wants_cpu`): the one CPU switch of
  ``python -m verl_tokensel.main_ppo``, which fills every CPU setting. The product does not hold the CPU port: the
  switch calls the device port registered under its value in the entry-point group :data:`DEVICE_PORTS_GROUP`
  (:func:`device_port`; the CPU distribution registers ``cpu``), and without one it stops with the install line.
* :data:`COMMANDS_GROUP`: the entry-point group of ``verl-tokensel`` subcommands from other distributions (the CPU
  distribution's ``demo``, ``cpu-step``, ``tiny-model``).

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
#: the one CPU switch of ``python -m verl_tokensel.main_ppo`` (the CPU distribution's ``pipeline``)
CPU_SWITCH_KEY = "trainer.device"
#: entry-point group: ``<trainer.device value> = module:callable``, the callable fills that device's settings into
#: the config (in place, before Ray starts) and raises :class:`SwitchConflictError` for settings it cannot honour
DEVICE_PORTS_GROUP = "verl_tokensel.device_ports"
#: entry-point group: ``<subcommand> = module`` (the module has ``HELP``, ``add_arguments(parser)``, ``run(args)``)
COMMANDS_GROUP = "verl_tokensel.commands"
#: the distribution that holds the CPU port, and how the README installs it
CPU_DISTRIBUTION = "verl-tokensel-cpu"
CPU_INSTALL = "bash scripts/install_cpu.sh (from a clone of verl-tokensel), or pip install ./verl-tokensel-cpu"


def cpu_platform_requested(environ=None) -> bool:
    """True when this process is asked to run verl on the CPU platform (``VERL_PLATFORM=cpu``)."""
    environ = os.environ if environ is None else environ
    return environ.get(PLATFORM_ENV, "").strip().lower() == CPU_PLATFORM


def wants_cpu(config) -> bool:
    """True when the config carries the switch ``trainer.device=cpu`` (read without importing the CPU port)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(config, CPU_SWITCH_KEY, default="")).strip().lower() == CPU_PLATFORM


class SwitchConflictError(ValueError):
    """Settings of a config that a device switch cannot honour, or a switch whose port is not installed: one
    message for the user (``main_ppo`` prints it without a traceback and exits 2, before Ray starts)."""


def device_port(device: str):
    """The callable that fills the settings of ``trainer.device=<device>`` (entry-point group
    :data:`DEVICE_PORTS_GROUP`); raises :class:`SwitchConflictError` naming the install when no distribution
    registers it."""
    from importlib.metadata import entry_points

    ports = {ep.name: ep for ep in entry_points(group=DEVICE_PORTS_GROUP)}
    if device not in ports:
        installed = ", ".join(sorted(ports)) or "none"
        raise SwitchConflictError(
            f"{CPU_SWITCH_KEY}={device}: no device port for {device!r} is installed (installed ports: {installed}). "
            f"The CPU pipeline is the separate distribution {CPU_DISTRIBUTION}: {CPU_INSTALL}.")
    return ports[device].load()


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


__all__ = ["COMMANDS_GROUP", "CPU_DISTRIBUTION", "CPU_INSTALL", "CPU_PLATFORM", "CPU_SWITCH_KEY", "DEVICE_PORTS_GROUP",
           "PLATFORM_ENV", "SwitchConflictError", "cpu_platform_requested", "device_port", "load_failure_diagnosis",
           "report_load_failure", "wants_cpu"]
