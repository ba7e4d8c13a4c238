"""verl plugin entry point (``verl.plugins`` group ``tokensel``), imported by ``import verl`` in every process.

It registers the V1 trainer modes ``tokensel_<mode>`` (:mod:`verl_tokensel.verl_glue.install`) right after
verl's trainer package (:data:`TRAINER_PACKAGE`) is imported, by whoever imports it first (verl's ``main_ppo``
does, in the process that builds the trainer), or at once if it is imported already. A failure is recorded in
:data:`LOAD_ERROR`.

The registration is deferred (a post-import hook, :mod:`verl_tokensel.import_hook`) so that ``import verl``
stays light in every process verl starts (the driver, the TaskRunner, each worker): registering needs verl's
trainer modules, which import vLLM and the checkpoint engines and resolve the accelerator; a process that never
builds a trainer never pays for them. :func:`ensure_selection_loaded` forces the registration
(``verl-tokensel env``, tests).

The CPU port is not loaded from here: it has its own entry point (``tokensel_cpu``,
:mod:`verl_tokensel_cpu.plugin`), which verl loads in the same processes, under its own guard, so a fault in
one can never switch the other off.

verl swallows exceptions raised by plugin imports, so a failure is also printed to stderr (it lands in the
driver's and each Ray worker's log, :func:`~verl_tokensel.switches.report_load_failure`); ``verl-tokensel env``
and the config validation report :data:`LOAD_ERROR` too.

``python -m verl.trainer.main_ppo`` with verl's own config and a token-selection key stops here, at ``import verl``
before Hydra composes, with one line naming the routes that work (:func:`refuse_wrong_route`).
"""

from __future__ import annotations

import sys

from verl_tokensel.import_hook import after_import
from verl_tokensel.switches import report_load_failure

LOAD_ERROR: str | None = None
#: verl's V1 trainer package: its import fills verl's trainer registry; ours are registered right after it
TRAINER_PACKAGE = "verl.trainer.ppo.v1"
#: verl's policy-loss registry: ours (``tokensel_ppo_clip``) is registered right after it
POLICY_LOSSES_MODULE = "verl.trainer.ppo.core_algos"

SELECTION_FAILED = "verl-tokensel: the verl plugin failed to load, token selection is NOT active in this process.\n"


def load_selection() -> None:
    global LOAD_ERROR
    try:
        from verl_tokensel.verl_glue.install import register_v1_trainers

        register_v1_trainers()
        LOAD_ERROR = None
    except Exception:  # noqa: BLE001 - verl would swallow it; we make it loud instead
        LOAD_ERROR = report_load_failure(SELECTION_FAILED)


def ensure_selection_loaded() -> str | None:
    """Import verl's trainer package, which registers the ``tokensel_`` trainer modes (once); returns
    :data:`LOAD_ERROR` (None when they are registered)."""
    import importlib

    try:
        importlib.import_module(TRAINER_PACKAGE)
    except Exception:  # noqa: BLE001 - verl's own package failed: selection cannot load either
        global LOAD_ERROR
        LOAD_ERROR = report_load_failure(SELECTION_FAILED)
        return LOAD_ERROR
    if LOAD_ERROR is None:
        load_selection()  # idempotent: registers whatever the post-import hook has not
    return LOAD_ERROR


def refuse_wrong_route() -> None:
    """Exit with one line on stderr when this process is ``python -m verl.trainer.main_ppo`` with verl's own config
    and a token-selection key, which that config cannot take (Hydra would fail on it with ``Key 'token_selector'
    is not in struct``): the line names the two routes that work (:func:`verl_tokensel.verl_glue.routes.
    wrong_route_line`). Every other command, a stock run of verl's entry point included, is left alone."""
    if not any("token_select" in arg for arg in sys.argv[1:]):  # no selection key: import nothing more
        return
    try:
        from verl_tokensel.verl_glue.routes import wrong_route_line

        line = wrong_route_line()
    except Exception:  # noqa: BLE001 - reading the command line must never break import verl
        return
    if line:
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(2)  # not an Exception: verl's guard around plugin imports lets it through


def load_policy_losses() -> None:
    """Register the ``tokensel_`` policy losses in verl's registry (every process that imports verl's
    ``core_algos``: workers look a ``loss_mode`` up there)."""
    global LOAD_ERROR
    try:
        from verl_tokensel.verl_glue.policy_loss import register_policy_losses

        register_policy_losses()
    except Exception:  # noqa: BLE001 - verl would swallow it; we make it loud instead
        LOAD_ERROR = report_load_failure(SELECTION_FAILED)


def load() -> None:
    refuse_wrong_route()
    after_import(TRAINER_PACKAGE, lambda _trainer_package: load_selection())
    after_import(POLICY_LOSSES_MODULE, lambda _core_algos: load_policy_losses())


load()
