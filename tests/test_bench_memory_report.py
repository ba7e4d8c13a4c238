"""benchmarks/bench_memory.py's report, fed saved measurements (the measurements themselves take 15-35 minutes
per shape and are not a test): ``--report`` merges several ``--json`` files, prints a shape the host's OOM killer
stopped as not measured, reads each selector against stock ``none`` and its matched baseline, flags what misses a
target, and gives the step-time spread of the two baselines that run the same update kernel. Well under a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_memory.py"
GIB = 2**20  # kB


def _row(peak_gib: float, seconds: float, kernel: str = "logprobs_from_logits_v2", process_gib: float | None = None,
         reused: float = float("nan")) -> dict:
    return {"peak_kb": peak_gib * GIB, "process_peak_kb": (process_gib or peak_gib) * GIB, "seconds": seconds,
            "cpu_seconds": 2 * seconds, "kernel_seconds": seconds / 2, "kernel": kernel, "prepass_reused_share": reused}


def _shape(slow_gmts: float) -> dict:
    return {
        "none": _row(10.0, 10.0),
        "none(no-graph entropy)": _row(10.0, 12.0),
        "none(same kernel)": _row(4.0, 8.0, kernel="logprobs_from_lse"),
        "forking": _row(4.0, 8.4, kernel="logprobs_from_lse"),
        "gmts": _row(10.0, 12.0 * slow_gmts, reused=1.0),
        "grad_norm": _row(10.0, 12.0),
        "forking_paper": _row(10.0, 12.0, process_gib=11.0),
    }


def _report(tmp_path, *parts: dict) -> str:
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    r = subprocess.run([sys.executable, str(SCRIPT), "--report", *map(str, paths)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_report_merges_files_flags_misses_and_killed_shapes(tmp_path):
    out = _report(tmp_path, {"h128/2304x1": _shape(1.1)},
                  {"h128/9216x1": {"killed": "none (memory) was killed by the OOM killer (23.5 GiB host)"},
                   "h1024/2304x1": _shape(1.3)})
    assert "h128/9216x1: not measured: none (memory) was killed by the OOM killer" in out
    assert out.index("h128/2304x1 (") < out.index("h128/9216x1: not") < out.index("h1024/2304x1 (")
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("forking ", "gmts ", "forking_"))}
    # forking: 8.4 s against stock none's 10 s and its matched baseline none(same kernel)'s 8 s
    assert "0.40|1.00" in lines["forking"] and "0.84|1.05" in lines["forking"]
    # forking_paper's process peak 11 GiB against 10: over the 1.05x target on both baselines
    assert "NOT MET: process memory" in lines["forking_paper"]
    assert ("summary: process peak memory vs none: worst 1.10x (forking_paper, h128/2304x1), target <= 1.05x: "
            "NOT MET") in out
    # gmts at 1.3 x 12 s = 15.6 s: 1.56x stock, 1.30x its matched baseline, both over 1.25x (worst at hidden 1024)
    assert "summary: step time (gmts) vs the matched baseline: worst 1.30x (gmts, h1024/2304x1)" in out
    # the two baselines that share the update kernel: 12 s against 10 s at both measured shapes
    assert "summary: none(no-graph entropy) vs none step time over the shapes: 1.20x to 1.20x" in out
    assert "summary: none(no-graph entropy) vs none step CPU time over the shapes: 1.20x to 1.20x" in out
    assert "summary: step CPU time (gmts) vs the matched baseline: worst 1.30x (gmts, h1024/2304x1)" in out
    assert "summary: update peak memory vs none: worst 1.00x" in out and "target <= 1.05x: met" in out


def test_report_joins_a_memory_only_rerun_to_the_earlier_timing_and_gives_the_spread(tmp_path):
    timed = {"h128/2304x1": _shape(1.0)}
    nan = float("nan")
    rerun = {}
    for v, row in _shape(1.0).items():  # memory only (--no-time), two processes per variant, the fixed allocator
        runs = [row["peak_kb"], row["peak_kb"] * (1.2 if v == "gmts" else 1.0)]
        rerun[v] = {**row, "seconds": nan, "kernel_seconds": nan, "kernel": "-", "prepass_reused_share": nan,
                    "allocator": "fixed", "peak_kb_runs": runs, "process_peak_kb_runs": [row["process_peak_kb"]] * 2,
                    "peak_kb": max(runs), "process_peak_kb": row["process_peak_kb"]}
    out = _report(tmp_path, timed, {"h128/2304x1": rerun})
    assert "memory: 2 processes per variant (max), allocator fixed" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("forking ", "gmts "))}
    # the rerun's memory (gmts 12 GiB against 10) with the earlier run's step time (gmts 12 s) and kernel
    assert "1.20|1.20" in lines["gmts"] and "1.20|1.00" in lines["gmts"] and "logprobs_from_logits_v2" in lines["gmts"]
    assert "logprobs_from_lse" in lines["forking"] and "0.84|1.05" in lines["forking"]
    assert ("summary: peak memory over repeated identical processes (allocator fixed): widest spread (max/min) 1.20x "
            "(gmts, h128/2304x1)") in out


def test_refuses_to_measure_nothing():
    r = subprocess.run([sys.executable, str(SCRIPT), "--no-time", "--no-memory"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--no-time and --no-memory" in r.stderr


def test_report_reads_a_hidden_state_rule_and_its_knob_variant(tmp_path):
    """``delta`` (a rule over the hidden states) against its own memory target (1.10x, its time reported with no
    target), a knob variant spec (``delta:delta_cache_gib=4``), the forwards and the bytes a cache holds under the
    table, and a memory-only run joined by a timing run of other variants (each keeps its rows)."""
    hidden = {"hidden_forwards": 4.0, "hidden_sweep_seconds": 3.0, "hidden_tokens": 2048.0,
              "hidden_bytes": 2048.0 * 128 * 4}
    nan = float("nan")
    untimed = {"seconds": nan, "cpu_seconds": nan, "kernel_seconds": nan, "kernel": "-", "prepass_reused_share": nan}
    memory = {"h128/2304x1": {"none": {"peak_kb": 10.0 * GIB, "process_peak_kb": 10.0 * GIB, **untimed},
                              "ce_gppo": {"peak_kb": 10.0 * GIB, "process_peak_kb": 10.0 * GIB, **untimed},
                              "delta": {"peak_kb": 10.8 * GIB, "process_peak_kb": 10.8 * GIB, **untimed, **hidden},
                              "delta:delta_cache_gib=4": {"peak_kb": 11.5 * GIB, "process_peak_kb": 11.5 * GIB,
                                                          **untimed, **hidden, "hidden_forwards": 1.0}}}
    timing = {"h128/2304x1": {v: {**_row(nan, s), "peak_kb": nan, "process_peak_kb": nan}
                              for v, s in (("none", 10.0), ("none(no-graph entropy)", 10.0), ("delta", 20.0),
                                           ("delta:delta_cache_gib=4", 12.0))}}
    out = _report(tmp_path, memory, timing)
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(("delta", "ce_gppo"))}
    assert "ce_gppo" in lines  # the memory run's variant the timing run did not run keeps its row
    assert "1.08|" in lines["delta"] and "2.00|2.00" in lines["delta"] and "ok | ok" in lines["delta"]
    assert "NOT MET: update memory, process memory" in lines["delta:delta_cache_gib=4"]
    assert "delta: 4 no-grad forward(s)" in out and "hidden states 1.0 MiB" in out
    assert ("delta:delta_cache_gib=4: 1 no-grad forward(s) over the step's batch before its update "
            "(delta_cache_gib 4)") in out
    assert "summary: step time (delta) vs the matched baseline: worst 2.00x (delta, h128/2304x1), no target" in out
    assert "summary: update peak memory (delta) vs none: worst 1.15x (delta:delta_cache_gib=4, h128/2304x1), " \
           "target <= 1.10x: NOT MET" in out
