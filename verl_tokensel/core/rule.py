"""The rule step: score, drop non-finite tokens, select over the scope, report. Pure torch.

The loss (each micro-batch), the pre-pass (each rank's mini-batch), the driver (the whole batch) and the analysis
tools all call :func:`apply_rule` on a :class:`~verl_tokensel.core.batch.ScoreBatch`, so a rule means the same
thing wherever it runs. Its result, :class:`Selected`, carries the mask every preset produces and the per-token
outputs a rule may add on top (advantage weights and shifts, clip bounds, KL weights); the loss applies what is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.batch import ScoreBatch
from verl_tokensel.core.config import Selection
from verl_tokensel.core.cov import select_cov
from verl_tokensel.core.scores import SCORE_REGISTRY, grad_mass
from verl_tokensel.core.select import above_quantile, select_tokens, selection_stats


@dataclass
class Selected:
    """What :func:`apply_rule` returns; every tensor is ``(batch, response_len)``.

    Attributes:
        mask: bool, the tokens whose policy gradient the loss keeps (a subset of ``pool``).
        scores: float32 scores the mask was ranked by, NaN on dropped tokens.
        pool: bool, the valid tokens whose loss inputs and score are finite (the loss's token set).
        dropped: whether any valid token was dropped (``pool`` differs from the valid tokens).
        stats: :func:`~verl_tokensel.core.select.selection_stats` of this selection (empty when not asked for).
        advantage_weight / advantage_shift: ``A' = weight * A + shift`` before verl's policy loss (None: as is).
        clip_low / clip_high: per-token PPO clip bounds in place of the config's scalars (None: the config's).
        kl_weight: per-token factor of the KL-loss term (None: 1).
        kl_penalty: per-token coefficient of ``|log r|`` added to an unclipped surrogate (KL-Cov; None: off).
        loss_weight: per-token factor of the policy loss, 0 detaching the token (Clip-Cov; None: 1).
        gate: whether ``mask`` gates the policy gradient (action ``gradient``); False for the other actions,
            whose mask marks the tokens the per-token outputs above treat differently.
    """

    mask: torch.Tensor
    scores: torch.Tensor
    pool: torch.Tensor
    dropped: bool
    stats: dict[str, float] = field(default_factory=dict)
    advantage_weight: Optional[torch.Tensor] = None
    advantage_shift: Optional[torch.Tensor] = None
    clip_low: Optional[torch.Tensor] = None
    clip_high: Optional[torch.Tensor] = None
    kl_weight: Optional[torch.Tensor] = None
    kl_penalty: Optional[torch.Tensor] = None
    loss_weight: Optional[torch.Tensor] = None
    gate: bool = True


def _apply_action(sel: Selection, batch: ScoreBatch, out: Selected) -> None:
    """Fill the per-token outputs of ``sel.action`` from the mask (the same whether the mask was ranked here or
    measured before the update)."""
    if sel.action == "gradient":
        return
    out.gate = False
    mask = out.mask
    if sel.action == "kl_penalty":
        out.kl_penalty = torch.where(mask, float(sel.kl_penalty_coef), 0.0).to(torch.float32)
    elif sel.action == "zero_loss":
        out.loss_weight = (~mask).to(torch.float32)
    elif sel.action == "clip_class":
        inp = batch.inputs
        low = inp.clip_ratio_low if sel.selected_clip_ratio_low is None else sel.selected_clip_ratio_low
        high = inp.clip_ratio_high if sel.selected_clip_ratio_high is None else sel.selected_clip_ratio_high
        # float64: ``1 - bound`` then rounds to float32 as verl's scalar bound does, for every token
        out.clip_low = torch.where(mask, float(low), float(inp.clip_ratio_low)).to(torch.float64)
        out.clip_high = torch.where(mask, float(high), float(inp.clip_ratio_high)).to(torch.float64)
        if sel.selected_kl_weight != 1.0:
            out.kl_weight = torch.where(mask, float(sel.selected_kl_weight), 1.0).to(torch.float32)


#: the metric group of each action's own stats (``tokensel/<group>/...``), named after the rule it comes from
ACTION_METRICS = {"kl_penalty": "kl_cov", "zero_loss": "clip_cov", "clip_class": "archer"}


def action_stats(sel: Selection, out: Selected) -> dict[str, float]:
    """The action's own metrics: how many tokens it treats differently, their share of the pool, and (KL-Cov)
    the smallest covariance it penalised."""
    group = ACTION_METRICS.get(sel.action)
    if group is None:
        return {}
    n_sel, n_pool = int(out.mask.sum()), int(out.pool.sum())
    stats = {f"{group}/selected_tokens": float(n_sel), f"{group}/selected_share": n_sel / n_pool if n_pool else 0.0}
    if sel.action == "kl_penalty" and n_sel:
        stats[f"{group}/min_selected_cov"] = float(out.scores[out.mask].min())
    return stats


def _cov_rule(sel: Selection, batch: ScoreBatch, pool: torch.Tensor, ratio: float, scope: str,
              dp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, scores)`` of a covariance score (KL-Cov, Clip-Cov): pooled over ``dp_group`` for the pooled scopes,
    verl's own arithmetic for ``micro_batch``."""
    inp = batch.inputs
    rule = SCORE_REGISTRY[sel.score].cov_rule
    draw = batch.score("random") if rule == "clip_cov" else None  # the random score's keyed draw
    return select_cov(rule, advantages=inp.advantages, log_prob=inp.log_prob, pool=pool, ratio=ratio,
                      group=None if scope == "micro_batch" else dp_group, verl_means=scope == "micro_batch",
                      old_log_prob=inp.old_log_prob, draw=draw, clip_low=inp.clip_ratio_low,
                      clip_high=inp.clip_ratio_high, lb=sel.cov_lb, ub=sel.cov_ub)


