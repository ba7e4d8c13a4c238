"""The covariance of Cui et al. ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617) over any
pooled scope, shared by the two covariance rules (``core/rules/kl_cov.py``, ``core/rules/clip_cov.py``) and by their
scores (``verl-tokensel view --shade``): one computation. Pure torch, no verl import.

A token's covariance is ``cov_t = (A_t - mean A) * (log pi_t - mean log pi)``, the means taken over the pool the
rule selects from. verl 0.9.1 (``compute_policy_loss_kl_cov`` / ``_clip_cov`` in ``core_algos``) takes the pool
inside each micro-batch, so its choice moves with the micro-batch size. Here the pool is the scope's:

- ``micro_batch`` (one rank's micro-batch): verl's own arithmetic, bit for bit (``means="flat"``: a float32 mean
  over the flattened valid values on the host, as verl's KL-Cov; ``means="masked"``: ``masked_mean``, as its
  Clip-Cov);
- a pooled scope (``micro_batch_dp``, ``mini_batch``, ``batch``): the means are float64 sums all-reduced over the
  data-parallel group (three numbers per rank), then the exact distributed top-k of
  :class:`~verl_tokensel.rules.Pool` picks the tokens (:func:`top_k_pooled`): nothing of size N leaves a rank, and
  the tokens are those of one process holding the whole pool, whatever the micro-batch size, DP size or dynamic
  batching.

Budgets follow verl: ``max(1, floor(ratio * N))`` of the pool's N tokens (:func:`cov_budget`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.rules import Needs, Pool, Rule, RuleInput, config_error

#: scopes a covariance rule can pool over (its means need every token of the pool)
COV_SCOPES = ("micro_batch", "micro_batch_dp", "mini_batch", "batch")


def cov_budget(ratio: float, n: int) -> int:
    """Tokens a covariance rule picks from a pool of ``n``: ``max(1, int(n * ratio))`` as verl's port (0 for an
    empty pool). ``int`` truncates: the paper's k% rounded down, never fewer than one."""
    if n <= 0:
        return 0
    return max(1, int(n * ratio))


def pooled_count(pool: torch.Tensor, dp_group: Optional[dist.ProcessGroup]) -> int:
    """Valid tokens of the pool over all ranks of ``dp_group``."""
    return Pool(dp_group).count(pool)


