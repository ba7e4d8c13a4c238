"""A rule that reads the model's last hidden states: the sweeps over the step's batch and what they hand the rule.

A rule declares ``Needs(hidden_states=MyStates)`` with ``MyStates`` a :class:`HiddenStates` subclass. Before the
step's update, on each data-parallel rank, the glue runs ``MyStates.sweeps`` passes over that rank's share of the
step's batch (the advantages given, the weights still the old policy's): each pass is one no-grad forward per
micro-batch (none after the first when the rank's tokens fit :attr:`HiddenStates.cache_bytes`), and each
micro-batch reaches :meth:`HiddenStates.sweep` as a :class:`HiddenBatch`: the input of the output layer (``lm_head``)
at each valid response token, detached, with that token's log-probability and advantage. Only what the rule keeps
outlives a micro-batch (O(H) accumulators for DelTA). The last pass returns one value per token; after
:meth:`HiddenStates.finish` they travel with the batch and reach the rule's loss steps as ``x.hidden`` (fixed for
every mini-batch and epoch of the step). A rule that does not declare it pays nothing. Pure torch, no verl import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class HiddenBatch:
    """One micro-batch's valid response tokens, flattened (``n`` tokens).

    Attributes:
        hidden: ``(n, H)`` the output layer's input at each token (the state that predicts it), detached, in the
            engine's compute dtype.
        log_prob: ``(n,)`` float32, the forward's log-probability of the token (the old policy's).
        advantages: ``(n,)`` float32, verl's advantage of the token.
        rows / cols: ``(n,)`` int64, the token's row in the rank's batch and its response position.
    """

    hidden: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


class HiddenStates:
    """One step's reduction of the last hidden states on one rank; a new instance per step.

    Subclass it and set :attr:`sweeps`; override :meth:`sweep` (every pass, every micro-batch), :meth:`end_sweep`
    (after a pass: collectives over ``dp_group`` go here, called on every rank) and, if the last pass's values need
    the whole batch, :meth:`finish`.

    Attributes:
        knobs: the rule's knobs. ``dp_group``: the data-parallel group of the batch (None: this process alone).
        sweeps: passes over the batch (>= 1).
        cache_bytes: keep the :class:`HiddenBatch` es of the first pass for the others (one forward instead of
            ``sweeps``) when the rank's valid tokens x hidden size x element size fit in this many bytes (0: never).
        metrics: the step's metrics (``tokensel/<rule>/<key>``), read after :meth:`finish`.
    """

    sweeps: int = 1
    cache_bytes: float = 0.0

    def __init__(self, knobs: Any, dp_group: Optional[dist.ProcessGroup] = None) -> None:
        self.knobs, self.dp_group = knobs, dp_group
        self.metrics: dict[str, float] = {}

    def sweep(self, i: int, batch: HiddenBatch) -> Optional[torch.Tensor]:
        """Pass ``i`` (0-based) over one micro-batch: accumulate; the last pass returns ``(n,)`` values."""
        raise NotImplementedError

    def end_sweep(self, i: int) -> None:
        """After pass ``i`` over every micro-batch of the rank (called on every rank of ``dp_group``)."""

    def finish(self, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The values of the last pass, ``(batch, response_len)`` over the rank's batch (``valid`` its tokens),
        as the loss steps read them (default: as they are)."""
        return values


__all__ = ["HiddenBatch", "HiddenStates"]