def _select(sel: Selection, batch: ScoreBatch, scores: torch.Tensor, pool: torch.Tensor, ratio: float, scope: str,
            dp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    if sel.budget == "quantile":
        return above_quantile(scores, pool, 1.0 - ratio, per_row=scope == "sequence")
    return select_tokens(scores, pool, ratio, scope=scope, direction=sel.direction, dp_group=dp_group,
                         group_ids=batch.group_ids if scope == "group" else None, pool=sel.pool) & pool


def apply_rule(
    sel: Selection,
    batch: ScoreBatch,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
    measured: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    stats: bool = True,
    ratio: Optional[float] = None,
    scope: Optional[str] = None,
) -> Selected:
    """Apply the rule ``sel`` to ``batch``.

    1. score: ``batch.score(sel.score)``, or the ``(mask, scores)`` pair ``measured`` before the update (the driver's
       or the pre-pass's, read back from the batch: then nothing is re-ranked);
    2. drop every valid token whose loss inputs (``batch.finite``) or score are not finite: out of the pool, never
       selected, its score NaN (counted in ``nan_scores``);
    3. select: :func:`~verl_tokensel.core.select.select_tokens` over ``sel.scope`` (exact over ``dp_group`` for the
       pooled scopes, per ``batch.group_ids`` for ``group``);
    4. stats (one host synchronisation), unless ``stats=False``.

    ``ratio`` / ``scope`` replace the rule's own for this call (the analysis tools rank one tensor as one pool).
    """
    ratio = sel.ratio if ratio is None else ratio
    scope = sel.scope if scope is None else scope
    cov = SCORE_REGISTRY[sel.score].cov_rule is not None and measured is None
    if measured is not None:
        scores = measured[1].float()
    elif not cov:  # the covariance needs the pool's means: scored below, once the non-finite tokens left the pool
        scores = batch.score(sel.score)
    finite = batch.finite if cov else batch.finite & ~torch.isnan(scores)
    pool = batch.valid & finite
    dropped = bool((batch.valid & ~finite).any())
    if measured is not None:
        mask = measured[0].to(torch.bool) & pool
    elif cov:
        mask, scores = _cov_rule(sel, batch, pool, ratio, scope, dp_group)
    else:
        mask = _select(sel, batch, scores, pool, ratio, scope, dp_group)
    if dropped:
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
    out = Selected(mask=mask, scores=scores, pool=pool, dropped=dropped)
    _apply_action(sel, batch, out)
    if stats:
        entropy = batch.inputs.entropy
        if entropy is not None and dropped:
            entropy = torch.where(finite, entropy, 0.0)
        out.stats = selection_stats(mask, batch.valid, scores, entropy=entropy,
                                    grad_mass=grad_mass(sel.score, scores, batch.inputs))
        out.stats.update(action_stats(sel, out))
    return out


__all__ = ["ACTION_METRICS", "Selected", "action_stats", "apply_rule"]
