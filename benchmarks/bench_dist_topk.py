"""Exact distributed top-k: radix select vs all-gather, bytes sent per rank and wall time (CPU, gloo).

Run (from the repository root; about 9 minutes at the default sizes on a busy 2-core machine)::

    python benchmarks/bench_dist_topk.py [--max-log2 24] [--ranks 4]

Other options: ``--min-log2 16``, ``--repeats 5`` (timed calls per method and size), ``--ratio 0.2``,
``--timeout 1500`` (hard limit in seconds for the whole run; the ranks are killed when it expires).

What it does: spawns W gloo ranks on 127.0.0.1 (torch.multiprocessing, a free port, 1 torch thread
each). For N = 2^16, 2^18, ... 2^max-log2 float32 scores per rank (rounded to 1/32, so values repeat
and the global threshold is a tie; a few NaN) and k = ceil(ratio * W * N), each rank computes its
share of the global top-k twice:

(a) radix: :func:`verl_tokensel.core.ranking.dist_topk.topk_mask_distributed` (all-reduces of 256-bin
    histograms; nothing of size N leaves the rank);
(b) all-gather: gather every rank's scores (padded to the largest rank), select over the
    rank-ordered union with :func:`verl_tokensel.core.ranking.select.keep_first_k` (``torch.topk`` on the keys,
    ties to the earliest position, i.e. the stable order the radix path promises) and keep this
    rank's slice.

Both masks must be identical on every rank and select exactly k items in total; the run stops with
an error otherwise.

Bytes: inside each rank process ``torch.distributed.all_reduce`` / ``all_gather`` /
``all_gather_into_tensor`` are wrapped to add up ``numel() * element_size()`` of the tensor each
rank contributes to every call made during one selection (any other collective raises while
counting, so nothing goes uncounted). This is the payload a rank sends; what goes over the wire also
depends on the algorithm (a ring all-reduce sends ~2(W-1)/W times its payload, a ring all-gather
W-1 times), which only makes the all-gather look worse than printed.

Time: per repeat all ranks pass a barrier, run one selection, and the slowest rank's elapsed time
counts (max over ranks); the median over the repeats is reported, the two methods interleaved.
Ranks share this machine's cores, so absolute times include waiting for the CPU; they are printed
only as supporting information next to the ratio.

Sizes that do not fit: before starting, a size whose estimated peak memory (all ranks together,
dominated by the all-gather's union) exceeds 80% of MemAvailable is not run; during the run, a size
whose time, extrapolated from the previous one, would not finish before the timeout is not run.
Either way the output says so and the table stops at the largest size that ran.

The machinery (byte counting, timing, ranks and their driver, the memory and time guards) is shared with
``bench_cov_exchange.py``, which imports it from here.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import resource
import socket
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_tokensel.core.ranking.dist_topk import ordered_keys, topk_mask_distributed
from verl_tokensel.core.ranking.select import keep_first_k

# Peak resident memory of one rank: the all-gather baseline dominates (the radix path only ever holds
# a few copies of its own N). Per element of the union (W * N): gathered copies + concatenation (8),
# int64 keys and their temporaries in ordered_keys and keep_first_k (~4 x 8), topk values/indices for
# k = 0.2 * union (~3). Measured: 1.0 GiB per rank at 2^22 x 4 ranks, i.e. ~46 B per union element.
BASELINE_BYTES_PER_UNION_ELEMENT = 48
RANK_BASE_BYTES = 300 << 20  # python + torch + gloo per process


# --------------------------------------------------------------------------------------------
# counting the bytes each rank hands to torch.distributed
# --------------------------------------------------------------------------------------------
class CollectiveBytes:
    """Wraps torch.distributed's collectives in this process; counts payload bytes while ``on``."""

    FORBIDDEN = ("broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                 "all_to_all_single", "scatter", "gather", "send", "recv", "isend", "irecv")

    def __init__(self):
        self.on = False
        self.bytes = 0
        self.calls = 0
        counted = {"all_reduce": lambda *a, **kw: kw.get("tensor", a[0] if a else None),
                   "all_gather": lambda *a, **kw: kw.get("tensor", a[1] if len(a) > 1 else None),
                   "all_gather_into_tensor": lambda *a, **kw: kw.get("input_tensor", a[1] if len(a) > 1 else None)}
        for name, payload in counted.items():
            setattr(dist, name, self._counting(getattr(dist, name), payload))
        for name in self.FORBIDDEN:
            if hasattr(dist, name):
                setattr(dist, name, self._refusing(getattr(dist, name), name))

    def _counting(self, fn, payload):
        def wrapper(*args, **kwargs):
            if self.on:
                t = payload(*args, **kwargs)
                self.bytes += t.numel() * t.element_size()
                self.calls += 1
            return fn(*args, **kwargs)
        return wrapper

    def _refusing(self, fn, name):
        def wrapper(*args, **kwargs):
            if self.on:
                raise RuntimeError(f"torch.distributed.{name} called while counting bytes: not counted, refusing")
            return fn(*args, **kwargs)
        return wrapper

    def measure(self, fn):
        """Run ``fn()`` with counting on; returns (result, bytes, calls)."""
        self.bytes = self.calls = 0
        self.on = True
        try:
            out = fn()
        finally:
            self.on = False
        return out, self.bytes, self.calls


# --------------------------------------------------------------------------------------------
# the two selections being compared
# --------------------------------------------------------------------------------------------
def radix_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    return topk_mask_distributed(values, k, None, largest=True)


def gather_union(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's scores, rank-ordered (gathered padded to the largest rank), and where ours start."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = torch.tensor([values.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    padded = values.new_zeros(max(sizes))
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    union = torch.cat([p[:s] for p, s in zip(parts, sizes)])
    del parts
    return union, sum(sizes[:rank])


def allgather_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Gather all scores, stable top-k over the union, keep this rank's slice."""
    union, start = gather_union(values)
    everything = torch.ones_like(union, dtype=torch.bool)
    return keep_first_k(union, everything, k, "top")[start : start + values.numel()].clone()


def make_scores(n: int, rank: int, log2: int) -> torch.Tensor:
    """float32 normal scores rounded to 1/32 (few hundred distinct values: many ties), ~1e-4 NaN."""
    g = torch.Generator().manual_seed(1000 * log2 + rank)
    x = torch.round(torch.randn(n, generator=g) * 32) / 32
    x[torch.randint(0, n, (max(1, n // 10000),), generator=g)] = float("nan")
    return x


# --------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------
def all_reduce_scalar(x: float, op) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def timed_max_over_ranks(fn) -> float:
    """Barrier, run fn, return the slowest rank's elapsed seconds (same value on every rank)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return all_reduce_scalar(time.perf_counter() - t0, dist.ReduceOp.MAX)


def check_masks(radix: torch.Tensor, base: torch.Tensor, values: torch.Tensor, k: int) -> dict:
    """Identical masks on every rank, exactly k selected by each; threshold tie statistics."""
    equal = all_reduce_scalar(float(torch.equal(radix, base)), dist.ReduceOp.MIN) == 1.0
    n_radix = all_reduce_scalar(float(radix.sum()), dist.ReduceOp.SUM)
    n_base = all_reduce_scalar(float(base.sum()), dist.ReduceOp.SUM)
    keys = ordered_keys(values)
    kth = all_reduce_scalar(float(keys[base].min()) if bool(base.any()) else 2.0**32, dist.ReduceOp.MIN)
    tied = all_reduce_scalar(float((keys == kth).sum()), dist.ReduceOp.SUM)
    tied_kept = all_reduce_scalar(float(((keys == kth) & base).sum()), dist.ReduceOp.SUM)
    ok = equal and n_radix == k and n_base == k
    return dict(ok=ok, equal=equal, n_radix=int(n_radix), n_base=int(n_base), tied=int(tied), tied_kept=int(tied_kept))


def time_budget_exceeded(previous_s, prev_log2, log2: int, deadline: float,
                         limit: str = "the --timeout") -> Optional[str]:
    """Why size 2^log2 cannot finish before ``deadline`` (None if it can), from the seconds the previous size took.

    Sizes grow 4x per step and every method compared here is at least linear in N. Collective: every rank gets
    the same answer (the minimum over ranks of "it fits").
    """
    if previous_s is None:
        return None
    predicted = previous_s * (1 << (log2 - prev_log2)) * 1.2
    fits = deadline - time.time() - 30 > predicted
    if all_reduce_scalar(float(fits), dist.ReduceOp.MIN) == 1.0:
        return None
    return (f"2^{log2} per rank not run: predicted {predicted:.0f} s (+30 s margin), "
            f"only {deadline - time.time():.0f} s left before {limit}")


def rank_process(rank: int, world: int, port: int, q, body, body_args: tuple) -> None:
    """One gloo rank: join the group, run ``body(rank, world, q, stage, *body_args)``, leave; report to ``q``.

    ``stage(text)`` tells the driver what this rank is doing (printed if the run aborts); ``body`` puts its
    results on ``q`` as ``("row", dict)`` and ``("stop", reason)`` messages; an exception ends the run.
    """
    def stage(text: str) -> None:
        q.put(("stage", rank, text))

    try:
        torch.set_num_threads(1)
        stage("init_process_group (waiting for all ranks to join)")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        body(rank, world, q, stage, *body_args)
        stage("destroy_process_group")
        dist.barrier()
        dist.destroy_process_group()
        q.put(("done", rank, ""))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)


def rank_main(rank: int, world: int, q, stage, args, log2s: list[int], deadline: float) -> None:
    counter = CollectiveBytes()
    previous_s = None  # seconds the previous size took (checks and every timed call)
    prev_log2 = None
    for log2 in log2s:
        n = 1 << log2
        k = math.ceil(args.ratio * world * n)
        late = time_budget_exceeded(previous_s, prev_log2, log2, deadline)
        if late is not None:
            if rank == 0:
                q.put(("stop", late))
            break
        t_size = time.perf_counter()
        values = make_scores(n, rank, log2)

        # untimed first call of each: the masks to check and the bytes (identical every call)
        stage(f"2^{log2}: radix, first call")
        m_radix, b_radix, c_radix = counter.measure(lambda: radix_mask(values, k))
        stage(f"2^{log2}: all-gather, first call")
        m_base, b_base, c_base = counter.measure(lambda: allgather_mask(values, k))
        stage(f"2^{log2}: checking masks")
        check = check_masks(m_radix, m_base, values, k)
        del m_radix, m_base
        if not check["ok"]:
            raise AssertionError(f"2^{log2}: masks differ or wrong count: {check} (k={k})")
        b_radix = all_reduce_scalar(b_radix, dist.ReduceOp.MAX)
        b_base = all_reduce_scalar(b_base, dist.ReduceOp.MAX)

        t_radix, t_base, t_gather = [], [], []
        for i in range(args.repeats):
            stage(f"2^{log2}: timed repeat {i + 1}/{args.repeats}, radix")
            t_radix.append(timed_max_over_ranks(lambda: radix_mask(values, k)))
            stage(f"2^{log2}: timed repeat {i + 1}/{args.repeats}, all-gather")
            t_base.append(timed_max_over_ranks(lambda: allgather_mask(values, k)))
            stage(f"2^{log2}: timed repeat {i + 1}/{args.repeats}, gather only")
            t_gather.append(timed_max_over_ranks(lambda: gather_union(values)))
        values = None  # free the scores before the next size
        rss = all_reduce_scalar(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, dist.ReduceOp.MAX)
        previous_s, prev_log2 = all_reduce_scalar(time.perf_counter() - t_size, dist.ReduceOp.MAX), log2
        if rank == 0:
            q.put(("row", dict(log2=log2, k=k, b_radix=int(b_radix), c_radix=c_radix, b_base=int(b_base),
                               c_base=c_base, t_radix=statistics.median(t_radix),
                               t_base=statistics.median(t_base), t_gather=statistics.median(t_gather), rss=rss,
                               **check)))


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def estimated_peak(n: int, world: int) -> int:
    """Bytes for all ranks together at N per rank (the all-gather baseline's peak)."""
    return world * (RANK_BASE_BYTES + BASELINE_BYTES_PER_UNION_ELEMENT * world * n)


def sizes_that_fit(log2s: list[int], world: int, estimate: Callable[[int, int], int]) -> list[int]:
    """The leading sizes whose estimated peak memory (``estimate(n, world)`` bytes, all ranks together) fits in 80%
    of MemAvailable; prints why the first size that does not fit (and every larger one) is not run."""
    fit, avail = [], mem_available()
    for log2 in log2s:
        need = estimate(1 << log2, world)
        if need > 0.8 * avail:
            print(f"NOTE: 2^{log2} per rank x {world} ranks not run: estimated peak memory {fmt_bytes(need)} "
                  f"> 80% of MemAvailable ({fmt_bytes(avail)}); stopping at 2^{fit[-1] if fit else '-'}")
            break
        fit.append(log2)
    return fit


def run_ranks(body, body_args: tuple, world: int, deadline: float, timeout: float,
              on_message: Callable[[str, object], None]) -> bool:
    """Run ``body`` on ``world`` spawned gloo ranks (:func:`rank_process`); False if the run aborted.

    Every ``("row", dict)`` / ``("stop", reason)`` message a rank sends goes to ``on_message(kind, payload)`` as it
    arrives. A rank that fails or dies (the out-of-memory killer) and the hard ``deadline`` abort the run; what each
    unfinished rank was doing is printed to stderr, and the ranks are killed.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_process, args=(r, world, port, q, body, body_args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()

    waiting, done, failed = {r: "process start" for r in range(world)}, set(), False
    while len(done) < world:
        try:
            msg = q.get(timeout=1.0)
        except queue.Empty:
            msg = None
        if msg is None:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
            if dead or time.time() > deadline:
                why = (f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]}; -9 is usually "
                       f"the out-of-memory killer)" if dead else f"hard timeout of {timeout:.0f} s expired")
                print(f"ABORTED: {why}. Was waiting for:", file=sys.stderr)
                for r in range(world):
                    if r not in done:
                        print(f"  rank {r}: {waiting[r]}", file=sys.stderr)
                failed = True
                break
            continue
        kind = msg[0]
        if kind == "stage":
            waiting[msg[1]] = msg[2]
        elif kind in ("row", "stop"):
            on_message(kind, msg[1])
        elif kind == "error":
            print(f"ABORTED: rank {msg[1]} failed:\n{msg[2]}", file=sys.stderr)
            failed = True
            break
        elif kind == "done":
            done.add(msg[1])
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    return not failed


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


RULE = 153


def print_header(world: int) -> None:
    print(f"{'N per rank':>10} | {'radix bytes/rank':>16} | {'all-gather bytes/rank':>21} | "
          f"{'bytes ratio':>11} | {'time ratio':>10} || {'radix ms':>9} {'all-gather ms':>13} "
          f"{'(gather only)':>13} {'thr. ties (kept)':>20} {'peak RSS/rank':>13}")
    print(f"{'':>10} | {'':>16} | {'':>21} | {'radix/a-g':>11} | {'radix/a-g':>10} || "
          f"{'(median over repeats of max over ' + str(world) + ' ranks)':^37}")
    print("-" * RULE)


def print_row(r: dict) -> None:
    ties = f"{r['tied']:,} ({r['tied_kept']:,})"
    print(f"{'2^' + str(r['log2']):>10} | {r['b_radix']:>10,} B ({r['c_radix']}) | "
          f"{r['b_base']:>15,} B ({r['c_base']}) | "
          f"{r['b_radix'] / r['b_base']:>10.2e}x | {r['t_radix'] / r['t_base']:>9.3f}x || "
          f"{1e3 * r['t_radix']:>9.1f} {1e3 * r['t_base']:>13.1f} {1e3 * r['t_gather']:>13.1f} {ties:>20} "
          f"{fmt_bytes(r['rss']):>13}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-log2", type=int, default=24)
    ap.add_argument("--min-log2", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=1500.0)
    args = ap.parse_args()
    world = args.ranks

    print(f"exact distributed top-k, {world} gloo ranks on 127.0.0.1, 1 torch thread each "
          f"({os.cpu_count()} CPU cores here), k = ceil({args.ratio} * {world} * N), {args.repeats} timed repeats")

    # memory: drop sizes that cannot fit before starting anything
    log2s = sizes_that_fit(list(range(args.min_log2, args.max_log2 + 1, 2)), world, estimated_peak)
    if not log2s:
        return 1

    rows = []

    def on_message(kind: str, payload) -> None:
        if kind == "row":
            rows.append(payload)
            print_row(payload)
        else:
            print(f"NOTE: {payload}; stopping at 2^{rows[-1]['log2']}", flush=True)

    deadline = time.time() + args.timeout
    print_header(world)
    if not run_ranks(rank_main, (args, log2s, deadline), world, deadline, args.timeout, on_message):
        return 1

    print("-" * RULE)
    print("bytes: payload one rank hands to all_reduce/all_gather per selection (number of calls); "
          "ratios: radix / all-gather")
    print("gather only: the all-gather baseline's communication alone (its selection over the union is the rest)")
    print("thr. ties: items over all ranks equal to the k-th score (how many of them the selection keeps)")
    print(f"every size: radix mask == all-gather mask on all {world} ranks, exactly k selected by both")
    radix_bytes = sorted({r["b_radix"] for r in rows})
    print(f"target radix bytes independent of N: {'met' if len(radix_bytes) == 1 else 'NOT MET'} "
          f"({' / '.join(f'{b:,} B' for b in radix_bytes)} per rank at every N)")
    last = rows[-1]
    ratio = last["t_radix"] / last["t_base"]
    if last["log2"] >= 24:
        print(f"target time ratio <= 0.2x at 2^24: {'met' if ratio <= 0.2 else 'NOT MET'} ({ratio:.3f}x)")
    else:
        print(f"target time ratio <= 0.2x at 2^24: not evaluated (largest size run: 2^{last['log2']}, "
              f"ratio {ratio:.3f}x there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
