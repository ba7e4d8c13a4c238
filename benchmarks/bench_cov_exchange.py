"""Global KL-Cov selection across data-parallel ranks: this project's exchange vs an all-gather of every token.

Run (from the repository root; 15 minutes at the default grid on a shared 2-core machine, where 2^24 x 8 ranks
does not fit in memory and is skipped)::

    python benchmarks/bench_cov_exchange.py [--max-log2 24] [--ranks 2,4,8]

Other options: ``--min-log2 16``, ``--ratios 2e-4,0.002`` (``kl_cov_ratio``; verl's default first),
``--repeats 5`` (timed calls per method, size and ratio), ``--timeout 1800`` (hard limit in seconds for the
whole run, shared out over the rank counts; the ranks are killed when it expires).

KL-Cov (Cui et al., arXiv 2505.22617) ranks every valid token of the pool by
``cov_t = (A_t - mean A)(log pi_t - mean log pi)`` and penalises the top ``max(1, int(ratio * N))``. With the
pool = the optimizer mini-batch over ALL data-parallel ranks, each rank holds a slice of the pool and must learn
which of its tokens are in the global top-k. For W gloo ranks (spawned on 127.0.0.1, 1 torch thread each) and
N = 2^16, 2^18, ... valid tokens per rank, every rank computes its mask twice:

(a) this project: :func:`verl_tokensel.core.rules.kl_cov.select_kl_cov` (the preset's own path):
    :func:`~verl_tokensel.core.rules.covariance.cov_scores` with the group's pooled means (one all-reduce of three
    float64 sums), :func:`~verl_tokensel.core.rules.covariance.pooled_count` for N_total, then
    :func:`verl_tokensel.core.ranking.dist_topk.topk_mask_distributed` with k = ``cov_budget(ratio, N_total)``
    (radix select over all-reduced 256-bin histograms; nothing of size N leaves the rank);
(b) the design of verl's open PR #7830: every rank's valid advantages and log-probs, float32 each, padded to the
    largest rank, go to every rank (two tensor all-gathers after one of the counts: the cheapest form of that
    exchange); each rank computes the covariance over the gathered union, runs ``torch.topk`` and keeps its
    own slice. Threshold ties, whose order ``torch.topk`` leaves unspecified, go to the earliest tokens of the
    rank-ordered union (one comparison pass), the order (a) promises.

Same means on both sides: (b) takes mean A and mean log pi as float64 sums over the gathered union, divided by
N_total and rounded to float32, the arithmetic of (a) (PR #7830 computes its own means; its exact mean
arithmetic is not what is measured). The covariances are then the same float32 numbers and the benchmark compares
the exchange and the selection. Both designs need every token's current log-prob before the mini-batch's first
loss (a no-grad pass per mini-batch); that pass is the same on both sides and not part of this benchmark.

Inputs, as a GRPO mini-batch looks to one rank: responses of 512-4096 tokens (uniform; the last one cut so the
rank holds exactly N valid tokens) right-padded to 4096 in a ``(responses, 4096)`` batch; advantages constant
per response, from binary rewards normalised in groups of 8 responses ((r - mean) / (std + 1e-6), verl's GRPO
outcome advantage: a few distinct values around +-1, 0 for groups whose 8 rewards agree); log-probs like a
sampled policy's: 80% near 0 (-Exp with mean 0.01), 18% -Exp(0.7), 2% -Exp(4), clamped at -30.

Checked at every (W, N, ratio): the two masks are identical on every rank, and each selects exactly k tokens;
the run stops with an error otherwise. Bytes, time and the guards for sizes that do not fit (memory estimated
before starting, time extrapolated from the previous size) are those of ``bench_dist_topk.py``, whose machinery
this script imports: bytes = payload a rank hands to ``all_reduce`` / ``all_gather`` in one selection; time =
the slowest rank's, median over the repeats, the methods interleaved; ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench_dist_topk import (CollectiveBytes, all_reduce_scalar, fmt_bytes, run_ranks, sizes_that_fit,
                             time_budget_exceeded, timed_max_over_ranks)
from verl_tokensel.core.rules.covariance import cov_budget, cov_scores, pooled_count
from verl_tokensel.core.rules.kl_cov import select_kl_cov

MIN_LEN, MAX_LEN = 512, 4096  # response lengths, tokens
GROUP = 8  # responses per prompt (GRPO's rollout.n)

# Peak resident memory of one rank: ~100 B per local valid token (the padded (responses, 4096) inputs at ~1.8
# elements per valid token, the float64 sums' and the covariance's temporaries over them) and ~40 B per element of
# the union (W * N) in the all-gather baseline (the gathered parts and their concatenation, float32 x 2, a float64
# copy for the sums, the covariance and its two temporaries). On the safe side: the RSS column measured 1.7 GiB per
# rank at 2^24 x 2 ranks, 2.3 GiB at 2^24 x 4 and 1.4 GiB at 2^22 x 8 where this estimates 3.1, 4.3 and 1.9 GiB.
LOCAL_BYTES_PER_TOKEN = 100
UNION_BYTES_PER_ELEMENT = 40
RANK_BASE_BYTES = 300 << 20  # python + torch + gloo per process


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
def make_batch(n: int, rank: int, log2: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(responses, 4096)`` advantages, log-probs (float32) and valid mask of one rank, ``n`` valid tokens."""
    g = torch.Generator().manual_seed(1000 * log2 + rank)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n // MIN_LEN + 1,), generator=g)
    ends = torch.cumsum(lengths, 0)
    rows = int((ends < n).sum()) + 1
    lengths = lengths[:rows].clone()
    lengths[-1] = n - (int(ends[rows - 2]) if rows > 1 else 0)
    pool = torch.arange(MAX_LEN).unsqueeze(0) < lengths.unsqueeze(1)

    gid = torch.arange(rows) // GROUP
    n_groups = int(gid[-1]) + 1
    reward = (torch.rand(rows, generator=g) < torch.rand(n_groups, generator=g)[gid]).float()
    count = torch.bincount(gid, minlength=n_groups).float()
    mean = torch.zeros(n_groups).index_add_(0, gid, reward) / count
    var = torch.zeros(n_groups).index_add_(0, gid, (reward - mean[gid]) ** 2) / (count - 1).clamp(min=1)
    adv = torch.where(count[gid] > 1, (reward - mean[gid]) / (var.sqrt()[gid] + 1e-6), reward)
    advantages = adv.unsqueeze(1) * pool

    u = torch.rand(pool.shape, generator=g)
    scale = torch.where(u < 0.8, 0.01, torch.where(u < 0.98, 0.7, 4.0))
    expo = -torch.log(torch.rand(pool.shape, generator=g).clamp(min=1e-12))
    log_prob = (-(expo * scale)).clamp(min=-30.0) * pool
    return advantages, log_prob, pool


