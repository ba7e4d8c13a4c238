"""Small arithmetic the rules share: a share of a count and verl's masked mean. Pure torch; imports nothing of the
project, so any rule module may use it."""

from __future__ import annotations

import torch


def share(n: float, of: float) -> float:
    """``n / of``, 0 for an empty whole."""
    return n / of if of else 0.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_mean`` (``sum(values * mask) / (sum(mask) + 1e-8)``), for the metrics of a rule's own loss."""
    return (values * mask).sum() / (mask.sum() + 1e-8)


__all__ = ["masked_mean", "share"]
