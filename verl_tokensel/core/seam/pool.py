"""The ranks a rule pools over, and the exact operations over them a rule needs. Pure torch, no verl import.

A rule whose choice spans more than one rank's tokens (a mini-batch over the data-parallel ranks) needs sums, counts
and a top-k over the union of every rank's tokens that come out as one process holding the whole pool would compute
them: :class:`Pool` gives them, over ``x.pool`` (the ranks of the rule's scope) or a group a helper is handed. With
``group=None`` every operation is local. Ties go to the lower rank, then the earlier position.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.ranking.dist_topk import all_reduce_sum, ordered_keys32, topk_mask_distributed
from verl_tokensel.core.ranking.scopes import dp_world
from verl_tokensel.core.ranking.select import keep_first_k

#: the scopes whose pool spans every data-parallel rank (the others are one rank's tokens)
POOLED_SCOPES = ("micro_batch_dp", "mini_batch", "group", "batch")


class Pool:
    """The data-parallel ranks of ``group`` (None: this process alone)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group

    @property
    def world(self) -> int:
        """How many ranks hold a part of the pool."""
        return dp_world(self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place (returned); nothing to do on one rank."""
        return all_reduce_sum(t, self.group, self.world)

    def count(self, mask: torch.Tensor) -> int:
        """The True entries of ``mask`` over every rank."""
        return int(self.sum(mask.sum().to(torch.int64).reshape(1)).item())

    def top_k(self, values: torch.Tensor, mask: torch.Tensor, k: int, *, largest: bool = True) -> torch.Tensor:
        """Bool mask over ``values``' shape: this rank's share of the ``k`` largest (``largest=False``: smallest)
        ``values`` on ``mask`` over every rank, exactly those one process holding the union would pick."""
        mask = mask.to(torch.bool)
        if self.world <= 1:
            return keep_first_k(values, mask, k, "top" if largest else "bottom")
        out = torch.zeros_like(mask)
        out[mask] = topk_mask_distributed(values[mask], k, self.group, largest=largest)
        return out

    @staticmethod
    def order_keys(values: torch.Tensor) -> torch.Tensor:
        """int32 keys whose integer order is the float32 order of ``values`` (for a radix search over ranks)."""
        return ordered_keys32(values.flatten())


__all__ = ["POOLED_SCOPES", "Pool"]
