"""The rule step: score, drop non-finite tokens, select over the scope, transform, report. Pure torch.

The loss (each micro-batch), the pre-pass (each rank's mini-batch), the driver (the whole batch) and the analysis
tools all call :func:`apply_rule` on a :class:`~verl_tokensel.core.ranking.batch.ScoreBatch`, so a rule means the same
thing wherever it runs. The steps are the registered rule's (:mod:`~verl_tokensel.core.rules`); this module only
orders them. Its result is the rule's :class:`~verl_tokensel.core.seam.rule.RuleInput` with the step filled in:
the mask, the tokens the loss runs over, the rule's :class:`~verl_tokensel.core.seam.rule.LossTransform` (which
the loss applies as it is) and the metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.ranking.batch import ScoreBatch
from verl_tokensel.core.seam.rule import LossContext, LossTransform, RuleInput
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY, grad_mass
from verl_tokensel.core.ranking.select import selection_stats
from verl_tokensel.core.resolve.selection import Selection


def _shaped(sel: Selection, x: RuleInput) -> tuple[Optional[LossTransform], Optional[RuleInput]]:
    """The shaping's transform over the tokens the rule may treat and the shaping's view of the input (None, None
    without a shaping); a score that reads the advantage (omega) then ranks a copy of the batch whose advantages
    are shaped (the caller's batch is not written)."""
    if sel.shaper is None:
        return None, None
    y = x.with_knobs(sel.shaping_knobs)
    shaping = sel.shaper.transform(y, x.tokens)
    batch = x.batch
    if batch.advantages is not None and SCORE_REGISTRY[sel.score].needs_omega:
        adv = batch.advantages.float()
        adv = adv * shaping.advantage_weight if shaping.advantage_weight is not None else adv
        adv = adv + shaping.advantage_shift if shaping.advantage_shift is not None else adv
        adv = adv * batch.is_weights.float() if batch.is_weights is not None else adv
        x.batch = dataclasses.replace(batch, inputs=dataclasses.replace(batch.inputs, advantages=adv,
                                                                          omega_cache=None))
    return shaping, y


def apply_rule(
    sel: Selection,
    batch: ScoreBatch,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
    measured: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    stats: bool = True,
    ratio: Optional[float] = None,
    scope: Optional[str] = None,
    where: LossContext = LossContext(),
) -> RuleInput:
    """Apply the rule ``sel`` to ``batch``; returns the rule's input with the step's results filled in.

    1. shape: the shaping's transform, once (a score that reads the advantage ranks by the shaped one);
    2. score: the rule's :meth:`~verl_tokensel.core.seam.rule.Rule.score`, or the ``(mask, scores)`` pair
       ``measured`` before the update (the driver's or the pre-pass's, read back from the batch: then nothing is
       re-ranked);
    3. drop every valid token whose loss inputs (``batch.finite``) or score are not finite: out of the loss's
       tokens (``x.tokens``), never selected, its score NaN (counted in ``nan_scores``; ``x.dropped``);
    4. select: the rule's :meth:`~verl_tokensel.core.seam.rule.Rule.select` over ``sel.scope`` (exact over
       ``dp_group`` for the pooled scopes);
    5. transform: the rule's, after the shaping's (``where``: the loss's update pass and denominators);
    6. stats (one host synchronisation; the selection metrics count ``x.selected``: the mask narrowed by the
       gate), unless ``stats=False``.

    ``ratio`` / ``scope`` replace the rule's own for this call (the analysis tools rank one tensor as one pool).
    """
    rule = sel.impl
    x = RuleInput(sel, batch, ratio=sel.ratio if ratio is None else ratio, scope=sel.scope if scope is None else scope,
                  dp_group=dp_group, where=where)
    shaping, y = _shaped(sel, x)
    scores = measured[1].float() if measured is not None else rule.score(x)
    finite = batch.finite if scores is None else batch.finite & ~torch.isnan(scores)
    x.tokens = batch.valid & finite
    x.dropped = bool((batch.valid & ~finite).any())
    x.scores = scores
    x.mask = measured[0].to(torch.bool) & x.tokens if measured is not None else rule.select(x)
    if x.scores is None:
        x.scores = torch.zeros_like(batch.inputs.log_prob, dtype=torch.float32)
    if x.dropped:
        x.scores = torch.where(finite, x.scores, torch.full_like(x.scores, float("nan")))
    own = rule.transform(x)
    x.transform = own.after(shaping)
    if stats:
        entropy = batch.inputs.entropy
        if entropy is not None and x.dropped:
            entropy = torch.where(finite, entropy, 0.0)
        x.stats = selection_stats(x.selected, batch.valid, x.scores, entropy=entropy,
                                  grad_mass=grad_mass(sel.score, x.scores, x.batch.inputs))
        x.stats.update(rule_stats(sel, x, own, shaping, y))
    return x


def _numbers(group: str, metrics: dict) -> dict[str, float]:
    return {f"{group}/{k}": float(v) for k, v in metrics.items()}


def rule_stats(sel: Selection, x: RuleInput, own: LossTransform, shaping: Optional[LossTransform],
               y: Optional[RuleInput]) -> dict[str, float]:
    """The rule's and its shaping's own metrics (``<rule>/...``, ``<shaping>/...``): those the transforms carry and
    those of their ``stats`` step (``y``: the shaping's view of the input)."""
    stats = _numbers(sel.rule, own.metrics)
    stats.update(_numbers(sel.rule, sel.impl.stats(x)))
    if shaping is not None:
        y.tokens, y.mask, y.scores, y.transform = x.tokens, x.mask, x.scores, shaping
        stats.update(_numbers(sel.shaping, shaping.metrics))
        stats.update(_numbers(sel.shaping, sel.shaper.stats(y)))
    return stats


__all__ = ["LossContext", "apply_rule", "rule_stats"]
