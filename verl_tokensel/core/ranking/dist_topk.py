"""Exact top-k over many data-parallel ranks without gathering the scores. Pure torch.

The k-th largest of the union of every rank's scores is found by radix selection on an
order-preserving integer image of the float32 bit pattern: 4 passes of 8 bits, each a 256-bin
histogram of the still-matching candidates, summed over ranks with one ``all_reduce`` (2 KiB).
Bytes sent per rank are therefore independent of the number of tokens, unlike an all-gather
(whose cost grows with N and which ``torch.quantile`` cannot even rank past 2^24 elements).

Semantics are exactly those of :func:`verl_tokensel.core.ranking.select.select_tokens` over the
concatenation of the ranks' pools in rank order: ``k`` items kept; ties at the threshold go to
the earliest items (lower rank first, then local order); NaN ranks below every number; every rank
computes the same threshold. Scores are compared after rounding to float32 (float64 inputs that
differ only beyond float32 precision count as ties).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.ranking.scopes import budget, world_size

_BITS = 8
_PASSES = 32 // _BITS
_BINS = 1 << _BITS


_INT32_MIN = -(2**31)
NAN_KEY = _INT32_MIN + 1  # below every number; _INT32_MIN itself is left free for padding


def ordered_keys32(values: torch.Tensor, largest: bool = True) -> torch.Tensor:
    """int32 keys, larger = selected first: the float32 order of ``values`` (reversed when not
    ``largest``), NaN -> :data:`NAN_KEY` (below every number in both directions).

    Negative floats get all bits but the sign flipped, which makes signed-int32 order equal float
    order; -0.0 is folded into +0.0 first (they compare equal, so they must tie). No real float maps
    to ``NAN_KEY`` or below (only NaN bit patterns would).
    """
    f = values.detach().float().contiguous() + 0.0  # IEEE: -0.0 + 0.0 == +0.0
    bits = f.view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    if not largest:
        key = torch.bitwise_not(key)
    return key.masked_fill_(torch.isnan(f), NAN_KEY)


def ordered_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^32) whose integer order is the float32 order of ``values``; NaN -> 0 (lowest)."""
    keys = ordered_keys32(values).to(torch.int64) - _INT32_MIN
    return keys.masked_fill_(torch.isnan(values.detach().float()), 0)


def all_reduce_sum(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """``t`` summed in place over the ``world`` ranks of ``group`` (nothing for one rank)."""
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def kth_largest_key(keys: torch.Tensor, k: int, group: Optional[dist.ProcessGroup] = None) -> int:
    """The k-th largest key (1-based) of the union over ``group``; every rank gets the same int.

    ``keys``: int64 keys in [0, 2^32) (:func:`ordered_keys`) or int32 keys (:func:`ordered_keys32`);
    the result is in the unsigned [0, 2^32) space either way.

    ``group=None`` means the default group when torch.distributed is initialised, else one process.
    ``k`` must be in [1, total]; identical on every rank. Cost: 4 all-reduces of 256 int64; per item, int32 work only.
    """
    world = world_size(group)
    prefix = 0
    remaining = k
    # unsigned view: int64 keys are already in [0, 2^32); int32 signed keys get their sign bit flipped
    cand = keys if keys.dtype == torch.int64 else keys ^ _INT32_MIN
    for p in range(_PASSES):
        shift = 32 - _BITS * (p + 1)
        digit = (cand >> shift) & (_BINS - 1)
        hist = torch.bincount(digit, minlength=_BINS).to(torch.int64)
        hist = all_reduce_sum(hist, group, world)
        # walk from the top bin down until `remaining` items are covered
        from_top = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])  # items in bins >= b
        b = int((from_top >= remaining).nonzero().max())
        above = int(from_top[b + 1]) if b + 1 < _BINS else 0
        remaining -= above
        prefix |= b << shift
        cand = cand[digit == b]
    return prefix


