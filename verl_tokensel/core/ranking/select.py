"""Turn per-token scores into a boolean selection mask. Pure torch, no verl import.

Semantics (shared by every scope):
- the pool is the valid tokens of the scope (padding is never selected and never counted);
- ``direction="top"`` keeps exactly ``k = ceil(ratio * N)`` highest-scoring tokens of a pool of
  ``N`` valid tokens (``N > 0`` and ``ratio > 0`` give ``k >= 1``), ``"bottom"`` the ``k`` lowest;
- scores are compared as float32; ties are broken deterministically by position: the earlier
  token (by data-parallel rank, then row-major over ``(batch, response_len)``) wins; NaN scores
  rank strictly last in both directions, so they are only selected when nothing else is left;
- ``ratio == 1`` keeps every valid token.

Scopes: ``micro_batch`` (one rank), ``micro_batch_dp`` (the union of the micro-batches of all
data-parallel ranks, exact, via the ``dp_group`` the engine passes), ``sequence`` (per response),
``mini_batch`` and ``batch`` (one pool: the tensor given, pooled over ``dp_group`` when one is
given) and ``group`` (one pool per ``group_ids`` value, e.g. the responses of one prompt; each keeps
``ceil(ratio * n_g)`` of its ``n_g`` valid tokens). Which tensor a scope is applied to (a micro-batch,
a rank's mini-batch, the driver's whole batch) is the caller's business.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.ranking.dist_topk import grouped_topk_mask_distributed, ordered_keys32, topk_mask_distributed
from verl_tokensel.core.ranking.scopes import budget, dp_world, invalid_rule_arg

_PAD_KEY = -(2**31)  # below every key, NaN included

_POOLED_DP = ("micro_batch_dp", "mini_batch", "batch")


def rank_keys(values: torch.Tensor, direction: str) -> torch.Tensor:
    """int32 keys, larger = selected first: the float32 order of the scores (reversed for bottom),
    NaN below every number. Shared with the distributed path, so every scope ranks identically."""
    return ordered_keys32(values, largest=direction == "top")


def select_tokens(
    scores: torch.Tensor,
    valid_mask: torch.Tensor,
    ratio: float,
    *,
    scope: str = "micro_batch",
    direction: str = "top",
    dp_group: Optional[dist.ProcessGroup] = None,
    group_ids: Optional[torch.Tensor] = None,
    pool: str = "valid",
) -> torch.Tensor:
    """Select tokens by score.

    Args:
        scores: ``(batch, response_len)`` float scores (any dtype; compared as float32).
        valid_mask: ``(batch, response_len)`` bool, True on real response tokens.
        ratio: fraction of the pool to keep, in ``(0, 1]``.
        scope: one of :data:`SCOPES`.
        direction: ``"top"`` or ``"bottom"``.
        dp_group: process group of the data-parallel ranks (``micro_batch_dp``, ``mini_batch``,
            ``batch``, ``group``; None or a world of one means a single rank).
        group_ids: ``(batch,)`` int64 group of each row (``group`` only).
        pool: one of :data:`~verl_tokensel.core.ranking.scopes.POOLS`: ``valid`` (the budget is ``ceil(ratio * n)`` of
            the scope's valid tokens) or ``nonzero`` (of its valid tokens whose score is not exactly 0; the
            others are never selected).

    Returns:
        ``(batch, response_len)`` bool mask, a subset of ``valid_mask``.
    """
    if scores.shape != valid_mask.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and valid_mask {tuple(valid_mask.shape)} differ in shape")
    bad = invalid_rule_arg(ratio, direction, scope, pool)
    if bad is not None:
        name, value, valid = bad
        raise ValueError(f"ratio must be in (0, 1], got {value!r}" if name == "ratio" else
                         f"unknown {name} {value!r}; valid: {valid}")
    valid = valid_mask.to(torch.bool)
    if pool == "nonzero":
        valid = valid & (scores != 0)  # NaN != 0: a NaN score stays in the pool (and ranks last)

    if scope == "sequence":
        rows = [keep_first_k(scores[i], valid[i], budget(ratio, int(valid[i].sum())), direction)
                for i in range(valid.shape[0])]
        return torch.stack(rows) if rows else torch.zeros_like(valid)
    if scope == "group":
        if group_ids is None or group_ids.shape != valid.shape[:1]:
            raise ValueError(f"scope='group' needs group_ids of shape ({valid.shape[0]},), got "
                             f"{None if group_ids is None else tuple(group_ids.shape)}")
        if dp_world(dp_group) == 1:
            return _select_grouped(scores, valid, group_ids, ratio, direction)
        return grouped_topk_mask_distributed(scores, valid, group_ids, ratio, dp_group,
                                             largest=direction == "top")
    if scope == "micro_batch" or dp_world(dp_group) == 1:
        return keep_first_k(scores, valid, budget(ratio, int(valid.sum())), direction)
    mask = torch.zeros_like(valid)
    mask[valid] = _select_across_ranks(scores[valid], ratio, direction, dp_group)
    return mask


def keep_first_k(scores: torch.Tensor, valid: torch.Tensor, k: int, direction: str) -> torch.Tensor:
    """Bool mask marking the ``k`` first valid entries of ``scores`` in selection order, ties by position.

    O(N), without gathering the valid entries: ``topk`` finds the k-th key; every strictly better key is kept and
    the remaining places go to the earliest tokens whose key equals it (what a stable sort would keep). Invalid
    entries get the lowest int32, below every real key (NaN included), so they are never selected.
    """
    n_valid = int(valid.sum())
    if k <= 0:
        return torch.zeros_like(valid, dtype=torch.bool)
    if k >= n_valid:
        return valid.clone().to(torch.bool)
    key = rank_keys(scores, direction).masked_fill(~valid, _PAD_KEY).flatten()
    kth = torch.topk(key, k, largest=True, sorted=False).values.min()
    out = key > kth
    ties = key == kth
    need = k - int(out.sum())
    if need < int(ties.sum()):
        ties &= torch.cumsum(ties, 0) <= need
    return (out | ties).view_as(valid)


def above_quantile(scores: torch.Tensor, valid: torch.Tensor, q: float, per_row: bool) -> torch.Tensor:
    """The valid tokens whose score is strictly above the ``q``-quantile of the valid scores of their row
    (``per_row``) or of the whole tensor: ``torch.nanquantile``, linear interpolation (Archer's split, ``q`` 0.8).
    The count is not a fixed budget: ties at the quantile all stay below it."""
    valid = valid.to(torch.bool)
    x = scores.float().masked_fill(~valid, float("nan"))
    if per_row:
        thr = torch.nanquantile(x, q, dim=-1, keepdim=True) if x.shape[-1] else x
    else:
        thr = torch.nanquantile(x.flatten(), q) if bool(valid.any()) else x.new_tensor(float("nan"))
    return valid & (x > thr)


def _select_grouped(
    scores: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor, ratio: float, direction: str
) -> torch.Tensor:
    """Per-group :func:`keep_first_k`, vectorised: each group keeps ``budget(ratio, n_g)`` tokens.

    Two stable sorts put the valid tokens in (group, key descending, position) order; a token is kept
    when its rank inside its group is below the group's budget. Same ties and NaN order as every scope.
    """
    flat_valid = valid.flatten()
    idx = flat_valid.nonzero().squeeze(1)
    out = torch.zeros_like(flat_valid)
    if idx.numel() == 0:
        return out.view_as(valid)
    key = rank_keys(scores, direction).flatten()[idx]
    gid = group_ids.to(torch.int64).view(-1, 1).expand_as(valid).flatten()[idx]
    order = torch.sort(key, descending=True, stable=True).indices
    order = order[torch.sort(gid[order], stable=True).indices]
    g_sorted = gid[order]
    uniq, counts = torch.unique_consecutive(g_sorted, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    budgets = torch.tensor([budget(ratio, int(c)) for c in counts.tolist()], dtype=torch.int64,
                           device=counts.device)
    rank_in_group = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(starts, counts)
    keep = rank_in_group < torch.repeat_interleave(budgets, counts)
    out[idx[order[keep]]] = True
    return out.view_as(valid)


def _select_across_ranks(
    local: torch.Tensor, ratio: float, direction: str, group: dist.ProcessGroup
) -> torch.Tensor:
    """Exact pooled selection over all ranks by radix select (no all-gather of the scores).

    The masks of all ranks together equal :func:`select_tokens` of one process over the rank-ordered
    concatenation (ties: lower rank first, then local order).
    """
    n = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    k = budget(ratio, int(n.item()))
    return topk_mask_distributed(local, k, group, largest=direction == "top")


def selection_ranks(scores: torch.Tensor, valid: torch.Tensor, direction: str, scope: str) -> torch.Tensor:
    """Rank (1 = kept first) of every valid token in its pool, in :func:`select_tokens`' order.

    Order: best score first (highest for ``top``, lowest for ``bottom``), NaN last, ties by position
    (row-major over ``(responses, tokens)``). ``scope`` ``sequence`` ranks each row on its own, any other
    scope the whole tensor as one pool. Returns int64 shaped like ``scores`` (0 on padding); the tokens
    :func:`select_tokens` keeps are exactly ranks ``1 .. budget``.
    """
    key = rank_keys(scores, direction)
    ranks = torch.zeros(scores.shape, dtype=torch.int64)
    pools = [list(range(scores.shape[0]))] if scope != "sequence" else [[i] for i in range(scores.shape[0])]
    for pool in pools:
        k = key[pool][valid[pool]]  # row-major valid entries of the pool
        order = torch.sort(k, descending=True, stable=True).indices
        r = torch.empty_like(order)
        r[order] = torch.arange(1, order.numel() + 1)
        sub = torch.zeros(valid[pool].shape, dtype=torch.int64)
        sub[valid[pool]] = r
        ranks[pool] = sub
    return ranks


#: the :func:`selection_stats` keys present for every selection (the others only where defined)
EVERY_MICRO_BATCH_STATS = ("selected_fraction", "selected_tokens", "valid_tokens", "nan_scores")


def selection_stats(
    mask: torch.Tensor,
    valid_mask: torch.Tensor,
    scores: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    grad_mass: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """Scalar metrics of one selection (local to the caller's tokens).

    Returns selected fraction and counts, the selected scores' range (its minimum is the threshold
    for ``top``, its maximum for ``bottom``), mean entropy of selected vs unselected tokens and, when
    ``grad_mass`` (a per-token estimate of the gradient norm) is given, the share of that mass the
    selection keeps. One host synchronisation for all of them.
    """
    valid = valid_mask.to(torch.bool)
    sel = mask & valid
    unsel = valid & ~mask
    f = scores.float()
    zero = f.new_zeros(())
    parts = [valid.sum().float(), sel.sum().float(), unsel.sum().float(),
             torch.where(sel, f, f.new_tensor(math.inf)).nan_to_num(nan=math.inf).amin() if f.numel() else zero,
             torch.where(sel, f, f.new_tensor(-math.inf)).nan_to_num(nan=-math.inf).amax() if f.numel() else zero,
             (torch.isnan(f) & valid).sum().float()]
    if entropy is not None:
        e = entropy.detach().float()
        parts += [(e * sel).sum(), (e * unsel).sum()]
    if grad_mass is not None:
        g = grad_mass.detach().float().nan_to_num(nan=0.0)
        parts += [(g * valid).sum(), (g * sel).sum()]
    vals = torch.stack(parts).tolist()
    n_valid, n_sel, n_unsel, smin, smax, n_nan = vals[:6]
    out = {
        "selected_fraction": n_sel / n_valid if n_valid else 0.0,
        "selected_tokens": n_sel,
        "valid_tokens": n_valid,
        "nan_scores": n_nan,
    }
    if n_sel:
        out["threshold_min_selected_score"] = smin
        out["threshold_max_selected_score"] = smax
    rest = vals[6:]
    if entropy is not None:
        e_sel, e_unsel, rest = rest[0], rest[1], rest[2:]
        if n_sel:
            out["entropy_selected"] = e_sel / n_sel
        if n_unsel:
            out["entropy_unselected"] = e_unsel / n_unsel
    if grad_mass is not None and n_valid:
        total, kept = rest
        out["grad_mass_kept"] = kept / total if total > 0 else 0.0
    return out
