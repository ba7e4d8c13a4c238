"""Token selection on the driver (``token_selection.score_source=rollout``), pure torch.

The 80/20 paper ranks tokens by their entropy over the whole training batch B ("keep H >= tau_rho^B", arXiv
2506.01939): one threshold for all responses of a step, which only the driver sees. verl already runs an old-policy
pass over the whole batch (entropy, log-probs) and computes the advantages on the driver; :func:`select_on_driver`
runs the rule step on those padded fields AT THE OLD POLICY (ratio r = 1, so omega = A plus the KL term's weight:
``gmts`` is H_old * |A|). Scopes: ``batch``, ``group`` (verl's ``uid``), ``sequence``.
:mod:`verl_tokensel.verl_glue.rollout_source` sends the mask to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.batch import score_batch
from verl_tokensel.core.resolve.selection import Selection
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.ranking.scores import score_params

DRIVER_METRIC_PREFIX = "tokensel/driver_"


@dataclass
class DriverSelection:
    """What :func:`select_on_driver` returns.

    Attributes:
        mask: ``(batch, response_len)`` bool, a subset of the valid response tokens.
        scores: ``(batch, response_len)`` float32 scores the mask was ranked by (0 on padding).
        metrics: scalar metrics over the whole batch, keys prefixed ``tokensel/driver_``.
    """

    mask: torch.Tensor
    scores: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def select_on_driver(
    sel: Selection,
    tensors: Mapping[str, Optional[torch.Tensor]],
    *,
    keys: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    row_valid: Optional[torch.Tensor] = None,
    external: Optional[Mapping[str, torch.Tensor]] = None,
    params: Optional[Mapping[str, Any]] = None,
) -> DriverSelection:
    """Score every response token of the batch at the old policy and apply the rule ``sel``.

    Args:
        sel: the resolved rule (``sel.score_source`` should be ``rollout``; not checked here).
        tensors: padded ``(batch, response_len)`` fields keyed by :mod:`~verl_tokensel.core.fields` names:
            ``response_mask``, ``old_log_probs`` (nats), ``advantages``, and as the score needs them ``entropy``,
            ``sum_pi_squared`` (``grad_norm`` is exact with it, a lower bound without), ``ref_log_prob`` (read only
            when ``params['kl_coef']`` > 0), ``rollout_is_weights`` (they multiply the token loss, hence omega).
        keys: ``(batch,)`` int64 per-response keys (``random`` score).
        group_ids: ``(batch,)`` int64 prompt group of each row (``scope=group``), as
            :func:`verl_tokensel.core.ranking.batch.group_ids` makes them from verl's ``uid``.
        row_valid: ``(batch,)`` bool, False on synthetic padding rows (never selected, never counted).
        external: per-token fields a score declares in ``needs_external`` (e.g. ``ref_entropy``).
        params: clip/KL keyword arguments of :class:`ScoreInputs`, see :func:`score_params`.

    Returns:
        :class:`DriverSelection` with the mask, the float32 scores and ``tokensel/driver_*`` metrics.
    """
    as_float = (fields.OLD_LOG_PROBS, fields.ADVANTAGES, fields.ENTROPY)
    t = {k: (v.float() if k in as_float and v is not None else v) for k, v in tensors.items()}
    sb = score_batch(sel.scores, t, row_valid=row_valid, keys=keys,
                     groups=group_ids if sel.scope == "group" else None, seed=sel.seed, external=external,
                     params=params)
    selected = apply_rule(sel, sb)
    metrics = {DRIVER_METRIC_PREFIX + k: v for k, v in selected.stats.items()}
    if sel.scope == "group" and group_ids is not None:
        metrics[DRIVER_METRIC_PREFIX + "groups"] = float(torch.unique(group_ids[sb.valid.any(1)]).numel())
    return DriverSelection(mask=selected.mask, scores=selected.scores, metrics=metrics)


__all__ = [
    "DRIVER_METRIC_PREFIX",
    "DriverSelection",
    "score_params",
    "select_on_driver",
]