# --------------------------------------------------------------------------------------------
# the two selections being compared
# --------------------------------------------------------------------------------------------
def project_mask(adv: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, ratio: float) -> torch.Tensor:
    """This project: pooled means by one all-reduce, exact distributed top-k; nothing of size N leaves the rank."""
    return select_kl_cov(adv, log_prob, pool, ratio, dp_group=dist.group.WORLD)[0]


def gather_valid(adv: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor):
    """Every rank's valid advantages and log-probs, rank-ordered; where ours start and how many we hold."""
    world, rank = dist.get_world_size(), dist.get_rank()
    a, lp = adv[pool].float(), log_prob[pool].float()
    n = torch.tensor([a.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    union = []
    for local in (a, lp):
        padded = local.new_zeros(max(sizes))
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        union.append(torch.cat([p[:s] for p, s in zip(parts, sizes)]))
        del parts
    return union[0], union[1], sum(sizes[:rank]), a.numel()


def allgather_mask(adv: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, ratio: float) -> torch.Tensor:
    """The all-gather design: gather every valid token, covariance and top-k over the union, keep our slice."""
    ua, ulp, start, n_local = gather_valid(adv, log_prob, pool)
    total = ua.numel()
    n = torch.tensor(float(max(total, 1)), dtype=torch.float64)
    mean_a, mean_lp = (ua.double().sum() / n).float(), (ulp.double().sum() / n).float()
    cov = (ua - mean_a) * (ulp - mean_lp)
    del ua, ulp
    k = cov_budget(ratio, total)
    kth = torch.topk(cov, k, sorted=False).values.min()
    keep = cov > kth
    ties = cov == kth
    need = k - int(keep.sum())
    if need < int(ties.sum()):  # torch.topk's tie order is unspecified: the earliest tokens of the union
        ties &= torch.cumsum(ties, 0) <= need
    mask = torch.zeros_like(pool)
    mask[pool] = (keep | ties)[start : start + n_local]
    return mask


# --------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------
def check_masks(ours: torch.Tensor, base: torch.Tensor, cov: torch.Tensor, pool: torch.Tensor, k: int) -> dict:
    """Identical masks on every rank, exactly k selected by each; threshold tie statistics over the valid tokens."""
    cov = cov.masked_fill(~pool, -math.inf)
    equal = all_reduce_scalar(float(torch.equal(ours, base)), dist.ReduceOp.MIN) == 1.0
    n_ours = all_reduce_scalar(float(ours.sum()), dist.ReduceOp.SUM)
    n_base = all_reduce_scalar(float(base.sum()), dist.ReduceOp.SUM)
    kth = all_reduce_scalar(float(cov[base].min()) if bool(base.any()) else float("inf"), dist.ReduceOp.MIN)
    tied = all_reduce_scalar(float((cov == kth).sum()), dist.ReduceOp.SUM)
    tied_kept = all_reduce_scalar(float(((cov == kth) & base).sum()), dist.ReduceOp.SUM)
    ok = equal and n_ours == k and n_base == k
    return dict(ok=ok, equal=equal, n_ours=int(n_ours), n_base=int(n_base), tied=int(tied),
                tied_kept=int(tied_kept))


def rank_main(rank: int, world: int, q, stage, args, log2s: list[int], deadline: float) -> None:
    counter = CollectiveBytes()
    previous_s = prev_log2 = None  # seconds the previous size took (checks and every timed call)
    for log2 in log2s:
        late = time_budget_exceeded(previous_s, prev_log2, log2, deadline, "this rank count's share of --timeout")
        if late is not None:
            if rank == 0:
                q.put(("stop", late))
            break
        t_size = time.perf_counter()
        adv, log_prob, pool = make_batch(1 << log2, rank, log2)
        cov = cov_scores(adv, log_prob, pool, dp_group=dist.group.WORLD)  # for the tie statistics
        n_total = pooled_count(pool, dist.group.WORLD)

        t_gather = []
        for i in range(args.repeats):
            stage(f"2^{log2}: timed repeat {i + 1}/{args.repeats}, gather only")
            t_gather.append(timed_max_over_ranks(lambda: gather_valid(adv, log_prob, pool)))
        for ratio in args.ratios:
            k = cov_budget(ratio, n_total)
            # untimed first call of each: the masks to check and the bytes (identical every call)
            stage(f"2^{log2}, ratio {ratio}: this project, first call")
            m_ours, b_ours, c_ours = counter.measure(lambda: project_mask(adv, log_prob, pool, ratio))
            stage(f"2^{log2}, ratio {ratio}: all-gather, first call")
            m_base, b_base, c_base = counter.measure(lambda: allgather_mask(adv, log_prob, pool, ratio))
            stage(f"2^{log2}, ratio {ratio}: checking masks")
            check = check_masks(m_ours, m_base, cov, pool, k)
            del m_ours, m_base
            if not check["ok"]:
                raise AssertionError(f"W={world}, 2^{log2}, ratio {ratio}: the selections differ or select other "
                                     f"than k={k} tokens: {check}")
            b_ours = all_reduce_scalar(b_ours, dist.ReduceOp.MAX)
            b_base = all_reduce_scalar(b_base, dist.ReduceOp.MAX)
            t_ours, t_base = [], []
            for i in range(args.repeats):
                stage(f"2^{log2}, ratio {ratio}: timed repeat {i + 1}/{args.repeats}, this project")
                t_ours.append(timed_max_over_ranks(lambda: project_mask(adv, log_prob, pool, ratio)))
                stage(f"2^{log2}, ratio {ratio}: timed repeat {i + 1}/{args.repeats}, all-gather")
                t_base.append(timed_max_over_ranks(lambda: allgather_mask(adv, log_prob, pool, ratio)))
            rss = all_reduce_scalar(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, dist.ReduceOp.MAX)
            if rank == 0:
                q.put(("row", dict(world=world, log2=log2, ratio=ratio, k=k, b_ours=int(b_ours), c_ours=c_ours,
                                   b_base=int(b_base), c_base=c_base, t_ours=statistics.median(t_ours),
                                   t_base=statistics.median(t_base), t_gather=statistics.median(t_gather),
                                   rss=rss, **check)))
        adv = log_prob = pool = cov = None  # free this size before the next
        previous_s, prev_log2 = all_reduce_scalar(time.perf_counter() - t_size, dist.ReduceOp.MAX), log2


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
def estimated_peak(n: int, world: int) -> int:
    """Bytes for all ranks together at N valid tokens per rank."""
    return world * (RANK_BASE_BYTES + LOCAL_BYTES_PER_TOKEN * n + UNION_BYTES_PER_ELEMENT * world * n)


RULE = 178


def print_header() -> None:
    print(f"{'W':>2} {'N/rank':>6} {'ratio':>6} {'k':>7} | {'ours bytes/rank':>15} | {'all-gather bytes/rank':>21} | "
          f"{'bytes ratio':>11} | {'time ratio':>10} || {'ours ms':>8} {'all-gather ms':>13} {'(gather only)':>13} "
          f"{'identical':>9} {'thr. ties (kept)':>16} {'peak RSS/rank':>13}")
    print(f"{'':>24} | {'':>15} | {'':>21} | {'ours/a-g':>11} | {'ours/a-g':>10} || "
          f"{'(median of repeats, max over ranks)':^37}")
    print("-" * RULE)


def print_row(r: dict) -> None:
    ties = f"{r['tied']:,} ({r['tied_kept']:,})"
    print(f"{r['world']:>2} {'2^' + str(r['log2']):>6} {r['ratio']:>6g} {r['k']:>7,} | "
          f"{r['b_ours']:>9,} B ({r['c_ours']}) | {r['b_base']:>15,} B ({r['c_base']}) | "
          f"{r['b_ours'] / r['b_base']:>10.2e}x | {r['t_ours'] / r['t_base']:>9.3f}x || "
          f"{1e3 * r['t_ours']:>8.1f} {1e3 * r['t_base']:>13.1f} {1e3 * r['t_gather']:>13.1f} "
          f"{'yes' if r['equal'] else 'NO':>9} {ties:>16} {fmt_bytes(r['rss']):>13}", flush=True)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-log2", type=int, default=24)
    ap.add_argument("--min-log2", type=int, default=16)
    ap.add_argument("--ranks", type=ints, default=[2, 4, 8], help="comma-separated rank counts (default 2,4,8)")
    ap.add_argument("--ratios", type=floats, default=[2e-4, 0.002], help="comma-separated kl_cov_ratio values")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    if any(w < 2 for w in args.ranks):
        ap.error(f"--ranks {args.ranks}: each rank count must be at least 2 (a data-parallel exchange needs two "
                 f"ranks); e.g. --ranks 2,4,8")

    print(f"global KL-Cov selection, this project (pooled means + radix top-k) vs all-gather of every valid token "
          f"(verl PR #7830's design); W gloo ranks on 127.0.0.1, 1 torch thread each ({os.cpu_count()} CPU cores "
          f"here), k = max(1, int(ratio * W * N)), {args.repeats} timed repeats, torch {torch.__version__}")
    deadline = time.time() + args.timeout
    rows, skipped = [], []

    def on_message(kind: str, payload) -> None:
        if kind == "row":
            rows.append(payload)
            print_row(payload)
        else:
            skipped.append(f"W={world}: {payload}")
            print(f"NOTE: W={world}: {payload}; stopping at 2^{rows[-1]['log2']}", flush=True)

    print_header()
    for i, world in enumerate(args.ranks):
        log2s = list(range(args.min_log2, args.max_log2 + 1, 2))
        fit = sizes_that_fit(log2s, world, estimated_peak)
        if len(fit) < len(log2s):
            skipped.append(f"W={world}: 2^{log2s[len(fit)]} and above, memory")
        if not fit:
            continue
        # the time left is shared out over the rank counts still to run (what one leaves, the next may use)
        share = time.time() + (deadline - time.time()) / (len(args.ranks) - i)
        if not run_ranks(rank_main, (args, fit, share), world, deadline, args.timeout, on_message):
            return 1
    if not rows:
        print("nothing ran: every size was skipped", file=sys.stderr)
        return 1

    print("-" * RULE)
    print("bytes: payload one rank hands to all_reduce/all_gather per selection (number of calls); ratios: ours / "
          "all-gather")
    print("means: both sides take mean A and mean log pi as float64 sums over all ranks' valid tokens (ours: "
          "all-reduced, 24 B; the all-gather: over the gathered union); compared: the exchange and the selection, "
          "not the mean arithmetic")
    print("gather only: the all-gather's communication alone (counts + advantages + log-probs; the rest of its time "
          "is the covariance and the top-k over the union, repeated on every rank)")
    print("thr. ties: valid tokens over all ranks whose covariance equals the k-th (how many of them are kept)")
    print(f"identical selections: yes, all {len(rows)} (W, N, ratio) runs, every rank: this project's mask == the "
          f"all-gather's, k tokens selected by both")
    for world in sorted({r["world"] for r in rows}):
        ours = sorted({r["b_ours"] for r in rows if r["world"] == world})
        print(f"W={world}: our bytes per rank independent of N: {'yes' if len(ours) == 1 else 'NO'} "
              f"({' / '.join(f'{b:,} B' for b in ours)}); the all-gather's: 8 B + 8 B per valid token of the "
              f"largest rank")
    for s in skipped:
        print(f"not run: {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
