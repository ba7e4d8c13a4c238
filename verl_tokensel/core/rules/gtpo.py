"""GTPO (Simoni et al., "GTPO: Trajectory-Based Policy Optimization in Large Language Models", arXiv 2508.03772;
released code winstonsmith1897/GTPO, ``build_conflict_mask`` and ``UnslothEfficientGTPO`` of ``gtpo_training.py``).
Pure torch, no verl import.

Within each prompt group, of the responses with ``A > 0`` or ``A < 0``: a token is a **conflict token** when the
same token id stands at the same position in a positive and in a negative response; positions count from the start
(the leading run of conflict tokens of each response) and, separately, from the end (its trailing run). In each run
a negative response's token gets weight 0 (no negative update) and a positive response's ``gtpo_conflict_weight``
(2); the two runs' weights multiply (a token in both gets ``w^2``), every other token 1. Each response's tokens
are then divided by its number of conflict tokens (the release's count: the longer of its two runs, at least 1).
The **entropy filter**: a response whose mean token entropy ``H`` is above ``gtpo_entropy_threshold`` (0.7) gets
no update; the others the advantage ``A - gtpo_entropy_scale * H`` (0.1). So each token's advantage becomes

    A'_t = delta_t * 1[H <= threshold] * (A_t - scale * H) / max(1, n_conflict)

The release trains on-policy with the ratio 1 (one update per batch); here the advantage enters verl's configured
loss, whose clip then acts on later mini-batches. ``H`` is the old-policy entropy (the policy the responses were
sampled from, which the release's single update step equals). A group's responses are only all in one place on the
driver: the preset runs there (``score_source=rollout``, ``scope=group``), carries ``A' - A`` as its score and its
loss adds it back (``x.scores`` in its transform).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from verl_tokensel.core.rules.group_shift import GroupShiftRule, group_shift_needs
from verl_tokensel.core.rules.maths import share
from verl_tokensel.rules import Knobs, knob, register_rule, register_score

NAME = "gtpo"


@dataclass(frozen=True)
class GtpoKnobs(Knobs):
    gtpo_conflict_weight: float = knob(2.0, "Weight of a positive response's conflict tokens (a negative one's get 0); "
                                       "a token in both the leading and the trailing run gets its square.",
                                       "2.0 (the release's W_RAW)", ge=0)
    gtpo_entropy_threshold: float = knob(0.7, "A response whose mean token entropy (nats, old policy) is above this "
                                         "gets no update.", "0.7 (the release's ENT_THRESHOLD)", gt=0)
    gtpo_entropy_scale: float = knob(0.1, "The other responses' advantage is A - scale * their mean entropy.",
                                     "0.1 (the release's ENT_SCALE)", ge=0)
    gtpo_conflict_normalise: bool = knob(True, "Divide each response's tokens by its number of conflict tokens (at "
                                         "least 1).", "true (the release's loss / n_conflict)")


def _position_keys(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 per (position, token id)."""
    return positions * (int(ids.max()) + 1 if ids.numel() else 1) + ids


def _run_conflicts(keys: torch.Tensor, valid: torch.Tensor, order: torch.Tensor, pos: torch.Tensor,
                   neg: torch.Tensor) -> torch.Tensor:
    """The leading run, in ``order`` (each token's place: a permutation of the columns per row), of tokens whose key
    stands in a positive and a negative response; ``(n, response_len)`` bool."""
    pos_keys = torch.unique(keys[valid & pos.unsqueeze(1)])
    neg_keys = torch.unique(keys[valid & neg.unsqueeze(1)])
    shared = torch.isin(keys, pos_keys) & torch.isin(keys, neg_keys) & valid & (pos | neg).unsqueeze(1)
    # the run: every valid token before it (in this order) is a conflict too
    by_order = torch.zeros_like(shared).scatter_(1, order, shared)
    in_run = torch.cumprod(by_order.to(torch.int64), dim=1).bool()
    return in_run.gather(1, order) & shared