def _pooled_means(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor,
                  dp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of A and log pi over the pool on every rank of ``dp_group``: one all-reduce of three float64 sums."""
    sums = torch.stack([  # summed in float64 without a float64 copy of the inputs
        torch.where(pool, advantages, 0.0).sum(dtype=torch.float64),
        torch.where(pool, log_prob.detach(), 0.0).sum(dtype=torch.float64),
        pool.sum().double(),
    ])
    Pool(dp_group).sum(sums)
    n = sums[2].clamp_min(1.0)
    return (sums[0] / n).float(), (sums[1] / n).float()


#: how the means are taken: pooled float64 sums (None), or as one of verl's two functions does on a micro-batch
COV_MEANS = (None, "flat", "masked")


def cov_scores(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, *,
               dp_group: Optional[dist.ProcessGroup] = None, means: Optional[str] = None) -> torch.Tensor:
    """``(A_t - mean A)(log pi_t - mean log pi)`` per token, float32, 0 off the pool.

    ``means=None``: float64 sums over the pool all-reduced over ``dp_group`` (None: this rank), so one rank holding
    the whole pool and W ranks holding parts of it compute the same scores. ``"flat"`` / ``"masked"`` (the
    ``micro_batch`` scope, one rank): as verl's KL-Cov / Clip-Cov compute them (the two differ), for a selection
    equal to verl's bit for bit.
    """
    if means not in COV_MEANS:
        raise ValueError(f"unknown covariance means {means!r}; valid: {COV_MEANS}")
    adv = advantages.detach().float()
    lp = log_prob.detach().float()
    pool = pool.to(torch.bool)
    if means is None:
        mean_a, mean_lp = _pooled_means(adv, lp, pool, dp_group)
    elif means == "flat":  # verl: all_valid_adv.mean() over the flattened valid values, on the host
        mean_a = adv[pool].cpu().mean().to(adv.device)
        mean_lp = lp[pool].cpu().mean().to(adv.device)
    else:  # verl: verl_F.masked_mean(x, response_mask) = sum(x * mask) / (sum(mask) + 1e-8)
        m = pool.to(adv.dtype)
        mean_a = (adv * m).sum() / (m.sum() + 1e-8)
        mean_lp = (lp * m).sum() / (m.sum() + 1e-8)
    cov = (adv - mean_a) * (lp - mean_lp)
    return cov.masked_fill(~pool, 0.0)


def top_k_pooled(keys: torch.Tensor, pool: torch.Tensor, k: int,
                 dp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The ``k`` highest ``keys`` of the pool over the ranks of ``dp_group`` (ties: lower rank, then position)."""
    return Pool(dp_group).top_k(keys, pool, k)


#: what a covariance rule needs: its own policy loss, every token in the denominator
COVARIANCE = Needs(normalisers=("all",), policy_loss=True)


class CovarianceRule(Rule):
    """A rule whose own score (the one named like the rule) is a covariance over the pool, taken over the scope's
    pool exactly (``means``: how verl's own micro-batch function takes the means, for the ``micro_batch`` scope);
    any other score ranks as the base rule does. KL-Cov's and Clip-Cov's shared steps; register with
    ``needs=COVARIANCE``."""

    #: the means verl's own function takes on a micro-batch (``flat`` KL-Cov, ``masked`` Clip-Cov)
    means = "flat"

    def own(self, x: RuleInput) -> bool:
        return x.knobs.score == self.name

    def check(self, c) -> None:
        if not self.own(c):
            return
        if c.scope not in COV_SCOPES:
            raise config_error("token_selection.scope", c.scope, f"{', '.join(COV_SCOPES)} (with score={self.name})",
                               f"score={self.name} centres A and log pi on one pool's means, which needs one pool. "
                               "Fix: set token_selection.scope=mini_batch (exact over the data-parallel ranks, with "
                               "score_source=prepass) or micro_batch (verl's own loss_mode's pool).")
        k = c.knobs
        if k.pool != "valid" or k.direction != "top":
            key, value = ("pool", k.pool) if k.pool != "valid" else ("direction", k.direction)
            raise config_error(f"token_selection.{key}", value, f"{'valid' if key == 'pool' else 'top'} "
                               f"(with score={self.name})", f"score={self.name} follows verl's port: its budget is "
                               "max(1, int(ratio * N)) of the pool's valid tokens, highest first.")

    def dp_group(self, x: RuleInput) -> Optional[dist.ProcessGroup]:
        return None if x.scope == "micro_batch" else x.dp_group

    def score(self, x: RuleInput) -> Optional[torch.Tensor]:
        if not self.own(x):
            return super().score(x)
        micro = x.scope == "micro_batch"
        return cov_scores(x.weighted_advantages, x.log_prob, x.tokens, dp_group=self.dp_group(x),
                          means=self.means if micro else None)

    def budget(self, x: RuleInput, pool: torch.Tensor) -> int:
        return cov_budget(x.ratio, pooled_count(pool, self.dp_group(x)))

    def stats(self, x: RuleInput) -> dict[str, float]:
        n_sel, n_pool = int(x.mask.sum()), int(x.tokens.sum())
        return {"selected_tokens": float(n_sel), "selected_share": n_sel / n_pool if n_pool else 0.0}


__all__ = ["COVARIANCE", "COV_MEANS", "COV_SCOPES", "CovarianceRule", "cov_budget", "cov_scores", "pooled_count",
           "top_k_pooled"]
