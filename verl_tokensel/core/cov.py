"""The covariance rules of Cui et al. ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617) over
any pooled scope: KL-Cov and Clip-Cov. Pure torch, no verl import.

Both rank a token by ``cov_t = (A_t - mean A) * (log pi_t - mean log pi)``, the means taken over the pool the
rule selects from. verl 0.9.1 (``compute_policy_loss_kl_cov`` / ``_clip_cov`` in ``core_algos``) takes the pool
inside each micro-batch, so its choice moves with the micro-batch size. Here the pool is the scope's:

- ``micro_batch`` (one rank's micro-batch): verl's own arithmetic, bit for bit (the means as verl computes them:
  KL-Cov a float32 mean over the flattened valid values on the host, Clip-Cov ``masked_mean``);
- a pooled scope (``micro_batch_dp``, ``mini_batch``, ``batch``): the means are float64 sums all-reduced over the
  data-parallel group (three numbers per rank), then the exact distributed top-k of
  :mod:`~verl_tokensel.core.dist_topk` picks the tokens: nothing of size N leaves a rank, and the tokens are
  those of one process holding the whole pool, whatever the micro-batch size, DP size or dynamic batching.

:func:`select_cov` is the whole selection; the rule step (:func:`~verl_tokensel.core.rule.apply_rule`) calls it
for the ``kl_cov`` and ``clip_cov`` scores.

Budgets follow verl: ``max(1, floor(ratio * N))`` of the pool's N tokens (:func:`cov_budget`). KL-Cov keeps the
top-``k`` covariances; Clip-Cov draws ``k`` of its candidates (``lb < cov < ub``, not already clipped by the PPO
clip) with the keyed draw of the ``random`` score (the same tokens on every rank, split and rerun; verl draws
with ``torch.randperm``, so the two agree whenever the candidates fit the budget).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.dist_topk import topk_mask_distributed
from verl_tokensel.core.pools import world_size
from verl_tokensel.core.select import keep_first_k

#: scopes a covariance rule can pool over (its means need every token of the pool)
COV_SCOPES = ("micro_batch", "micro_batch_dp", "mini_batch", "batch")


def cov_budget(ratio: float, n: int) -> int:
    """Tokens a covariance rule picks from a pool of ``n``: ``max(1, int(n * ratio))`` as verl's port (0 for an
    empty pool). ``int`` truncates: the paper's k% rounded down, never fewer than one."""
    if n <= 0:
        return 0
    return max(1, int(n * ratio))


