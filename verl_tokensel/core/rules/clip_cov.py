"""Clip-Cov (Cui et al., arXiv 2505.22617), exact over its pool. Pure torch, no verl import.

Of the pool's tokens with ``cov_lb < cov < cov_ub`` that the PPO clip has not clipped, a keyed draw of
``max(1, int(ratio * N))`` (the ``random`` score's draw: the same tokens on every rank, split and rerun; verl draws
with ``torch.randperm``, so the two agree whenever the candidates fit the budget) get no policy loss; the rest keep
verl 0.9.1's ``compute_policy_loss_clip_cov`` (PPO clip without dual clip, ``* corr``). With another score, that
ranking's tokens get no policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.rules.covariance import (
    CovarianceRule,
    cov_budget,
    cov_scores,
    pooled_count,
    top_k_pooled,
)
from verl_tokensel.core.rules.maths import masked_mean
from verl_tokensel.rules import LossTransform, Needs, Ranking, config_error, knob, register_rule, register_score

NAME = "clip_cov"


@register_score(NAME, needs_entropy=False, needs_omega=False, needs_row_keys=True, rule=NAME,
                help="the covariance as kl_cov; a keyed draw of the tokens with lb < cov < ub, not clipped (Clip-Cov)")
def clip_cov_score(inp) -> torch.Tensor:
    return cov_scores(inp.need_advantages(NAME), inp.log_prob, inp.response_mask)


def clipped_by_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                     clip_low: float, clip_high: float) -> torch.Tensor:
    """Tokens the PPO clip already clips (Clip-Cov's ``clip_by_origin``): ``-A clip(r) > -A r``, ``r`` unclamped as
    in verl's ``compute_policy_loss_clip_cov``."""
    ratio = torch.exp(log_prob.detach() - old_log_prob.detach())
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return pg2 > pg1


def candidates(cov: torch.Tensor, clipped: torch.Tensor, pool: torch.Tensor, lb: float, ub: float) -> torch.Tensor:
    """Clip-Cov's candidates: ``lb < cov < ub`` on pool tokens the PPO clip has not clipped."""
    return pool.to(torch.bool) & ~clipped & (cov > lb) & (cov < ub)


def select_clip_cov(advantages: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor, pool: torch.Tensor,
                    ratio: float, draw: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2, lb: float = 1.0,
                    ub: float = 5.0, dp_group: Optional[dist.ProcessGroup] = None,
                    verl_means: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, cov)``: :func:`~verl_tokensel.core.rules.covariance.cov_budget` of the candidates (all of them when
    they fit), those with the highest ``draw`` (a keyed uniform in [0, 1) per token), over the ranks of ``dp_group``."""
    cov = cov_scores(advantages, log_prob, pool, dp_group=dp_group, means="masked" if verl_means else None)
    return clip_cov_draw(cov, advantages, log_prob, old_log_prob, pool, ratio, draw, clip_low=clip_low,
                         clip_high=clip_high, lb=lb, ub=ub, dp_group=dp_group), cov


def clip_cov_draw(cov: torch.Tensor, advantages: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                  pool: torch.Tensor, ratio: float, draw: torch.Tensor, *, clip_low: float, clip_high: float,
                  lb: float, ub: float, dp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The drawn tokens of :func:`select_clip_cov` given the covariance ``cov``."""
    cand = candidates(cov, clipped_by_ratio(log_prob, old_log_prob, advantages, clip_low, clip_high), pool, lb, ub)
    keys = torch.where(cand, draw.float(), torch.full_like(cov, -1.0))  # candidates first
    return top_k_pooled(keys, pool, cov_budget(ratio, pooled_count(pool, dp_group)), dp_group) & cand


def clip_cov_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                          response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                          loss_weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """verl 0.9.1's ``compute_policy_loss_clip_cov`` per token, ``corr`` given (``loss_weight``: 0 on the zeroed
    tokens, 1 elsewhere) instead of drawn inside the micro-batch with ``torch.randperm``: PPO clip without dual clip,
    times ``corr``."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = loss_weight.to(advantages.dtype)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return pg_losses, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item()}


@dataclass(frozen=True)
class ClipCovKnobs(Ranking):
    cov_lb: float = knob(1.0, "Candidates have covariance > cov_lb (verl's policy_loss.clip_cov_lb).", "1 (Clip-Cov)",
                         ge=-float("inf"))
    cov_ub: float = knob(5.0, "Candidates have covariance < cov_ub (verl's policy_loss.clip_cov_ub).", "5 (Clip-Cov)",
                         ge=-float("inf"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.cov_lb < self.cov_ub:
            raise config_error("token_selection.cov_ub", self.cov_ub,
                               f"a number > token_selection.cov_lb={self.cov_lb}")


@register_rule(NAME, knobs=ClipCovKnobs, needs=Needs(scores=("random",), normalisers=("all",), policy_loss=True))
class ClipCov(CovarianceRule):
    """A keyed draw of the covariance's candidates (or another score's top tokens) gets no policy loss."""

    means = "masked"

    def select(self, x):
        if not self.own(x):
            return super().select(x)
        k = x.knobs
        return clip_cov_draw(x.scores, x.weighted_advantages, x.log_prob, x.old_log_prob, x.tokens, x.ratio,
                             x.score("random"), clip_low=x.clip_ratio_low, clip_high=x.clip_ratio_high, lb=k.cov_lb,
                             ub=k.cov_ub, dp_group=self.dp_group(x))

    def transform(self, x) -> LossTransform:
        return LossTransform(token_loss=partial(clip_cov_token_losses, loss_weight=(~x.mask).to(torch.float32)))


__all__ = ["ClipCov", "ClipCovKnobs", "candidates", "clip_cov_draw", "clip_cov_score", "clip_cov_token_losses",
           "clipped_by_ratio", "select_clip_cov"]
