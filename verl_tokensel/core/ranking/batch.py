"""The one builder of a batch's score inputs: padded :class:`ScoreInputs`, row keys and group ids. Pure torch.

Every place that ranks tokens (the loss, the pre-pass, the driver, ``view``, ``analyze`` and the demo) calls
:func:`score_batch`, so a score evaluated for analysis is the score training ranks by, on the same inputs:

- ``valid`` = ``response_mask`` and, when given, ``row_valid`` (synthetic padding rows are never ranked);
- ``advantages`` are multiplied by ``rollout_is_weights`` when given (the weight multiplies the token loss,
  hence its gradient weight omega);
- the inputs are a mapping keyed by :mod:`~verl_tokensel.core.fields` names; the scored policy (``log_probs``)
  defaults to ``old_log_probs`` (on-policy: the driver's old-policy pass, the analysis tools);
- ``finite`` marks the tokens whose loss inputs are all finite (the rule step drops the others);
- row keys (``random`` score): :func:`row_keys` of the full token ids of each response (prompt and response,
  no padding), the same int64 on every rank, split and rerun; computed only when a requested score needs them;
- group ids (``scope=group``): :func:`group_ids` of verl's ``uid`` (a 64-bit BLAKE2b of its text), equal on
  every rank and rerun; computed only for that scope.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.scores import (
    SCORE_REGISTRY,
    ScoreInputs,
    compute_score,
    row_keys_from_packed,
    row_keys_from_tokens,
)

TokenRows = Union[torch.Tensor, Sequence[torch.Tensor], Sequence[Sequence[int]]]


def row_keys(input_ids: TokenRows, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(batch,)`` int64 key per response from its full token ids.

    ``input_ids``: a nested (jagged) tensor, a padded ``(batch, seq)`` tensor (with ``attention_mask``: only the
    real tokens are hashed), or a list of 1-D token rows. A nested row and the same tokens padded, or given as
    a list, get the same key.
    """
    if isinstance(input_ids, torch.Tensor):
        if getattr(input_ids, "is_nested", False):
            return row_keys_from_packed(input_ids.values(), input_ids.offsets())
        if attention_mask is not None:
            attn = attention_mask.to(torch.bool)
            return row_keys_from_tokens([input_ids[i][attn[i]] for i in range(input_ids.shape[0])])
        return row_keys_from_tokens(list(input_ids.unbind(0)))
    return row_keys_from_tokens([r if isinstance(r, torch.Tensor) else torch.tensor(list(r), dtype=torch.long)
                                 for r in input_ids])


def group_ids(uids: Any) -> torch.Tensor:
    """``(batch,)`` int64 group id per row from verl's ``uid`` (the prompt's id), equal on every rank and rerun.

    A 64-bit BLAKE2b of the uid's text: rows of one prompt get one id whichever rank holds them (Python's
    ``hash`` is salted per process, so it cannot be used); distinct prompts collide with probability
    ~ n^2 / 2^64. An integer tensor is taken as ids already.
    """
    if isinstance(uids, torch.Tensor) and not uids.is_nested and not uids.is_floating_point():
        return uids.to(torch.int64).flatten()
    values = uids.tolist() if hasattr(uids, "tolist") else list(uids)
    out = [int.from_bytes(hashlib.blake2b(str(u).encode(), digest_size=8).digest(), "little", signed=True)
           for u in values]
    return torch.tensor(out, dtype=torch.int64)


@dataclass
class ScoreBatch:
    """What :func:`score_batch` returns.

    Attributes:
        inputs: the padded :class:`ScoreInputs` (``response_mask`` is ``valid``).
        valid: ``(batch, response_len)`` bool, the tokens that may be ranked.
        finite: ``(batch, response_len)`` bool, False on a valid token with a non-finite loss input
            (:data:`~verl_tokensel.core.fields.FINITE_INPUTS`); such a token is dropped by the rule step.
        group_ids: ``(batch,)`` int64 or None (only for ``scope=group``).
        advantages: the advantages as given (``inputs.advantages`` carries the ``rollout_is_weights`` product),
            for a rule that shapes them; None when none were given.
        is_weights: the ``rollout_is_weights`` given, or None.
        loss_log_prob / loss_entropy: in the loss, the update forward's log-prob and entropy with their autograd
            graph (``inputs`` holds detached copies); None elsewhere.
    """

    inputs: ScoreInputs
    valid: torch.Tensor
    finite: torch.Tensor
    group_ids: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None
    loss_log_prob: Optional[torch.Tensor] = None
    loss_entropy: Optional[torch.Tensor] = None

    def score(self, name: str) -> torch.Tensor:
        """The registered score ``name`` (float32, detached), 0 off ``valid``."""
        s = compute_score(name, self.inputs).float()
        return torch.where(self.valid, s, torch.zeros_like(s))


