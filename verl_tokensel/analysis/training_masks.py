"""Scored responses as one batch of score inputs, and a preset's selection on them (``view``, ``analyze``, demo).

The analysis tools rank with the training code: :func:`scored_batch` hands the scorer's per-token values to
:func:`verl_tokensel.core.ranking.batch.score_batch` (the builder the loss, the pre-pass and the driver use), the scores
come from the registry and the mask from :func:`verl_tokensel.core.ranking.select.select_tokens`. On-policy: the old
log-prob is the current one, so the ratio r = 1, no token is clipped and omega = A.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from verl_tokensel.core.rules import Ranking
from verl_tokensel.core.ranking.batch import ScoreBatch, pad_rows, score_batch
from verl_tokensel.core.ranking.scopes import budget
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY
from verl_tokensel.core.ranking.select import selection_ranks

def scored_batch(scored, advantages: Sequence[float], score: Union[str, Sequence[str]], *,
                 pairs: Optional[Sequence] = None, seed: int = 0) -> ScoreBatch:
    """:class:`ScoreBatch` of a list of :class:`~verl_tokensel.analysis.scorer.TokenScores` (one per response).

    ``advantages``: one per response (broadcast over its tokens). ``pairs``: ``(prompt_ids, response_ids)``
    per response, for the ``random`` score's row keys (prompt + response ids, as the loss hashes them).
    The scorer's exact ``||e_a - p||`` is passed as ``logit_grad_norm``.
    """
    if len(advantages) != len(scored):
        raise ValueError(f"{len(advantages)} advantages for {len(scored)} responses")
    lp, valid = pad_rows([s.logp for s in scored])
    ent, _ = pad_rows([s.entropy for s in scored])
    sp2, _ = pad_rows([s.sum_p2 for s in scored])
    gn, _ = pad_rows([s.grad_norm for s in scored])
    adv = torch.tensor([float(a) for a in advantages], dtype=torch.float32).view(-1, 1).expand_as(lp) * valid
    ids = [list(p) + list(r) for p, r in pairs] if pairs is not None else None
    tensors = {"response_mask": valid, "log_probs": lp, "advantages": adv.contiguous(), "entropy": ent,
               "sum_pi_squared": sp2, "logit_grad_norm": gn}
    return score_batch(score, tensors, input_ids=ids, seed=seed)


def per_response(values: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """The valid entries of each row of a padded ``(batch, len)`` tensor."""
    return [values[i][valid[i]] for i in range(values.shape[0])]


@dataclass
class PresetSelection:
    """A preset's selection on a :class:`ScoreBatch` (one pool, or one per response for ``sequence``)."""

    scores: torch.Tensor
    mask: torch.Tensor
    ranks: torch.Tensor
    ratio: float
    scope: str
    budgets: list[int]


def select_preset(batch: ScoreBatch, sel, *, ratio: Optional[float] = None,
                  scope: Optional[str] = None) -> PresetSelection:
    """Score ``batch`` with ``sel.score`` and select as the loss would on one micro-batch.

    ``scope``: ``sequence`` or ``micro_batch`` (default: ``sequence`` for a sequence preset, else the whole
    batch as one micro-batch). The ranks are the selector's order; a check confirms that the kept tokens
    are exactly ranks ``1 .. budget`` of each pool.
    """
    ratio = sel.ratio if ratio is None else ratio
    scope = scope or ("sequence" if sel.scope == "sequence" else "micro_batch")
    selected = apply_rule(sel, batch, stats=False, ratio=ratio, scope=scope)
    scores, mask = selected.scores, selected.selected  # what the rule selected and its gate lets through
    tokens = selected.tokens
    ranking = sel.knobs if isinstance(sel.knobs, Ranking) else Ranking(score="all", ratio=1.0)
    valid = tokens & (scores != 0) if ranking.pool == "nonzero" else tokens  # the pool the budget counts
    ranks = selection_ranks(scores, valid, ranking.direction, scope)
    spec = SCORE_REGISTRY[sel.score]
    if ranking.budget == "quantile" or spec.rule is not None or not spec.ranks:
        # the count is the rule's own (a quantile, verl's max(1, int(r N)), Clip-Cov's draw among candidates,
        # STAPO's tokens but the spurious ones):
        # the budget reported is what the rule kept
        per_row = mask.sum(-1).tolist()
        budgets = per_row if scope == "sequence" else [int(mask.sum())] * valid.shape[0]
        return PresetSelection(scores=scores, mask=mask, ranks=ranks, ratio=ratio, scope=scope, budgets=budgets)
    if scope == "sequence":
        budgets = [budget(ratio, int(valid[i].sum())) for i in range(valid.shape[0])]
    else:
        budgets = [budget(ratio, int(valid.sum()))] * valid.shape[0]
    want = valid & (ranks <= torch.tensor(budgets, dtype=torch.int64).unsqueeze(-1))
    if not torch.equal(want, mask):
        raise AssertionError("internal: selection ranks disagree with select_tokens")
    return PresetSelection(scores=scores, mask=mask, ranks=ranks, ratio=ratio, scope=scope, budgets=budgets)


__all__ = ["PresetSelection", "per_response", "scored_batch", "select_preset"]
