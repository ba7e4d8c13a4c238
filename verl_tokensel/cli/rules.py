"""``verl-tokensel rules``: the registered token rules, shapings and presets, and what one preset does.

Without an argument: every rule and shaping with its formula, one line each, and every preset with its rule, ranking
and pool. With a preset: its rule and shaping, the shared keys, every knob of its rule with its value, its default
and the paper's value, and the rule's formula, source and deviations from the source (the fields the docs page
``docs/knobs.md`` is generated from). A value shown is what ``token_selector=<preset>`` trains with; override any
with ``actor_rollout_ref.actor.token_selection.<knob>=...``.

Rules and presets registered from your own code are listed too: the modules named in ``VERL_USE_EXTERNAL_MODULES``
(comma-separated, as verl reads it; the current directory is on the import path) are imported first.

Examples::

    verl-tokensel rules                 # every rule, shaping and preset
    verl-tokensel rules gmts            # what token_selector=gmts does: rule, knob values, formula, source, deviations
    verl-tokensel rules archer | less
    VERL_USE_EXTERNAL_MODULES=examples.custom_rule verl-tokensel rules surprise_weight   # a rule of your own
"""

from __future__ import annotations

import importlib
import os
import sys

HELP = "list the rules and presets, or print what one preset does (its knobs' values, formula, source, deviations)"
#: the environment variable verl reads for the modules to import at start-up (comma-separated)
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"


def add_arguments(parser) -> None:
    parser.add_argument("preset", nargs="?", default=None,
                        help="a token_selector preset (default: list every rule, shaping and preset)")


def import_external_modules() -> list[str]:
    """Import the modules of ``VERL_USE_EXTERNAL_MODULES`` (their rules and presets register), the current directory
    on the import path as under ``python -m``; returns their names."""
    names = [m.strip() for m in os.environ.get(EXTERNAL_MODULES, "").split(",") if m.strip()]
    if names and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        importlib.import_module(name)
    return names


def run(args) -> int:
    from verl_tokensel.cli.common import error

    try:
        import_external_modules()
    except Exception as exc:  # noqa: BLE001  (the user's module: say which, and why)
        return error(f"{EXTERNAL_MODULES}={os.environ.get(EXTERNAL_MODULES)!r}: importing it failed: {exc!r}")
    from verl_tokensel.core.resolve.describe import describe_preset, describe_rules, unknown_preset
    from verl_tokensel.core.resolve.presets import selectors

    if args.preset is None:
        sys.stdout.write(describe_rules())
        return 0
    if args.preset not in selectors():
        return error(unknown_preset(args.preset))
    sys.stdout.write(describe_preset(args.preset))
    return 0
