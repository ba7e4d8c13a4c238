"""Chunked (streaming-softmax) token scorer vs the naive full-vocabulary softmax (CPU, fp32), as ratios.

Run (from the repository root, a few minutes on 2 busy cores)::

    python benchmarks/bench_scorer.py

Compares ``verl_tokensel.analysis.scorer.streaming_token_stats`` (default ``chunk_size``) with
``naive_token_stats`` on ``tokens`` random hidden states, an LM head of the Qwen vocabulary
(V=151936) and hidden sizes 1024 and 256, float32 on CPU:

* Peak memory: every variant runs once in a fresh subprocess that builds the same inputs (in place,
  no temporaries), warms the libraries up on tiny inputs with both scorers, then scores. A baseline
  subprocess does all of that except the scoring. Reported: ``ru_maxrss(variant) - ru_maxrss(baseline)``
  (the extra peak resident memory the scoring needed), in MB and as chunked/naive. Target <= 0.1x.
* Throughput: one subprocess per (hidden, threads) runs the two scorers interleaved (naive, chunked,
  naive, ...) ``--repeats`` times after a warm-up; tokens/s ratio = median naive time / median
  chunked time. Target >= 0.9x. ``noise`` is the larger IQR/median of the two timing series: ratios
  closer to 1 than that are within noise. ``rel diff`` is the largest relative difference of the two
  scorers' outputs (denominator >= 1e-3): mostly the naive float32 path's own rounding (its float32
  sums over the whole vocabulary are off by ~1e-5; the chunked one matches float64 to ~1e-6).

Last run (2026-12-02, 2 shared cores, tokens=2048, chunk_size=2048, 1 thread): memory 0.007x at both hidden
sizes; throughput 2.41x (hidden 1024) and 4.28x (hidden 256). Under CPU oversubscription (load > cores)
multi-threaded runs of the chunked scorer can collapse (each of its many small parallel regions waits for a
descheduled OpenMP thread): use 1 thread.

Options: ``--tokens N`` (default 2048), ``--vocab V`` (151936), ``--hidden 1024,256``, ``--threads 1``
(torch intra-op threads for the timing; e.g. ``1,2``. On a shared, busy CPU OpenMP spin-waits can
make multi-threaded runs meaningless), ``--repeats R`` (5), ``--chunk-size C`` (the scorer's default),
``--skip-memory`` / ``--skip-speed``. Absolute times are meaningless on a shared CPU and are not printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEM_TARGET = 0.1
SPEED_TARGET = 0.9


def _inputs(tokens: int, vocab: int, hidden: int):
    """Deterministic fp32 inputs built in place (no transient copies that would inflate the baseline)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    h = torch.empty(tokens, hidden).normal_(generator=g)
    w = torch.empty(vocab, hidden).normal_(generator=g).mul_(3.0 / hidden**0.5)  # logits std ~3
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, t


def _scorers(chunk_size):
    from verl_tokensel.analysis.scorer import naive_token_stats, streaming_token_stats

    return {
        "naive": lambda h, w, t: naive_token_stats(h, w, t),
        "chunked": lambda h, w, t: streaming_token_stats(h, w, t, chunk_size=chunk_size),
    }


def _child_memory(args) -> dict:
    import torch

    torch.set_num_threads(1)
    scorers = _scorers(args.chunk_size)
    h, w, t = _inputs(args.tokens, args.vocab, args.hidden_one)
    small = _inputs(8, 4096, args.hidden_one)
    for fn in scorers.values():  # load MKL/OpenMP and allocator state in every process alike
        fn(*small)
    if args.variant != "baseline":
        out = scorers[args.variant](h, w, t)
        assert all(bool(torch.isfinite(x).all()) for x in out)
    return {"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def _child_speed(args) -> dict:
    import torch

    torch.set_num_threads(args.threads_one)
    scorers = _scorers(args.chunk_size)
    h, w, t = _inputs(args.tokens, args.vocab, args.hidden_one)
    outs = {name: fn(h, w, t) for name, fn in scorers.items()}  # warm-up (also first-touch of the pages)
    times = {name: [] for name in scorers}
    for _ in range(args.repeats):
        for name, fn in scorers.items():
            t0 = time.perf_counter()
            fn(h, w, t)
            times[name].append(time.perf_counter() - t0)
    # sanity: both give the same statistics (naive is float32 throughout, so ~1e-5)
    diff = max(
        float(((a.double() - b.double()).abs() / b.double().abs().clamp(min=1e-3)).max())
        for a, b in zip(outs["chunked"], outs["naive"])
    )
    return {"times": times, "max_rel_diff": diff}


def _run_child(mode: str, args, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", mode, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--repeats", str(args.repeats), "--chunk-size", str(args.chunk_size)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, OMP_NUM_THREADS=str(extra.get("threads_one", 1)))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"child {mode} {extra} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _spread(xs) -> float:
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def main(argv=None) -> int:
    from verl_tokensel.analysis.scorer import DEFAULT_CHUNK

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", default="1024,256")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--_child", choices=["memory", "speed"], help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="baseline", help=argparse.SUPPRESS)
    ap.add_argument("--hidden-one", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--threads-one", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._child:
        out = _child_memory(args) if args._child == "memory" else _child_speed(args)
        print(json.dumps(out))
        return 0

    hiddens = [int(x) for x in args.hidden.split(",") if x]
    threads = [int(x) for x in args.threads.split(",") if x]
    print(f"chunked scorer (chunk_size={args.chunk_size}) vs naive full softmax: vocab={args.vocab}, "
          f"tokens={args.tokens}, fp32, CPU")
    ok = True
    if not args.skip_memory:
        print("\npeak extra memory (fresh subprocess per variant; ru_maxrss minus a setup-only baseline):")
        print(f"  {'hidden':>6}  {'naive MB':>9}  {'chunked MB':>10}  {'chunked/naive':>13}  target <= {MEM_TARGET}x")
        for d in hiddens:
            kb = {v: _run_child("memory", args, variant=v, hidden_one=d)["maxrss_kb"]
                  for v in ("baseline", "naive", "chunked")}
            naive_mb = (kb["naive"] - kb["baseline"]) / 1024
            chunk_mb = (kb["chunked"] - kb["baseline"]) / 1024
            ratio = chunk_mb / naive_mb
            ok &= ratio <= MEM_TARGET
            print(f"  {d:>6}  {naive_mb:>9.0f}  {chunk_mb:>10.0f}  {ratio:>12.3f}x  "
                  f"{'ok' if ratio <= MEM_TARGET else 'MISSED'}")
    if not args.skip_speed:
        print(f"\nthroughput (tokens/s), median of {args.repeats} interleaved repeats after a warm-up:")
        print(f"  {'hidden':>6}  {'threads':>7}  {'chunked/naive':>13}  {'noise':>6}  {'rel diff':>12}  "
              f"target >= {SPEED_TARGET}x")
        for d in hiddens:
            for nt in threads:
                r = _run_child("speed", args, hidden_one=d, threads_one=nt)
                tn, tc = r["times"]["naive"], r["times"]["chunked"]
                ratio = statistics.median(tn) / statistics.median(tc)
                ok &= ratio >= SPEED_TARGET
                noise = max(_spread(tn), _spread(tc))
                print(f"  {d:>6}  {nt:>7}  {ratio:>12.2f}x  {noise:>6.2f}  {r['max_rel_diff']:>12.1e}  "
                      f"{'ok' if ratio >= SPEED_TARGET else 'MISSED'}")
    print("\nall targets met" if ok else "\nsome target MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
