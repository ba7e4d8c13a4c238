"""A rule's update passes per step (its ``update_passes``), for both drivers. No verl import.

A rule that asks for several passes gets that many whole actor updates per step (every mini-batch, every epoch),
each with the pass number as the non-tensor :data:`~verl_tokensel.core.fields.UPDATE_PASS`, which the selecting loss
hands the rule's transform; the batch itself is not changed. The step's metrics are the rule's merge of the passes'
(``merge_passes``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from verl_tokensel.core.resolve.selection import Selection


def several_passes(sel: Optional[Selection]) -> bool:
    """The rule runs more than verl's one update pass per step."""
    return sel is not None and sel.update_passes != (None,)


def run_update_passes(sel: Selection, update: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """Call ``update(n)`` for each of the rule's passes in order (each a whole actor update) and return the rule's
    merge of their metrics."""
    return sel.impl.merge_passes([update(n) for n in sel.update_passes])


__all__ = ["run_update_passes", "several_passes"]
