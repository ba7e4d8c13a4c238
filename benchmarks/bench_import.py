"""What the plugin adds to ``import verl`` (run in every process verl starts), side by side in one run.

Run (from the repository root, in the environment where verl and verl-tokensel are installed)::

    python benchmarks/bench_import.py              # 7 rounds
    python benchmarks/bench_import.py --rounds 11

Each round starts two fresh interpreters, one after the other in alternating order: ``import verl`` with
verl's plugin discovery off (``VERL_USE_EXTERNAL_PLUGINS=none``: plain verl) and on (the default: verl loads the
``tokensel`` entry point). Each child reports the wall time of the import and the number of modules it
left in ``sys.modules``. A third row imports verl's V1 trainer package on top, in both settings: there the
plugin registers its ``tokensel_`` trainer modes (what the process that builds the trainer pays).

Prints the median time and module count per variant and the ratios; the last line is
``import verl with the plugin: X.XXx the time of plain import verl (target <= 1.15x)``.
Absolute times are for the record only: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TARGET = 1.15
CHILD = (
    "import json, sys, time\n"
    "t = time.perf_counter()\n"
    "import verl\n"
    "{extra}"
    "dt = time.perf_counter() - t\n"
    "print(json.dumps({{'seconds': dt, 'modules': len(sys.modules), 'vllm': 'vllm' in sys.modules}}))\n"
)
TRAINERS = "import verl.trainer.ppo.v1\n"


def child(plugins: bool, trainers: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    if not plugins:
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    code = CHILD.format(extra=TRAINERS if trainers else "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"child (plugins={plugins}, trainers={trainers}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="fresh-process pairs per row (default 7)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be >= 1")
    rows = {}
    for trainers in (False, True):
        runs: dict = {False: [], True: []}
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            for plugins in order:
                runs[plugins].append(child(plugins, trainers))
        rows[trainers] = runs
        print(f"  {'import verl + its trainers' if trainers else 'import verl'}: {args.rounds} rounds done",
              file=sys.stderr, flush=True)
    print(f"\n{'what':<30} {'plain verl':>12} {'with plugin':>12} {'ratio':>7}  {'modules plain / plugin':>24}  vllm")
    ratio_import = float("nan")
    for trainers, runs in rows.items():
        t = {p: statistics.median(r["seconds"] for r in runs[p]) for p in runs}
        m = {p: statistics.median(r["modules"] for r in runs[p]) for p in runs}
        vllm = "yes" if any(r["vllm"] for r in runs[True]) else "no"
        ratio = t[True] / t[False]
        if not trainers:
            ratio_import = ratio
        label = "import verl, then its trainers" if trainers else "import verl"
        print(f"{label:<30} {t[False]:>11.2f}s {t[True]:>11.2f}s {ratio:>6.2f}x  {m[False]:>11.0f} / {m[True]:<10.0f}  "
              f"{vllm}")
    verdict = "met" if ratio_import <= TARGET else "NOT MET"
    print(f"import verl with the plugin: {ratio_import:.2f}x the time of plain import verl (target <= {TARGET:.2f}x: "
          f"{verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
