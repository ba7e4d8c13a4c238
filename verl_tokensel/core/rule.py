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
from verl_tokensel.core.scores import grad_mass
from verl_tokensel.core.select import select_tokens, selection_stats


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
    if measured is None:
        scores = batch.score(sel.score)
    else:
        scores = measured[1].float()
    finite = batch.finite & ~torch.isnan(scores)
    pool = batch.valid & finite
    dropped = bool((batch.valid & ~finite).any())
    if measured is not None:
        mask = measured[0].to(torch.bool) & pool
    else:
        mask = select_tokens(scores, pool, ratio, scope=scope, direction=sel.direction, dp_group=dp_group,
                             group_ids=batch.group_ids if scope == "group" else None, pool=sel.pool) & pool
    if dropped:
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
    out = Selected(mask=mask, scores=scores, pool=pool, dropped=dropped)
    if stats:
        entropy = batch.inputs.entropy
        if entropy is not None and dropped:
            entropy = torch.where(finite, entropy, 0.0)
        out.stats = selection_stats(mask, batch.valid, scores, entropy=entropy,
                                    grad_mass=grad_mass(sel.score, scores, batch.inputs))
    return out


__all__ = ["Selected", "apply_rule"]
