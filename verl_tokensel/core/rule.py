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
from verl_tokensel.core.shaping import ar_weight, lopti_active, lopti_low, shaped_advantages
from verl_tokensel.core.stapo import spurious_tokens


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
        entropy_weight: per-token factor of the entropy bonus (a Lopti pass's other tokens: 0; None: 1).
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
    entropy_weight: Optional[torch.Tensor] = None
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


def _shaping(sel: Selection, batch: ScoreBatch, pool: torch.Tensor) -> tuple[Optional[torch.Tensor],
                                                                            Optional[torch.Tensor]]:
    """``(weight, shift)`` of the rule's advantage shaping (None where it leaves A as is); off ``pool`` (padding,
    dropped tokens) A stays as is, so a NaN entropy there never reaches a masked sum."""
    if sel.shaping == "none":
        return None, None
    adv = batch.advantages if batch.advantages is not None else torch.zeros_like(batch.inputs.log_prob)
    weight, shift = shaped_advantages(
        sel.shaping, adv, old_log_prob=batch.inputs.old_log_prob, entropy=batch.inputs.entropy,
        alpha=sel.ar_alpha if sel.shaping == "ar" else sel.entropy_alpha, kappa=sel.entropy_kappa)
    return (None if weight is None else torch.where(pool, weight, 1.0),
            None if shift is None else torch.where(pool, shift, 0.0))


def _apply_shaping(sel: Selection, batch: ScoreBatch, out: Selected, phase: Optional[int]) -> None:
    """The advantage shaping's weight / shift and, in a Lopti pass, the other tokens' advantages, KL and entropy
    terms zeroed (they stay in the denominators)."""
    out.advantage_weight, out.advantage_shift = _shaping(sel, batch, out.pool)
    if sel.phases == "lopti" and phase is not None:
        active = lopti_active(batch.inputs.old_log_prob, sel.lopti_eta, phase).to(torch.float32)
        out.advantage_weight = active if out.advantage_weight is None else out.advantage_weight * active
        if out.advantage_shift is not None:
            out.advantage_shift = out.advantage_shift * active
        out.kl_weight = active if out.kl_weight is None else out.kl_weight * active
        out.entropy_weight = active


def _shape_score_inputs(sel: Selection, batch: ScoreBatch) -> None:
    """A score that reads the advantage (omega) ranks by the shaped one: shaping comes first."""
    if sel.shaping == "none" or batch.advantages is None or not SCORE_REGISTRY[sel.score].needs_omega:
        return
    weight, shift = _shaping(sel, batch, batch.valid)
    adv = batch.advantages.float()
    adv = adv * weight if weight is not None else adv
    adv = adv + shift if shift is not None else adv
    batch.inputs.advantages = adv * batch.is_weights.float() if batch.is_weights is not None else adv
    batch.inputs.omega_cache = None


#: the metric group of each action's own stats (``tokensel/<group>/...``), named after the rule it comes from
ACTION_METRICS = {"kl_penalty": "kl_cov", "zero_loss": "clip_cov", "clip_class": "archer"}


def action_stats(sel: Selection, out: Selected, batch: Optional[ScoreBatch] = None) -> dict[str, float]:
    """The rule's own metrics under ``<rule>/``: how many tokens its action treats differently and their share of
    the pool (KL-Cov also the smallest covariance it penalised), STAPO's spurious tokens, the shaping's mean
    factor / shift, a Lopti pass's number and token shares."""
    stats: dict[str, float] = {}
    n_pool = int(out.pool.sum())
    group = ACTION_METRICS.get(sel.action)
    if group is not None:
        n_sel = int(out.mask.sum())
        stats = {f"{group}/selected_tokens": float(n_sel),
                 f"{group}/selected_share": n_sel / n_pool if n_pool else 0.0}
        if sel.action == "kl_penalty" and n_sel:
            stats[f"{group}/min_selected_cov"] = float(out.scores[out.mask].min())
    if SCORE_REGISTRY[sel.score].mask_rule == "stapo":
        n_spur = int((out.pool & ~out.mask).sum())
        stats["stapo/spurious_tokens"] = float(n_spur)
        stats["stapo/spurious_share"] = n_spur / n_pool if n_pool else 0.0
    pool = out.pool
    if n_pool and sel.shaping == "ar" and batch is not None:
        stats["ar/mean_weight"] = float(ar_weight(batch.inputs.old_log_prob, sel.ar_alpha)[pool].mean())
    if n_pool and sel.shaping == "entropy" and out.advantage_shift is not None:
        stats["entropy_adv/mean_shift"] = float(out.advantage_shift[pool].mean())
        if batch is not None and batch.advantages is not None:
            capped = (out.advantage_shift < sel.entropy_alpha * batch.inputs.entropy.float()) & pool
            stats["entropy_adv/capped_share"] = float(capped.sum()) / n_pool
    if n_pool and sel.phases == "lopti" and batch is not None:
        stats["lopti/low_share"] = float((lopti_low(batch.inputs.old_log_prob, sel.lopti_eta) & pool).sum()) / n_pool
        if out.entropy_weight is not None:
            stats["lopti/active_share"] = float(out.entropy_weight[pool].sum()) / n_pool
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


def _mask_rule(sel: Selection, batch: ScoreBatch, pool: torch.Tensor, scope: str,
               dp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, scores)`` of a rule with no budget: every pool token (``all``), or all but STAPO's spurious
    tokens, their entropy quantile pooled over ``dp_group`` for the pooled scopes."""
    rule = SCORE_REGISTRY[sel.score].mask_rule
    if rule == "all":
        return pool.clone(), torch.zeros_like(batch.inputs.log_prob, dtype=torch.float32)
    inp = batch.inputs
    scores = batch.score(sel.score)
    adv = batch.advantages if batch.advantages is not None else inp.advantages
    spurious, _ = spurious_tokens(adv, inp.log_prob, scores, pool, prob_threshold=sel.stapo_prob,
                                  entropy_quantile=sel.stapo_entropy_quantile,
                                  group=None if scope in ("micro_batch", "sequence") else dp_group)
    return pool & ~spurious, scores


def apply_rule(
    sel: Selection,
    batch: ScoreBatch,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
    measured: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    stats: bool = True,
    ratio: Optional[float] = None,
    scope: Optional[str] = None,
    phase: Optional[int] = None,
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
    The rule's advantage shaping comes first (a score that reads the advantage ranks by the shaped one); ``phase``
    (1 or 2) is the Lopti update pass the loss runs in (None: not in a pass, no zeroing).
    """
    ratio = sel.ratio if ratio is None else ratio
    scope = sel.scope if scope is None else scope
    spec = SCORE_REGISTRY[sel.score]
    # the covariance needs the pool's means, and STAPO its quantile: scored below, once the non-finite tokens
    # left the pool
    deferred = (spec.cov_rule is not None or spec.mask_rule is not None) and measured is None
    cov = spec.cov_rule is not None and measured is None
    if measured is None:
        _shape_score_inputs(sel, batch)
    if measured is not None:
        scores = measured[1].float()
    elif not deferred:
        scores = batch.score(sel.score)
    finite = batch.finite if deferred else batch.finite & ~torch.isnan(scores)
    pool = batch.valid & finite
    dropped = bool((batch.valid & ~finite).any())
    if measured is not None:
        mask = measured[0].to(torch.bool) & pool
    elif cov:
        mask, scores = _cov_rule(sel, batch, pool, ratio, scope, dp_group)
    elif deferred:
        mask, scores = _mask_rule(sel, batch, pool, scope, dp_group)
    else:
        mask = _select(sel, batch, scores, pool, ratio, scope, dp_group)
    if dropped:
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
    out = Selected(mask=mask, scores=scores, pool=pool, dropped=dropped)
    _apply_action(sel, batch, out)
    _apply_shaping(sel, batch, out, phase)
    if stats:
        entropy = batch.inputs.entropy
        if entropy is not None and dropped:
            entropy = torch.where(finite, entropy, 0.0)
        out.stats = selection_stats(mask, batch.valid, scores, entropy=entropy,
                                    grad_mass=grad_mass(sel.score, scores, batch.inputs))
        out.stats.update(action_stats(sel, out, batch))
    return out


__all__ = ["ACTION_METRICS", "Selected", "action_stats", "apply_rule"]
