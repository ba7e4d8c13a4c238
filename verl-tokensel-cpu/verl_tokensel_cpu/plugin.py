"""The CPU port's verl plugin entry point (``verl.plugins`` group ``tokensel_cpu``), imported by ``import verl``
in every process, next to the selection's (:mod:`verl_tokensel.plugin`).

Only when the CPU platform is asked for (``VERL_PLATFORM=cpu``, :func:`~verl_tokensel.switches.
cpu_platform_requested`) it loads the CPU port (:mod:`verl_tokensel_cpu.platform`: verl's ``cpu`` platform, the
``init_process_group`` fix, the vLLM-CPU fixes); on any other host it imports nothing more. verl loads each entry
point under its own ``try``, so a fault here can never switch token selection off, and the other way round.
A failure is recorded in :data:`LOAD_ERROR` and printed to stderr (verl would swallow it).

Processes that verl's CPU mode starts also import :mod:`verl_tokensel_cpu.platform` through
``VERL_USE_EXTERNAL_MODULES``, before any entry point: the platform is then registered already (idempotent).
"""

from __future__ import annotations

from verl_tokensel.switches import cpu_platform_requested, report_load_failure

LOAD_ERROR: str | None = None

FAILED = (
    "verl-tokensel: the CPU port (verl_tokensel_cpu) failed to load under VERL_PLATFORM=cpu; verl's `cpu` "
    "platform is NOT registered in this process.\n"
)


def load() -> None:
    global LOAD_ERROR
    if not cpu_platform_requested():
        return
    try:
        from verl_tokensel_cpu import platform as cpu_platform

        from verl_tokensel_cpu.megatron import install_on_megatron_import

        cpu_platform.ensure_registered()
        # model_engine=megatron (the CPU switch sets VERL_TOKENSEL_CPU_MEGATRON=1): the Megatron shims, installed when
        # this process imports megatron.core
        install_on_megatron_import()
        LOAD_ERROR = None
    except Exception:  # noqa: BLE001 - verl would swallow it; we make it loud instead
        LOAD_ERROR = report_load_failure(FAILED)


load()