def topk_mask_distributed(
    values: torch.Tensor,
    k: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    largest: bool = True,
) -> torch.Tensor:
    """Bool mask over this rank's 1-D ``values``: its share of the global top-k (or bottom-k).

    The masks of all ranks together select exactly ``k`` items (``min(k, total)``), identical to a
    single process selecting over the rank-ordered concatenation with ties broken by position.
    """
    values = values.flatten()
    keys = ordered_keys32(values, largest)
    world = world_size(group)
    rank = dist.get_rank(group) if world > 1 else 0
    count = torch.tensor([keys.numel()], dtype=torch.int64, device=keys.device)
    total = int(all_reduce_sum(count, group, world).item())
    if k <= 0 or total == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    if k >= total:
        return torch.ones_like(values, dtype=torch.bool)
    kth = kth_largest_key(keys, k, group) + _INT32_MIN  # back to the signed int32 space of `keys`
    greater = keys > kth
    ties = keys == kth
    counts = torch.zeros(2 * world, dtype=torch.int64, device=keys.device)
    counts[rank] = int(greater.sum())
    counts[world + rank] = int(ties.sum())
    counts = all_reduce_sum(counts, group, world)
    need = k - int(counts[:world].sum())
    before = int(counts[world : world + rank].sum())  # ties held by lower ranks come first
    take = max(0, min(int(counts[world + rank]), need - before))
    if take < int(counts[world + rank]):
        ties &= torch.cumsum(ties, 0) <= take
    return greater | ties


def global_group_ids(local_ids: torch.Tensor, group, world: int) -> torch.Tensor:
    """Sorted unique int64 group ids present on ANY rank (every rank gets the same tensor).

    Only the distinct ids travel (one all-gather of their count, one of the padded ids), so the
    cost is the number of groups, not the number of tokens.
    """
    uniq = torch.unique(local_ids.to(torch.int64))
    if world == 1:
        return uniq
    sizes = [torch.zeros(1, dtype=torch.int64, device=uniq.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([uniq.numel()], dtype=torch.int64, device=uniq.device), group=group)
    width = max(int(s.item()) for s in sizes)
    if width == 0:
        return uniq
    padded = torch.zeros(width, dtype=torch.int64, device=uniq.device)
    padded[: uniq.numel()] = uniq
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.unique(torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)]))


def _grouped_kth_keys(ukey: torch.Tensor, g: torch.Tensor, k: torch.Tensor, n_groups: int,
                      group: Optional[dist.ProcessGroup], world: int) -> torch.Tensor:
    """``(n_groups,)`` the k-th largest unsigned key of each group over all ranks, by radix select (one all-reduce of
    a ``(n_groups, 256)`` histogram per pass); groups keeping all (k == n) or none (n == 0) ride along."""
    device = ukey.device
    prefix = torch.zeros(n_groups, dtype=torch.int64, device=device)
    remaining = k.clamp(min=1)
    cand = torch.arange(ukey.numel(), device=device)
    for p in range(_PASSES):
        shift = 32 - _BITS * (p + 1)
        digit = (ukey[cand] >> shift) & (_BINS - 1)
        hist = torch.zeros(n_groups * _BINS, dtype=torch.int32, device=device)
        hist.index_add_(0, g[cand] * _BINS + digit, torch.ones_like(digit, dtype=torch.int32))
        hist = all_reduce_sum(hist, group, world).view(n_groups, _BINS).to(torch.int64)
        from_top = torch.flip(torch.cumsum(torch.flip(hist, [1]), 1), [1])  # items in bins >= b
        b = ((from_top >= remaining.unsqueeze(1)).sum(1) - 1).clamp(min=0)
        above = torch.cat([from_top, torch.zeros_like(from_top[:, :1])], 1).gather(1, (b + 1).unsqueeze(1)).squeeze(1)
        remaining = (remaining - above).clamp(min=1)
        prefix |= b << shift
        cand = cand[digit == b[g[cand]]]
    return prefix