def conflict_masks(ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(leading, trailing)`` conflict runs of one group, ``(n, response_len)`` bool each.

    ``ids`` / ``valid``: the group's token ids and valid mask; ``pos`` / ``neg``: ``(n,)`` bool, ``A > 0`` / ``A < 0``.
    Positions count from each response's first token, and from its last valid token backwards.
    """
    n, width = ids.shape
    col = torch.arange(width, device=ids.device).unsqueeze(0).expand(n, -1)
    length = torch.where(valid, col + 1, 0).max(1).values  # up to the last valid token
    # a permutation of the columns: the last valid token first, then backwards; the columns after it stay last
    from_end = torch.where(col < length.unsqueeze(1), length.unsqueeze(1) - 1 - col, col)
    lead = _run_conflicts(_position_keys(ids, col), valid, col, pos, neg)
    trail = _run_conflicts(_position_keys(ids, from_end), valid, from_end, pos, neg)
    return lead, trail


def gtpo_advantages(ids: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor,
                    group_ids: Optional[torch.Tensor], knobs: GtpoKnobs
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(A', parts)``: each valid token's GTPO advantage (0 off ``valid``) and its parts (``lead`` / ``trail``
    conflict runs, ``filtered`` responses, ``n_conflict`` per response).

    ``advantages`` / ``entropy``: ``(batch, response_len)``; ``group_ids``: ``(batch,)`` int64 (None: one group).
    A response is positive / negative by the sign of its mean advantage over its valid tokens.
    """
    valid = valid.to(torch.bool)
    adv = torch.where(valid, advantages.float(), 0.0)
    count = valid.sum(1).clamp(min=1)
    mean_adv = adv.sum(1) / count
    mean_h = torch.where(valid, entropy.float(), 0.0).sum(1) / count
    pos, neg = mean_adv > 0, mean_adv < 0
    lead, trail = torch.zeros_like(valid), torch.zeros_like(valid)
    groups = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device) if group_ids is None else group_ids
    for g in torch.unique(groups):
        rows = (groups == g).nonzero(as_tuple=True)[0]
        lead[rows], trail[rows] = conflict_masks(ids[rows], valid[rows], pos[rows], neg[rows])
    w = float(knobs.gtpo_conflict_weight)
    side = torch.where(pos, w, 0.0).unsqueeze(1)
    delta = torch.where(lead, side, 1.0) * torch.where(trail, side, 1.0)
    # the release ORs the leading run with the trailing one in its end-aligned frame, where both start at index 0:
    # it counts the longer of the two runs
    n_conflict = torch.maximum(lead.sum(1), trail.sum(1)).clamp(min=1)
    filtered = mean_h > knobs.gtpo_entropy_threshold
    shaped = torch.where(filtered.unsqueeze(1), 0.0, adv - knobs.gtpo_entropy_scale * mean_h.unsqueeze(1))
    out = delta * shaped
    if knobs.gtpo_conflict_normalise:
        out = out / n_conflict.unsqueeze(1)
    return torch.where(valid, out, 0.0), dict(lead=lead, trail=trail, filtered=filtered, n_conflict=n_conflict)


@register_score(NAME, needs_entropy=True, needs_omega=False, ranks=False, rule=NAME,
                needs_external=("response_ids",),
                help="GTPO's change of each token's advantage (conflict tokens, entropy filter) within its prompt "
                     "group (the rows given: one group)")
def gtpo_score(inp) -> torch.Tensor:
    adv = inp.advantages if inp.advantages is not None else torch.zeros_like(inp.log_prob)
    new, _ = gtpo_advantages(inp.external["response_ids"], inp.response_mask, adv, inp.need_entropy(NAME), None,
                             GtpoKnobs())
    return torch.where(inp.response_mask.to(torch.bool), new - adv.float(), 0.0)


@register_rule(NAME, knobs=GtpoKnobs, needs=group_shift_needs(NAME, entropy=True))
class Gtpo(GroupShiftRule):
    """Every token is trained; its advantage is GTPO's (conflict tokens protected or amplified, entropy filter)."""

    def _parts(self, x):
        adv = x.advantages if x.advantages is not None else torch.zeros_like(x.log_prob)
        new, parts = gtpo_advantages(x.external["response_ids"], x.valid, adv, x.entropy.float(), x.group_ids,
                                     x.knobs)
        return torch.where(x.valid, new - adv.float(), 0.0), parts

    def score(self, x) -> torch.Tensor:
        return self._parts(x)[0]

    def stats(self, x) -> dict[str, float]:
        tokens = x.tokens
        n = int(tokens.sum())
        shift = x.transform.advantage_shift
        if shift is None or n == 0:
            return {}
        out = {"mean_shift": float(shift[tokens].mean())}
        if "response_ids" not in x.external:  # the conflict runs: on the driver
            return out
        _, parts = self._parts(x)
        rows = x.valid.any(1)
        conflict = (parts["lead"] | parts["trail"]) & tokens
        return {**out, "conflict_share": share(int(conflict.sum()), n),
                "leading_conflict_share": share(int((parts["lead"] & tokens).sum()), n),
                "trailing_conflict_share": share(int((parts["trail"] & tokens).sum()), n),
                "filtered_response_share": share(int((parts["filtered"] & rows).sum()), int(rows.sum()))}


__all__ = ["Gtpo", "GtpoKnobs", "conflict_masks", "gtpo_advantages"]
