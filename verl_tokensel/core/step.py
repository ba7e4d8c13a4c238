"""The rule step: score, drop non-finite tokens, select over the scope, transform, report. Pure torch.

The loss (each micro-batch), the pre-pass (each rank's mini-batch), the driver (the whole batch) and the analysis
tools all call :func:`apply_rule` on a :class:`~verl_tokensel.core.batch.ScoreBatch`, so a rule means the same
thing wherever it runs. The steps are the registered rule's (:mod:`~verl_tokensel.core.rules`); this module only
orders them. Its result, :class:`StepResult`, carries the mask, the tokens the loss runs over and the rule's
:class:`~verl_tokensel.core.rules.base.LossTransform`, which the loss applies as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.batch import ScoreBatch
from verl_tokensel.core.rules.base import LossTransform, RuleInput
from verl_tokensel.core.scores import SCORE_REGISTRY, grad_mass
from verl_tokensel.core.select import selection_stats
from verl_tokensel.core.selection import Selection


@dataclass(frozen=True)
class LossContext:
    """Where a micro-batch sits in the loss, for a rule whose weights depend on it (the loss builds it).

    Attributes:
        update_pass: the driver's update pass (``Needs(passes=...)``; None: the one pass).
        denominator: the token-mean denominator of verl's loss (``batch_num_tokens``, over all ranks); None
            outside the loss (the micro-batch alone then is the whole).
        global_rows: the mini-batch's responses over all ranks (``global_batch_size``); None as above.
        loss_agg_mode: the actor's ``loss_agg_mode``.
    """

    update_pass: Optional[int] = None
    denominator: Optional[float] = None
    global_rows: Optional[int] = None
    loss_agg_mode: str = "token-mean"


@dataclass
class StepResult:
    """What :func:`apply_rule` returns; every tensor is ``(batch, response_len)``.

    Attributes:
        mask: bool, the tokens the rule selected (a subset of ``loss_tokens``).
        scores: float32 scores the mask was ranked by, NaN on dropped tokens.
        loss_tokens: bool, the valid tokens whose loss inputs and score are finite (the loss's token set).
        dropped: whether any valid token was dropped (``loss_tokens`` differs from the valid tokens).
        transform: what the rule (after its shaping) does to the loss on these tokens.
        stats: :func:`~verl_tokensel.core.select.selection_stats` and the rule's own (empty when not asked for).
    """

    mask: torch.Tensor
    scores: torch.Tensor
    loss_tokens: torch.Tensor
    dropped: bool
    transform: LossTransform
    stats: dict[str, float] = field(default_factory=dict)


def _shape_score_inputs(sel: Selection, x: RuleInput) -> None:
    """A score that reads the advantage (omega) ranks by the shaped one: the shaping comes first."""
    batch = x.batch
    if sel.shaper is None or batch.advantages is None or not SCORE_REGISTRY[sel.knobs.score].needs_omega:
        return
    t = sel.shaper.transform(x.with_knobs(sel.shaping_knobs), batch.valid)
    adv = batch.advantages.float()
    adv = adv * t.advantage_weight if t.advantage_weight is not None else adv
    adv = adv + t.advantage_shift if t.advantage_shift is not None else adv
    batch.inputs.advantages = adv * batch.is_weights.float() if batch.is_weights is not None else adv
    batch.inputs.omega_cache = None


def apply_rule(
    sel: Selection,
    batch: ScoreBatch,
    *,
    dp_group: Optional[dist.ProcessGroup] = None,
    measured: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    stats: bool = True,
    ratio: Optional[float] = None,
    scope: Optional[str] = None,
    context: Optional[LossContext] = None,
) -> StepResult:
    """Apply the rule ``sel`` to ``batch``.

    1. score: the rule's :meth:`~verl_tokensel.core.rules.base.Rule.score` (after the shaping, for a score that
       reads the advantage), or the ``(mask, scores)`` pair ``measured`` before the update (the driver's or the
       pre-pass's, read back from the batch: then nothing is re-ranked);
    2. drop every valid token whose loss inputs (``batch.finite``) or score are not finite: out of the loss's
       tokens, never selected, its score NaN (counted in ``nan_scores``);
    3. select: the rule's :meth:`~verl_tokensel.core.rules.base.Rule.select` over ``sel.scope`` (exact over
       ``dp_group`` for the pooled scopes);
    4. transform: the shaping's, then the rule's (``context``: the loss's update pass and denominators);
    5. stats (one host synchronisation), unless ``stats=False``.

    ``ratio`` / ``scope`` replace the rule's own for this call (the analysis tools rank one tensor as one pool).
    """
    context = LossContext() if context is None else context
    rule = sel.impl
    x = RuleInput(sel, sel.knobs, batch, ratio=sel.knobs.ratio if ratio is None else ratio,
                  scope=sel.scope if scope is None else scope, dp_group=dp_group, update_pass=context.update_pass,
                  denominator=context.denominator, global_rows=context.global_rows,
                  loss_agg_mode=context.loss_agg_mode)
    if measured is not None:
        scores = measured[1].float()
    else:
        _shape_score_inputs(sel, x)
        scores = rule.score(x)
    finite = batch.finite if scores is None else batch.finite & ~torch.isnan(scores)
    tokens = batch.valid & finite
    dropped = bool((batch.valid & ~finite).any())
    x.tokens, x.scores = tokens, scores
    if measured is not None:
        mask = measured[0].to(torch.bool) & tokens
    else:
        mask = rule.select(x)
        if x.scores is None:
            x.scores = torch.zeros_like(batch.inputs.log_prob, dtype=torch.float32)
    scores = x.scores
    if dropped:
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
    x.mask, x.scores = mask, scores
    shaping = None if sel.shaper is None else sel.shaper.transform(x.with_knobs(sel.shaping_knobs), tokens)
    own = rule.transform(x)
    transform = own.after(shaping)
    x.transform = transform
    out = StepResult(mask=mask, scores=scores, loss_tokens=tokens, dropped=dropped, transform=transform)
    if stats:
        entropy = batch.inputs.entropy
        if entropy is not None and dropped:
            entropy = torch.where(finite, entropy, 0.0)
        out.stats = selection_stats(mask, batch.valid, scores, entropy=entropy,
                                    grad_mass=grad_mass(sel.knobs.score, scores, batch.inputs))
        out.stats.update(rule_stats(sel, x, own, shaping))
    return out


def _numbers(group: str, metrics: dict) -> dict[str, float]:
    return {f"{group}/{k}": float(v) for k, v in metrics.items()}


def rule_stats(sel: Selection, x: RuleInput, own: LossTransform,
               shaping: Optional[LossTransform] = None) -> dict[str, float]:
    """The rule's and its shaping's own metrics (``<rule>/...``, ``<shaping>/...``): those the transforms carry and
    those of their ``stats`` step."""
    stats = _numbers(sel.rule, own.metrics)
    stats.update(_numbers(sel.rule, sel.impl.stats(x)))
    if sel.shaper is not None:
        shaped = shaping if shaping is not None else sel.shaper.transform(x.with_knobs(sel.shaping_knobs), x.tokens)
        y = x.with_knobs(sel.shaping_knobs)
        y.transform = shaped
        stats.update(_numbers(sel.shaping, shaped.metrics))
        stats.update(_numbers(sel.shaping, sel.shaper.stats(y)))
    return stats


__all__ = ["LossContext", "StepResult", "apply_rule", "rule_stats"]