def score_batch(
    score: Union[str, Sequence[str]],
    tensors: Mapping[str, Optional[torch.Tensor]],
    *,
    row_valid: Optional[torch.Tensor] = None,
    input_ids: Optional[TokenRows] = None,
    attention_mask: Optional[torch.Tensor] = None,
    keys: Optional[torch.Tensor] = None,
    uids: Any = None,
    groups: Optional[torch.Tensor] = None,
    scope: Optional[str] = None,
    seed: int = 0,
    external: Optional[Mapping[str, torch.Tensor]] = None,
    params: Optional[Mapping[str, Any]] = None,
) -> ScoreBatch:
    """The score inputs of one batch of padded ``(batch, response_len)`` tensors.

    Args:
        score: the score name(s) that will be evaluated (row keys are hashed only if one needs them).
        tensors: padded per-token tensors keyed by :mod:`~verl_tokensel.core.fields` names: ``response_mask``
            (required), ``log_probs`` (the policy scored; default ``old_log_probs``: on-policy) and/or
            ``old_log_probs``, and optionally ``advantages`` (default 0), ``entropy``, ``sum_pi_squared``,
            ``ref_log_prob``, ``rollout_log_probs`` (the rollout engine's), ``rollout_is_weights`` (multiplied into
            the advantages: the weight multiplies the token loss, hence omega), ``logit_grad_norm``. A None value
            counts as absent.
        row_valid: ``(batch,)`` bool, False on synthetic padding rows.
        input_ids / attention_mask: the rows' full token ids, for :func:`row_keys`; ``keys`` gives them directly.
        uids: verl's ``uid`` of each row, for :func:`group_ids` (``scope=group`` only); ``groups`` gives the ids.
        scope: the selection scope (``group`` builds group ids).
        seed: the ``random`` score's seed.
        external: per-token fields a score declares in ``needs_external``.
        params: clip/KL keyword arguments of :class:`ScoreInputs` (``score_params``).
    """
    names = (score,) if isinstance(score, str) else tuple(score)
    for name in names:
        if name not in SCORE_REGISTRY:
            raise ValueError(f"unknown score {name!r}; valid: {sorted(SCORE_REGISTRY)}")
    t = {k: v for k, v in tensors.items() if v is not None}
    if fields.LOG_PROBS not in t and fields.OLD_LOG_PROBS not in t:
        raise ValueError(f"score_batch needs {fields.LOG_PROBS!r} or {fields.OLD_LOG_PROBS!r}; got {sorted(t)}")
    valid = t[fields.RESPONSE_MASK].to(torch.bool)
    if row_valid is not None:
        valid = valid & row_valid.to(device=valid.device, dtype=torch.bool).view(-1, 1)
    log_prob = t.get(fields.LOG_PROBS, t.get(fields.OLD_LOG_PROBS)).detach()
    adv = t.get(fields.ADVANTAGES, torch.zeros_like(log_prob))
    if fields.ROLLOUT_IS_WEIGHTS in t:
        adv = adv.float() * t[fields.ROLLOUT_IS_WEIGHTS].float()
    entropy = t.get(fields.ENTROPY)
    inp = ScoreInputs(
        log_prob=log_prob,
        response_mask=valid,
        entropy=entropy.detach() if entropy is not None else None,
        old_log_prob=t.get(fields.OLD_LOG_PROBS, log_prob),
        rollout_log_prob=t.get(fields.ROLLOUT_LOG_PROBS),
        advantages=adv,
        sum_pi_squared=t.get(fields.SUM_PI_SQUARED),
        logit_grad_norm=t.get(fields.LOGIT_GRAD_NORM),
        ref_log_prob=t.get(fields.REF_LOG_PROB),
        seed=seed,
        external=dict(external or {}),
        **dict(params or {}),
    )
    if any(SCORE_REGISTRY[n].needs_row_keys for n in names):
        if keys is None and input_ids is not None:
            keys = row_keys(input_ids, attention_mask)
        inp.row_keys = keys.to(log_prob.device) if keys is not None else None
    if groups is None and scope == "group" and uids is not None:
        groups = group_ids(uids)
    if groups is not None:
        groups = groups.to(log_prob.device)
    finite = torch.ones_like(valid)
    for name in fields.FINITE_INPUTS:
        if name in t:
            finite &= torch.isfinite(t[name].detach())
    return ScoreBatch(inputs=inp, valid=valid, finite=finite | ~valid, group_ids=groups,
                      advantages=t.get(fields.ADVANTAGES), is_weights=t.get(fields.ROLLOUT_IS_WEIGHTS))


def pad_rows(rows: Sequence[torch.Tensor], fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response 1-D tensors as one padded ``(batch, max_len)`` float32 tensor and its bool valid mask."""
    width = max([int(r.numel()) for r in rows] + [1])
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = int(r.numel())
        out[i, :n] = r.float()
        valid[i, :n] = True
    return out, valid


__all__ = ["ScoreBatch", "group_ids", "pad_rows", "row_keys", "score_batch"]
