"""Turn per-token scores into a boolean selection mask. Pure torch, no verl import.

Semantics (shared by every scope):
- the pool is the valid tokens of the scope (padding is never selected and never counted);
- ``direction="top"`` keeps exactly ``k = ceil(ratio * N)`` highest-scoring tokens of a pool of
  ``N`` valid tokens (``N > 0`` and ``ratio > 0`` give ``k >= 1``), ``"bottom"`` the ``k`` lowest;
- ties are broken deterministically by position: the earlier token (row-major over
  ``(batch, response_len)``, then by data-parallel rank) wins; NaN scores rank last in both
  directions, so they are only selected when nothing else is left;
- ``ratio == 1`` keeps every valid token.

Scopes implemented here: ``micro_batch`` (one rank), ``micro_batch_dp`` (the union of the
micro-batches of all data-parallel ranks, exact, via the ``dp_group`` the engine passes) and
``sequence`` (per response).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

SCOPES = ("micro_batch", "micro_batch_dp", "sequence")
DIRECTIONS = ("top", "bottom")


def budget(ratio: float, n: int) -> int:
    """Number of tokens kept from a pool of ``n``: ``ceil(ratio * n)`` clamped to ``[0, n]``.

    A 1e-9 slack absorbs binary rounding (0.2 * 5 = 1.0000000000000002 must give 1, not 2).
    """
    if n <= 0 or ratio <= 0:
        return 0
    return max(1, min(n, math.ceil(ratio * n - 1e-9)))


def _rank_keys(values: torch.Tensor, direction: str) -> torch.Tensor:
    """Keys whose ascending stable sort gives the selection order (NaN last)."""
    v = values.double()
    key = -v if direction == "top" else v
    return torch.nan_to_num(key, nan=math.inf)


def _first_k(values: torch.Tensor, k: int, direction: str) -> torch.Tensor:
    """Bool mask over a 1-D ``values`` marking the k first in selection order (stable)."""
    out = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    if k <= 0:
        return out
    if k >= values.shape[0]:
        out[:] = True
        return out
    order = torch.sort(_rank_keys(values, direction), stable=True).indices
    out[order[:k]] = True
    return out


def select_tokens(
    scores: torch.Tensor,
    valid_mask: torch.Tensor,
    ratio: float,
    *,
    scope: str = "micro_batch",
    direction: str = "top",
    dp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Select tokens by score.

    Args:
        scores: ``(batch, response_len)`` float scores (any dtype; compared in float64).
        valid_mask: ``(batch, response_len)`` bool, True on real response tokens.
        ratio: fraction of the pool to keep, in ``(0, 1]``.
        scope: one of :data:`SCOPES`.
        direction: ``"top"`` or ``"bottom"``.
        dp_group: process group of the data-parallel ranks (``micro_batch_dp`` only; None or a
            world of one means a single rank).

    Returns:
        ``(batch, response_len)`` bool mask, a subset of ``valid_mask``.
    """
    if scores.shape != valid_mask.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and valid_mask {tuple(valid_mask.shape)} differ in shape")
    if not (ratio > 0 and ratio <= 1):
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; valid: {list(DIRECTIONS)}")
    valid = valid_mask.to(torch.bool)
    mask = torch.zeros_like(valid)

    if scope == "sequence":
        for i in range(valid.shape[0]):
            row_valid = valid[i]
            n = int(row_valid.sum())
            idx = row_valid.nonzero(as_tuple=True)[0]
            mask[i, idx[_first_k(scores[i, idx], budget(ratio, n), direction)]] = True
        return mask

    pooled = scores[valid]  # row-major order of the valid tokens
    if scope == "micro_batch" or _world(dp_group) == 1:
        if scope not in ("micro_batch", "micro_batch_dp"):
            raise ValueError(f"unknown scope {scope!r}; valid: {list(SCOPES)}")
        mask[valid] = _first_k(pooled, budget(ratio, pooled.numel()), direction)
        return mask
    if scope != "micro_batch_dp":
        raise ValueError(f"unknown scope {scope!r}; valid: {list(SCOPES)}")
    mask[valid] = _select_across_ranks(pooled, ratio, direction, dp_group)
    return mask


def _world(group: Optional[dist.ProcessGroup]) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _select_across_ranks(
    local: torch.Tensor, ratio: float, direction: str, group: dist.ProcessGroup
) -> torch.Tensor:
    """Exact pooled top-k over all ranks: gather scores, sort once, keep this rank's slice.

    Every rank computes the same global order (rank-major, then local order), so the masks of all
    ranks together equal :func:`select_tokens` of one process over the concatenation.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dev = local.device
    n_local = torch.tensor([local.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n_local) for _ in range(world)]
    dist.all_gather(sizes, n_local, group=group)
    sizes_l = [int(s.item()) for s in sizes]
    width = max(sizes_l) if sizes_l else 0
    padded = torch.full((width,), math.nan, dtype=torch.float64, device=dev)
    padded[: local.numel()] = local.double()
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    pool = torch.cat([g[:s] for g, s in zip(gathered, sizes_l)])
    chosen = _first_k(pool, budget(ratio, pool.numel()), direction)
    start = sum(sizes_l[:rank])
    return chosen[start : start + sizes_l[rank]]


def selection_stats(
    mask: torch.Tensor,
    valid_mask: torch.Tensor,
    scores: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    grad_mass: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """Scalar metrics of one selection (local to the caller's tokens).

    Returns selected fraction, count, threshold (lowest kept score for top, highest for bottom),
    mean entropy of selected vs unselected tokens and, when ``grad_mass`` (a per-token estimate of
    the gradient norm) is given, the share of that mass the selection keeps.
    """
    valid = valid_mask.to(torch.bool)
    n_valid = int(valid.sum())
    sel = mask & valid
    unsel = valid & ~mask
    n_sel = int(sel.sum())
    out = {
        "selected_fraction": n_sel / n_valid if n_valid else 0.0,
        "selected_tokens": float(n_sel),
        "valid_tokens": float(n_valid),
    }
    if n_sel:
        kept = scores[sel].double()
        out["threshold_min_selected_score"] = float(kept.nan_to_num(nan=math.inf).min())
        out["threshold_max_selected_score"] = float(kept.nan_to_num(nan=-math.inf).max())
    if entropy is not None:
        ent = entropy.detach().double()
        if n_sel:
            out["entropy_selected"] = float(ent[sel].mean())
        if int(unsel.sum()):
            out["entropy_unselected"] = float(ent[unsel].mean())
    if grad_mass is not None and n_valid:
        g = grad_mass.detach().double().nan_to_num(nan=0.0)
        total = float(g[valid].sum())
        out["grad_mass_kept"] = float(g[sel].sum()) / total if total > 0 else 0.0
    out["nan_scores"] = float(torch.isnan(scores[valid].double()).sum()) if n_valid else 0.0
    return out
