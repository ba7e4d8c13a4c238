"""Token selection on the driver (``token_selection.score_source=rollout``).

The 80/20 paper ranks tokens by their entropy over the whole training batch B ("keep H >= tau_rho^B",
arXiv 2506.01939): one threshold for all responses of a step. No data-parallel rank sees the whole
batch, the driver does. verl already runs an old-policy pass over the whole batch before the update
(entropy and log-probs), and computes the advantages on the driver; this module turns those padded
``(batch, response_len)`` fields into a selection mask and the scores it was ranked by. The glue in
:mod:`verl_tokensel.verl_glue.install` sends both to the actor workers as per-token fields
(:data:`~verl_tokensel.verl_glue.loss.MASK_FIELD`, :data:`~verl_tokensel.verl_glue.loss.SCORE_FIELD`),
keyed by row, and the loss applies the mask as it is.

Scores are evaluated with the core registry AT THE OLD POLICY: ``log_prob = old_log_prob``, so the
ratio r = 1 and omega = A * 1[not clipped at r = 1] = A (r = 1 is inside every clip band), plus the KL
term's weight when a KL loss is on. ``gmts`` is then H_old * |A|, ``grad_norm`` |A| * ||e_a - p_old||.

Scopes (the pool the budget ``ceil(ratio * N)`` is taken from):

- ``batch``: every valid response token of the batch handed to one actor update;
- ``group``: the responses sharing a prompt (verl's ``uid``), each group keeps ``ceil(ratio * n_g)``;
- ``sequence``: each response keeps ``ceil(ratio * n_i)``.

Pure torch: :func:`select_on_driver` takes padded tensors and needs
neither Ray nor a worker, so it is unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from verl_tokensel.core.config import Selection
from verl_tokensel.core.batch import score_batch
from verl_tokensel.core.scores import grad_mass, score_params
from verl_tokensel.core.select import select_tokens, selection_stats

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
    *,
    response_mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    sum_pi_squared: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    row_keys: Optional[torch.Tensor] = None,
    group_ids: Optional[torch.Tensor] = None,
    row_valid: Optional[torch.Tensor] = None,
    external: Optional[Mapping[str, torch.Tensor]] = None,
    params: Optional[Mapping[str, Any]] = None,
) -> DriverSelection:
    """Score every response token of the batch at the old policy and select with ``sel``.

    Args:
        sel: the resolved rule (``sel.score_source`` should be ``rollout``; not checked here).
        response_mask: ``(batch, response_len)``, nonzero on valid response tokens.
        old_log_prob: old-policy log p(a_t), nats.
        advantages: per-token advantages.
        entropy: old-policy entropy (nats), for scores that need it.
        sum_pi_squared: old-policy sum_j p_j^2 (``grad_norm`` is exact with it, a lower bound without).
        ref_log_prob: reference log p(a_t), read only when ``params['kl_coef']`` > 0.
        rollout_is_weights: rollout-correction weights; they multiply the token loss, hence omega.
        row_keys: ``(batch,)`` int64 per-response keys (``random`` score).
        group_ids: ``(batch,)`` int64 prompt group of each row (``scope=group``), as
            :func:`verl_tokensel.core.batch.group_ids` makes them from verl's ``uid``.
        row_valid: ``(batch,)`` bool, False on synthetic padding rows (never selected, never counted).
        external: per-token fields a score declares in ``needs_external`` (e.g. ``ref_entropy``).
        params: clip/KL keyword arguments of :class:`ScoreInputs`, see :func:`score_params`.

    Returns:
        :class:`DriverSelection` with the mask, the float32 scores and ``tokensel/driver_*`` metrics.
    """
    sb = score_batch(
        sel.score,
        response_mask=response_mask,
        log_prob=old_log_prob.float(),
        advantages=advantages.float(),
        entropy=entropy.float() if entropy is not None else None,
        sum_pi_squared=sum_pi_squared,
        ref_log_prob=ref_log_prob,
        rollout_is_weights=rollout_is_weights,
        row_valid=row_valid,
        keys=row_keys,
        seed=sel.seed,
        external=external,
        params=params,
    )
    valid, inp = sb.valid, sb.inputs
    scores = sb.score(sel.score)
    mask = select_tokens(scores, valid, sel.ratio, scope=sel.scope, direction=sel.direction,
                         group_ids=group_ids if sel.scope == "group" else None, pool=sel.pool)

    stats = selection_stats(mask, valid, scores, entropy=entropy, grad_mass=grad_mass(sel.score, scores, inp))
    metrics = {DRIVER_METRIC_PREFIX + k: v for k, v in stats.items()}
    if sel.scope == "group" and group_ids is not None:
        metrics[DRIVER_METRIC_PREFIX + "groups"] = float(torch.unique(group_ids[valid.any(1)]).numel())
    return DriverSelection(mask=mask, scores=scores, metrics=metrics)


__all__ = [
    "DRIVER_METRIC_PREFIX",
    "DriverSelection",
    "score_params",
    "select_on_driver",
]
