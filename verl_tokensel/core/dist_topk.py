"""Exact top-k over many data-parallel ranks without gathering the scores. Pure torch.

The k-th largest of the union of every rank's scores is found by radix selection on an
order-preserving integer image of the float32 bit pattern: 4 passes of 8 bits, each a 256-bin
histogram of the still-matching candidates, summed over ranks with one ``all_reduce`` (2 KiB).
Bytes sent per rank are therefore independent of the number of tokens, unlike an all-gather
(whose cost grows with N and which ``torch.quantile`` cannot even rank past 2^24 elements).

Semantics are exactly those of :func:`verl_tokensel.core.select.select_tokens` over the
concatenation of the ranks' pools in rank order: ``k`` items kept; ties at the threshold go to
the earliest items (lower rank first, then local order); NaN ranks below every number; every rank
computes the same threshold. Scores are compared after rounding to float32 (float64 inputs that
differ only beyond float32 precision count as ties).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

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


def _world(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, group, world: int) -> torch.Tensor:
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
    world = _world(group)
    prefix = 0
    remaining = k
    # unsigned view: int64 keys are already in [0, 2^32); int32 signed keys get their sign bit flipped
    cand = keys if keys.dtype == torch.int64 else keys ^ _INT32_MIN
    for p in range(_PASSES):
        shift = 32 - _BITS * (p + 1)
        digit = (cand >> shift) & (_BINS - 1)
        hist = torch.bincount(digit, minlength=_BINS).to(torch.int64)
        hist = _all_reduce(hist, group, world)
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
    world = _world(group)
    rank = dist.get_rank(group) if world > 1 else 0
    total = int(_all_reduce(torch.tensor([keys.numel()], dtype=torch.int64, device=keys.device), group, world).item())
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
    counts = _all_reduce(counts, group, world)
    need = k - int(counts[:world].sum())
    before = int(counts[world : world + rank].sum())  # ties held by lower ranks come first
    take = max(0, min(int(counts[world + rank]), need - before))
    if take < int(counts[world + rank]):
        ties &= torch.cumsum(ties, 0) <= take
    return greater | ties