def grouped_topk_mask_distributed(
    scores: torch.Tensor,
    valid: torch.Tensor,
    group_ids: torch.Tensor,
    ratio: float,
    group: Optional[dist.ProcessGroup] = None,
    *,
    largest: bool = True,
) -> torch.Tensor:
    """Per-group exact top-``ceil(ratio * n_g)`` over all ranks of ``group``, without gathering scores.

    Args:
        scores: ``(batch, response_len)`` scores of this rank (compared as float32).
        valid: ``(batch, response_len)`` bool, True on the tokens that may be selected.
        group_ids: ``(batch,)`` int64 group of each row; equal ids on different ranks are one group
            (e.g. the responses of one prompt split across data-parallel ranks).
        ratio: fraction in ``(0, 1]``; group ``g`` with ``n_g`` valid tokens over all ranks keeps
            ``budget(ratio, n_g)`` = ``ceil(ratio * n_g)`` of them.
        largest: keep the highest scores (``top``) or the lowest (``bottom``).

    Returns:
        ``(batch, response_len)`` bool mask. The masks of all ranks equal the single-process
        ``select_tokens(..., scope="group")`` over the rank-ordered concatenation of the rows: ties
        go to the lower rank, then to the earlier token in row-major order; NaN ranks last.

    Cost: one all-gather of the distinct group ids, one all-reduce of per-group counts, 4 radix
    passes of one all-reduce of a ``(G, 256)`` int32 histogram each (G = number of groups, ~1 KiB
    per group per pass), and one all-reduce of per-rank tie counts ``(world + 1, G)``.
    """
    world = world_size(group)
    rank = dist.get_rank(group) if world > 1 else 0
    valid = valid.to(torch.bool)
    device = scores.device
    flat_valid = valid.flatten()
    idx = flat_valid.nonzero().squeeze(1)
    # unsigned [0, 2^32) keys of the valid tokens, larger = selected first
    ukey = ordered_keys32(scores, largest).flatten()[idx].to(torch.int64) - _INT32_MIN
    row_gid = group_ids.to(torch.int64).to(device)
    tok_gid = row_gid.view(-1, 1).expand_as(valid).flatten()[idx]

    gids = global_group_ids(row_gid, group, world)
    n_groups = gids.numel()
    out = torch.zeros_like(flat_valid)
    if n_groups == 0:
        return out.view_as(valid)
    g = torch.searchsorted(gids, tok_gid)  # dense group index of each valid token

    counts = all_reduce_sum(torch.bincount(g, minlength=n_groups).to(torch.int64), group, world)
    k = torch.tensor([budget(ratio, int(c)) for c in counts.tolist()], dtype=torch.int64, device=device)
    kth = _grouped_kth_keys(ukey, g, k, n_groups, group, world)[g]
    keep_all = (k >= counts)[g]
    greater = (ukey > kth) | keep_all
    ties = (ukey == kth) & ~keep_all
    tally = torch.zeros(world + 1, n_groups, dtype=torch.int64, device=device)
    tally[0] = torch.bincount(g[greater], minlength=n_groups)
    tally[1 + rank] = torch.bincount(g[ties], minlength=n_groups)
    tally = all_reduce_sum(tally, group, world)
    need = (k - tally[0]).clamp(min=0)
    before = tally[1 : 1 + rank].sum(0)  # ties held by lower ranks come first
    take = (need - before).clamp(min=0)
    # the first `take[g]` ties of each group in row-major order on this rank
    tie_pos = ties.nonzero().squeeze(1)
    tie_g = g[tie_pos]
    order = torch.sort(tie_g, stable=True).indices
    sorted_g = tie_g[order]
    starts = torch.searchsorted(sorted_g, sorted_g, right=False)
    rank_in_group = torch.arange(order.numel(), device=device) - starts
    chosen = torch.zeros_like(ties)
    chosen[tie_pos[order[rank_in_group < take[sorted_g]]]] = True
    out[idx] = greater | chosen
    return out.view_as(valid)
