"""Lopti's two update passes on the driver (``token_selection.phases=lopti``), for both drivers.

The released code (zhyang2226/AR-Lopti, ``ray_trainer.py``) calls the actor update twice per step: first with
the advantages of the tokens with ``pi_old >= eta`` zeroed, then with those of ``pi_old < eta`` zeroed; every
token stays in the loss mask (the denominators), the old log-probs are the step's, and the two passes' metrics
are averaged (lists concatenated). Here the driver runs the two update calls with the pass number set as the
non-tensor :data:`~verl_tokensel.core.shaping.LOPTI_PHASE_KEY`, and the selecting loss zeroes the other pass's
advantages, KL and entropy terms (:func:`verl_tokensel.core.rule.apply_rule`): the batch itself is not changed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from verl_tokensel.core.config import Selection
from verl_tokensel.core.shaping import LOPTI_PHASE_KEY

#: actor metrics also reported per pass (``tokensel/lopti/phase<n>/<key>``)
PER_PHASE_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl")


def uses_lopti(sel: Optional[Selection]) -> bool:
    return sel is not None and sel.phases == "lopti"


def merge_phase_metrics(per_phase: list[dict[str, Any]]) -> dict[str, Any]:
    """The released code's merge: numbers averaged over the passes that report them, lists concatenated; plus
    :data:`PER_PHASE_KEYS` of each pass under ``tokensel/lopti/phase<n>/``."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for m in per_phase for k in m):
        values = [m[key] for m in per_phase if key in m]
        if all(isinstance(v, list) for v in values):
            merged[key] = [x for v in values for x in v]
        else:
            try:
                merged[key] = sum(float(v) for v in values) / len(values)
            except (TypeError, ValueError):
                merged[key] = values[-1]
    for n, m in enumerate(per_phase, start=1):
        for key in PER_PHASE_KEYS:
            if key in m:
                v = m[key]
                merged[f"tokensel/lopti/phase{n}/{key}"] = (sum(v) / len(v) if isinstance(v, list) and v
                                                          else v)
    return merged


def run_lopti_passes(update: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """Call ``update(phase)`` for phase 1 then 2 (each a whole actor update: every mini-batch, every epoch) and
    return the merged metrics."""
    return merge_phase_metrics([update(1), update(2)])


__all__ = ["LOPTI_PHASE_KEY", "PER_PHASE_KEYS", "merge_phase_metrics", "run_lopti_passes", "uses_lopti"]
