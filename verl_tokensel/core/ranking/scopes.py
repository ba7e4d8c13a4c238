"""Scopes: the pools a selection budget is taken from, which score source can fill each, the directions, the
budget, the world size.

One home for what the shared config and the rules (validation), :mod:`~verl_tokensel.core.ranking.select` and
:mod:`~verl_tokensel.core.ranking.dist_topk` (selection) all need, so neither of the last two imports the other
for it. Pure torch.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch.distributed as dist

DIRECTIONS = ("top", "bottom")
SCOPES = ("micro_batch", "micro_batch_dp", "sequence", "mini_batch", "group", "batch")
#: which tokens of a scope the budget is a fraction of (and may be chosen from): every valid response token,
#: or only those whose score is not exactly zero (NaN counts as scored; it ranks last)
POOLS = ("valid", "nonzero")
# Where the ranking scores come from, and the scopes each source can fill. A scope wider than one
# micro-batch needs every score of the pool before the first backward of that pool:
# - current: the update forward of each micro-batch (scores of the policy being trained);
# - prepass: a no-grad forward over the rank's PPO mini-batch at its start (the GMTS code's timing),
#   pooled over the data-parallel ranks by collectives (mini_batch, group) or per response (sequence);
# - rollout: the old-policy pass verl already runs before the update (entropy, log-probs), with the
#   driver's advantages; the driver computes the mask and sends it as a per-token field.
SOURCE_SCOPES = {
    "current": ("micro_batch", "micro_batch_dp", "sequence"),
    "prepass": ("mini_batch", "group", "sequence"),
    "rollout": ("batch", "group", "sequence"),
}
SCORE_SOURCES = tuple(SOURCE_SCOPES)


def invalid_rule_arg(ratio: Any, direction: Any, scope: Any, pool: Any) -> Optional[tuple[str, Any, str]]:
    """``(name, value, valid values)`` of the first invalid selection argument, or None: the one check behind
    the config's errors (:class:`~verl_tokensel.core.config.Selection`) and ``select_tokens``' guard."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0 < ratio <= 1:
        return "ratio", ratio, "a number in (0, 1]"
    for name, value, valid in (("direction", direction, DIRECTIONS), ("scope", scope, SCOPES), ("pool", pool, POOLS)):
        if value not in valid:
            return name, value, str(list(valid))
    return None


def budget(ratio: float, n: int) -> int:
    """Number of tokens kept from a pool of ``n``: ``ceil(ratio * n)`` clamped to ``[0, n]``.

    A 1e-9 slack absorbs binary rounding (0.07 * 100 = 7.000000000000001 must give 7, not 8).
    """
    if n <= 0 or ratio <= 0:
        return 0
    return max(1, min(n, math.ceil(ratio * n - 1e-9)))


def world_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group`` (``None``: torch's default group); 1 without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def dp_world(dp_group: Optional[dist.ProcessGroup]) -> int:
    """Ranks of the data-parallel group a rule pools over (``None``: this rank alone)."""
    return 1 if dp_group is None else world_size(dp_group)
