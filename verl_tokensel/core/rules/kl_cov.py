"""KL-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617), exact over its pool.
Pure torch, no verl import.

The top ``max(1, int(ratio * N))`` covariances ``(A - mean A)(log pi - mean log pi)`` of the pool
(:mod:`~verl_tokensel.core.cov`) get ``kl_penalty_coef * |log r|`` added to an unclipped surrogate ``-A r`` that
every token gets (verl 0.9.1's ``compute_policy_loss_kl_cov``, the tokens given instead of chosen inside each
micro-batch). With another score, the same penalty goes to that ranking's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.cov import cov_budget, cov_scores, pooled_count, top_k_pooled
from verl_tokensel.core.errors import check_number, config_error
from verl_tokensel.core.rules.base import LossTransform, Ranking, Rule, knob, register_rule, share
from verl_tokensel.core.rules.checks import check_ranking
from verl_tokensel.core.scores import ScoreInputs, need_advantages, register_score

NAME = "kl_cov"
#: scopes a covariance can pool over (its means need every token of the pool)
COV_SCOPES = ("micro_batch", "micro_batch_dp", "mini_batch", "batch")


@register_score(NAME, needs_entropy=False, needs_omega=False, rule=NAME,
                help="(A_t - mean A)(log pi_t - mean log pi) over the scope's pool; top tokens get KL-Cov's penalty")
def kl_cov_score(inp: ScoreInputs) -> torch.Tensor:
    return cov_scores(need_advantages(inp, NAME), inp.log_prob, inp.response_mask)


def select_kl_cov(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor, ratio: float, *,
                  group: Optional[dist.ProcessGroup] = None,
                  verl_means: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, cov)``: the top :func:`~verl_tokensel.core.cov.cov_budget` covariances of the pool over the ranks
    of ``group`` (``verl_means``: the means as verl's micro-batch function takes them)."""
    cov = cov_scores(advantages, log_prob, pool, group=group, means="flat" if verl_means else None)
    return top_k_pooled(cov, pool, cov_budget(ratio, pooled_count(pool, group)), group), cov


def check_covariance_score(sel, name: str) -> None:
    """The covariance scores' scope, pool and direction (shared by KL-Cov and Clip-Cov)."""
    if sel.scope not in COV_SCOPES:
        raise config_error("token_selection.scope", sel.scope, f"{', '.join(COV_SCOPES)} (with score={name})",
                           f"score={name} centres A and log pi on one pool's means, which needs one pool. Fix: "
                           "set token_selection.scope=mini_batch (exact over the data-parallel ranks, with "
                           "score_source=prepass) or micro_batch (verl's own loss_mode's pool).")
    k = sel.knobs
    if k.pool != "valid" or k.direction != "top":
        key, value = ("pool", k.pool) if k.pool != "valid" else ("direction", k.direction)
        raise config_error(f"token_selection.{key}", value, f"{'valid' if key == 'pool' else 'top'} "
                           f"(with score={name})", f"score={name} follows verl's port: its budget is "
                           "max(1, int(ratio * N)) of the pool's valid tokens, highest first.")


@dataclass(frozen=True)
class KLCovKnobs(Ranking):
    kl_penalty_coef: float = knob(0.1, "Coefficient of |log r| on the selected tokens (verl's "
                                  "policy_loss.ppo_kl_coef).", "0.1 (verl 0.9.1 default); 1 (KL-Cov released scripts)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("token_selection.kl_penalty_coef", self.kl_penalty_coef, 0.0, None, "a number >= 0")


class CovarianceRule(Rule):
    """A rule whose own score (the one named like the rule) is a covariance over the pool, selected by the rule
    itself (:meth:`select_own`, after the pool is known); any other score ranks as the base rule does. KL-Cov's and
    Clip-Cov's shared steps."""

    normalisers = ("all",)
    own_policy_loss = True

    def check(self, sel) -> None:
        check_ranking(sel, self)
        if sel.knobs.score == self.name:
            check_covariance_score(sel, self.name)

    def score(self, sel, batch):
        return None if sel.knobs.score == self.name else super().score(sel, batch)

    def select(self, sel, batch, scores, pool, *, ratio, scope, dp_group):
        if sel.knobs.score != self.name:
            return super().select(sel, batch, scores, pool, ratio=ratio, scope=scope, dp_group=dp_group)
        return self.select_own(sel, batch, pool, ratio=ratio, scope=scope, dp_group=dp_group)

    def select_own(self, sel, batch, pool, *, ratio, scope, dp_group) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mask, cov)`` of the rule's own covariance selection over ``pool``."""
        raise NotImplementedError

    def stats(self, sel, batch, mask, scores, tokens, transform) -> dict[str, float]:
        n_sel, n_pool = int(mask.sum()), int(tokens.sum())
        return {f"{self.name}/selected_tokens": float(n_sel), f"{self.name}/selected_share": share(n_sel, n_pool)}


@register_rule(NAME)
class KLCov(CovarianceRule):
    """The covariance's top tokens (or another score's) get the |log r| penalty; nothing is clipped."""

    Knobs = KLCovKnobs
    legacy = {"action": "kl_penalty", "phases": "one"}

    def select_own(self, sel, batch, pool, *, ratio, scope, dp_group):
        inp = batch.inputs
        return select_kl_cov(inp.advantages, inp.log_prob, pool, ratio, verl_means=scope == "micro_batch",
                             group=None if scope == "micro_batch" else dp_group)

    def transform(self, sel, batch, mask, tokens, ctx) -> LossTransform:
        penalty = torch.where(mask, float(sel.knobs.kl_penalty_coef), 0.0).to(torch.float32)
        return LossTransform(policy_loss="abs_log_ratio_penalty", policy_loss_args={"penalty": penalty})

    def stats(self, sel, batch, mask, scores, tokens, transform) -> dict[str, float]:
        out = super().stats(sel, batch, mask, scores, tokens, transform)
        if mask.any():
            out[f"{NAME}/min_selected_cov"] = float(scores[mask].min())
        return out


__all__ = ["COV_SCOPES", "CovarianceRule", "KLCov", "KLCovKnobs", "check_covariance_score", "kl_cov_score",
           "select_kl_cov"]