def _pooled(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and world_size(group) > 1


def pooled_count(pool: torch.Tensor, group: Optional[dist.ProcessGroup]) -> int:
    """Valid tokens of the pool over all ranks of ``group``."""
    n = pool.sum().to(torch.int64).reshape(1)
    if _pooled(group):
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return int(n.item())


def _pooled_means(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor,
                  group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of A and log pi over the pool on every rank of ``group``: one all-reduce of three float64 sums."""
    sums = torch.stack([  # summed in float64 without a float64 copy of the inputs
        torch.where(pool, advantages, 0.0).sum(dtype=torch.float64),
        torch.where(pool, log_prob.detach(), 0.0).sum(dtype=torch.float64),
        pool.sum().double(),
    ])
    if _pooled(group):
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    n = sums[2].clamp_min(1.0)
    return (sums[0] / n).float(), (sums[1] / n).float()


def cov_scores(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, *, rule: str,
               group: Optional[dist.ProcessGroup] = None, verl_means: bool = False) -> torch.Tensor:
    """``(A_t - mean A)(log pi_t - mean log pi)`` per token, float32, 0 off the pool.

    The means are float64 sums over the pool all-reduced over ``group`` (None: this rank), so one rank holding
    the whole pool and W ranks holding parts of it compute the same scores. ``verl_means=True`` (the
    ``micro_batch`` scope, one rank) computes them as verl's ``rule`` does instead (``kl_cov`` or ``clip_cov``:
    the two verl functions differ), for a selection equal to verl's bit for bit.
    """
    if rule not in ("kl_cov", "clip_cov"):
        raise ValueError(f"unknown covariance rule {rule!r}; valid: kl_cov, clip_cov")
    adv = advantages.detach().float()
    lp = log_prob.detach().float()
    pool = pool.to(torch.bool)
    if not verl_means:
        mean_a, mean_lp = _pooled_means(adv, lp, pool, group)
    elif rule == "kl_cov":  # verl: all_valid_adv.mean() over the flattened valid values, on the host
        mean_a = adv[pool].cpu().mean().to(adv.device)
        mean_lp = lp[pool].cpu().mean().to(adv.device)
    elif rule == "clip_cov":  # verl: verl_F.masked_mean(x, response_mask) = sum(x * mask) / (sum(mask) + 1e-8)
        m = pool.to(adv.dtype)
        mean_a = (adv * m).sum() / (m.sum() + 1e-8)
        mean_lp = (lp * m).sum() / (m.sum() + 1e-8)
    cov = (adv - mean_a) * (lp - mean_lp)
    return cov.masked_fill(~pool, 0.0)


def clipped_by_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                     clip_low: float, clip_high: float) -> torch.Tensor:
    """Tokens the PPO clip already clips (Clip-Cov's ``clip_by_origin``): ``-A clip(r) > -A r``, ``r`` unclamped as
    in verl's ``compute_policy_loss_clip_cov``."""
    ratio = torch.exp(log_prob.detach() - old_log_prob.detach())
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return pg2 > pg1


def clip_cov_candidates(cov: torch.Tensor, clipped: torch.Tensor, pool: torch.Tensor, lb: float,
                        ub: float) -> torch.Tensor:
    """Clip-Cov's candidates: ``lb < cov < ub`` on pool tokens the PPO clip has not clipped."""
    return pool.to(torch.bool) & ~clipped & (cov > lb) & (cov < ub)


def _top_k(keys: torch.Tensor, pool: torch.Tensor, k: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The ``k`` highest ``keys`` of the pool over the ranks of ``group`` (ties: lower rank, then position)."""
    if not _pooled(group):
        return keep_first_k(keys, pool, k, "top")
    mask = torch.zeros_like(pool)
    mask[pool] = topk_mask_distributed(keys[pool], k, group, largest=True)
    return mask


def select_cov(rule: str, *, advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, ratio: float,
               group: Optional[dist.ProcessGroup] = None, verl_means: bool = False,
               old_log_prob: Optional[torch.Tensor] = None, draw: Optional[torch.Tensor] = None,
               clip_low: float = 0.2, clip_high: float = 0.2, lb: float = 1.0,
               ub: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, cov)``: the tokens KL-Cov penalises (``rule="kl_cov"``: the top :func:`cov_budget` covariances of
    the pool) or Clip-Cov detaches (``"clip_cov"``: :func:`cov_budget` of its candidates, those with the highest
    ``draw``, a keyed uniform per token; all of them when they fit), over the ranks of ``group``."""
    pool = pool.to(torch.bool)
    cov = cov_scores(advantages, log_prob, pool, rule=rule, group=group, verl_means=verl_means)
    k = cov_budget(ratio, pooled_count(pool, group))
    if rule == "kl_cov":
        return _top_k(cov, pool, k, group), cov
    if old_log_prob is None or draw is None:
        raise ValueError("the clip_cov rule needs old_log_prob (its clipped tokens) and draw (its keyed uniform)")
    cand = clip_cov_candidates(cov, clipped_by_ratio(log_prob, old_log_prob, advantages, clip_low, clip_high),
                               pool, lb, ub)
    keys = torch.where(cand, draw.float(), torch.full_like(cov, -1.0))  # draws are in [0, 1): candidates first
    return _top_k(keys, pool, k, group) & cand, cov


__all__ = ["COV_SCOPES", "clip_cov_candidates", "clipped_by_ratio", "cov_budget", "cov_scores", "pooled_count",
           "select_cov"]
