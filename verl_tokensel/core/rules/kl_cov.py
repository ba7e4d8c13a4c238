"""KL-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617), exact over its pool.
Pure torch, no verl import.

The top ``max(1, int(ratio * N))`` covariances ``(A - mean A)(log pi - mean log pi)`` of the pool
(:mod:`~verl_tokensel.core.rules.covariance`) get ``kl_penalty_coef * |log r|`` added to an unclipped surrogate
``-A r`` that every token gets (verl 0.9.1's ``compute_policy_loss_kl_cov``, the tokens given instead of chosen
inside each micro-batch). With another score, the same penalty goes to that ranking's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.rules.covariance import (
    COVARIANCE,
    CovarianceRule,
    cov_budget,
    cov_scores,
    pooled_count,
    top_k_pooled,
)
from verl_tokensel.core.rules.maths import masked_mean
from verl_tokensel.rules import LossTransform, Ranking, knob, register_rule, register_score

NAME = "kl_cov"


@register_score(NAME, needs_entropy=False, needs_omega=False, rule=NAME,
                help="(A_t - mean A)(log pi_t - mean log pi) over the scope's pool; top tokens get KL-Cov's penalty")
def kl_cov_score(inp) -> torch.Tensor:
    return cov_scores(inp.need_advantages(NAME), inp.log_prob, inp.response_mask)


def select_kl_cov(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, ratio: float, *,
                  dp_group: Optional[dist.ProcessGroup] = None,
                  verl_means: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, cov)``: the top :func:`~verl_tokensel.core.rules.covariance.cov_budget` covariances of the pool over
    the ranks of ``dp_group`` (``verl_means``: the means as verl's micro-batch function takes them)."""
    cov = cov_scores(advantages, log_prob, pool, dp_group=dp_group, means="flat" if verl_means else None)
    return top_k_pooled(cov, pool, cov_budget(ratio, pooled_count(pool, dp_group)), dp_group), cov


def kl_cov_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                        penalty: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """verl 0.9.1's ``compute_policy_loss_kl_cov`` per token, the penalised tokens given (``penalty``: the
    coefficient on them, 0 elsewhere) instead of chosen inside the micro-batch: an unclipped ``-A r`` for every
    token, ``+ coef * |log r|`` on the penalised ones; no clip bound is read."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + penalty * abs_kl
    pg_losses = torch.where(penalty != 0, pg_losses_kl, pg_losses1)
    return pg_losses, {"actor/ppo_kl": ppo_kl_abs.detach().item()}


@dataclass(frozen=True)
class KLCovKnobs(Ranking):
    kl_penalty_coef: float = knob(0.1, "Coefficient of |log r| on the selected tokens (verl's "
                                  "policy_loss.ppo_kl_coef).", "0.1 (verl 0.9.1 default); 1 (KL-Cov released scripts)",
                                  ge=0)


@register_rule(NAME, knobs=KLCovKnobs, needs=COVARIANCE)
class KLCov(CovarianceRule):
    """The covariance's top tokens (or another score's) get the |log r| penalty; nothing is clipped."""

    means = "flat"

    def select(self, x):
        if not self.own(x):
            return super().select(x)
        return top_k_pooled(x.scores, x.tokens, self.budget(x, x.tokens), self.dp_group(x))

    def transform(self, x) -> LossTransform:
        penalty = torch.where(x.mask, float(x.knobs.kl_penalty_coef), 0.0).to(torch.float32)
        return LossTransform(token_loss=partial(kl_cov_token_losses, penalty=penalty))

    def stats(self, x) -> dict[str, float]:
        out = super().stats(x)
        if x.mask.any():
            out["min_selected_cov"] = float(x.scores[x.mask].min())
        return out


__all__ = ["KLCov", "KLCovKnobs", "kl_cov_score", "kl_cov_token_losses", "select_kl_cov"]
