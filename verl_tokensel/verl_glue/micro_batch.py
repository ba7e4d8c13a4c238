"""An engine micro-batch (or a rank's mini-batch) as padded tensors and its score inputs.

verl's engines hand the loss nested (packed) ``log_probs`` / ``entropy`` and a micro-batch ``TensorDict`` whose
per-token fields are nested too; the selection works on padded ``(batch, response_len)`` tensors. The loss and the
pre-pass both unpack here, with the field names of :mod:`verl_tokensel.core.fields`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.batch import ScoreBatch, score_batch
from verl_tokensel.core.resolve.selection import Selection
from verl_tokensel.core.ranking.scores import score_params
from verl_tokensel.verl_glue.vocab import padded_vocab, vocab_stats


def assign_update_micro_batching(worker, data: TensorDict) -> None:
    """Give ``data`` (a forward-only pass over update data) the keys ``TrainingWorker.train_batch`` fills in, those
    ``data`` lacks: the update's micro-batching, which verl checked against the update's batches (not the old-log-prob
    pass's, set for the whole batch: a log-prob micro-batch larger than a mini-batch is valid in verl and would not
    divide it)."""
    model_config, engine_config = worker.model_config, worker.engine_config
    defaults = dict(
        use_remove_padding=model_config.get("use_remove_padding", False),
        use_dynamic_bsz=engine_config.use_dynamic_bsz,
        max_token_len_per_gpu=engine_config.max_token_len_per_gpu,
        micro_batch_size_per_gpu=engine_config.micro_batch_size_per_gpu,
        use_fused_kernels=engine_config.use_fused_kernels,
    )
    tu.assign_non_tensor(data, **{k: v for k, v in defaults.items() if k not in data.keys()})


def batch_uids(data: TensorDict):
    """verl's ``uid`` (prompt id) of each row of ``data``, for ``scope=group``; a clear error when absent."""
    if fields.UID not in data.keys():
        raise RuntimeError(
            f"token_selection.scope=group needs the '{fields.UID}' of each response in the update batch (the prompt "
            f"id verl's drivers attach to every rollout), and this mini-batch has none (keys: {sorted(data.keys())}). "
            "Fix: keep the uid field in the batch a custom trainer sends to update_actor, or use scope=mini_batch."
        )
    return data.get(fields.UID)


def _policy_outputs(model_output, data: TensorDict, padded: TensorDict):
    """``(log_prob, entropy, sum_pi_squared)`` padded: the engine's outputs, or (``model_output=None``) the
    old-log-prob pass's values carried by ``data``."""
    if model_output is None:
        return padded[fields.OLD_LOG_PROBS], padded.get(fields.ENTROPY, None), None
    out = [model_output.get(k, None) for k in (fields.LOG_PROBS, fields.ENTROPY, fields.SUM_PI_SQUARED)]
    return tuple(None if v is None else no_padding_2_padding(v, data) for v in out)


def unpack_micro_batch(config, sel: Selection, model_output, data: TensorDict, *, rank: bool = True,
                       extra_fields: tuple[str, ...] = ()) -> tuple[ScoreBatch, TensorDict]:
    """The engine's nested ``model_output`` and micro-batch ``data`` as padded tensors: their
    :func:`~verl_tokensel.core.ranking.batch.score_batch` (carrying the engine's log-prob and entropy with their
    autograd graph, for the loss) and the padded fields of ``data``.

    ``model_output=None``: the policy values are the old-log-prob pass's (``old_log_probs`` and, when present,
    ``entropy`` of ``data``): the pre-pass at the weights that pass measured.
    ``rank=False`` skips the row keys and group ids (the mask was measured before the update).
    ``extra_fields``: more per-token fields of ``data`` to pad (the pre-measured mask and scores).
    """
    names = [*fields.LOSS_INPUTS, *fields.OPTIONAL_LOSS_INPUTS, *extra_fields, fields.HIDDEN]
    if sel.needs_rollout_log_probs:
        names.append(fields.ROLLOUT_LOG_PROBS)
    if model_output is None:
        names.append(fields.ENTROPY)
    padded = data.select(*[k for k in names if k in data.keys()]).to_padded_tensor()
    response_mask = padded[fields.RESPONSE_MASK].to(torch.bool)
    log_prob, entropy, sum_pi_squared = _policy_outputs(model_output, data, padded)
    ids = attn = uids = None
    if rank:
        ids = data["input_ids"]
        if not getattr(ids, "is_nested", False) and "attention_mask" in data.keys():
            attn = data["attention_mask"]  # padded rows: hash only the real tokens
        if sel.scope == "group":
            uids = batch_uids(data)
    tensors = {k: padded.get(k, None) for k in (fields.OLD_LOG_PROBS, fields.ADVANTAGES, fields.ROLLOUT_IS_WEIGHTS,
                                                 fields.ROLLOUT_LOG_PROBS)}
    tensors.update({fields.RESPONSE_MASK: response_mask, fields.LOG_PROBS: log_prob, fields.ENTROPY: entropy,
                    fields.SUM_PI_SQUARED: sum_pi_squared})
    if config.use_kl_loss:  # read by the KL part of omega, and a finite input of the loss
        tensors[fields.REF_LOG_PROB] = padded.get(fields.REF_LOG_PROB, None)
    external = {fields.HIDDEN: padded[fields.HIDDEN]} if fields.HIDDEN in padded.keys() else {}
    stats = vocab_stats(config)
    if stats:  # the rule's per-token reductions over the vocabulary (verl_glue.vocab)
        external.update(padded_vocab(model_output, data, stats))
    sb = score_batch(sel.scores, tensors, input_ids=ids, attention_mask=attn, uids=uids, scope=sel.scope,
                     seed=sel.seed, params=score_params(config), external=external or None)
    sb.loss_log_prob, sb.loss_entropy = log_prob, entropy
    return sb, padded


__all__ = ["assign_update_micro_batching", "batch_uids", "unpack_micro_batch"]
