"""``score_source=prepass``: score and select at the start of each PPO mini-batch, before its update.

The GMTS released code's timing (arXiv 2608.30632): one no-grad forward over the rank's mini-batch (or, where the
weights are those verl's old-log-prob pass measured, that pass's values) feeds the rule step over a pool wider than
one micro-batch: ``mini_batch`` (every data-parallel rank's mini-batch, exact), ``group`` (the responses of one
prompt, wherever they sit) or ``sequence``. The mask and the scores travel as per-token fields of the mini-batch
(:data:`~verl_tokensel.core.fields.MASK`, :data:`~verl_tokensel.core.fields.SCORE`), so the engine's micro-batching
keeps them on their rows; the selecting loss applies them. A score that reads no policy value (only fields fixed
before the update) never needs the forward.

Installed without editing verl: :func:`install_prepass` puts the selection's worker-side steps on one
``TrainingWorker``, each from the module named for it: the pre-pass (here, around ``train_batch``, reading the rule
from the worker's current :class:`~verl_tokensel.verl_glue.loss.SelectingLoss`), the weight versions
(:mod:`~verl_tokensel.verl_glue.weight_versions`), the no-graph entropy (:mod:`~verl_tokensel.verl_glue.no_graph`) and
the hidden-state passes (:mod:`~verl_tokensel.verl_glue.hidden`); the actor worker classes that install them in every
Ray worker are :mod:`~verl_tokensel.verl_glue.workers`. Cost: one no-grad forward per mini-batch (none when the old
pass is reused, or when the score reads no policy value).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import response_to_nested

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.dist_topk import global_group_ids
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.resolve.selection import Selection
from verl_tokensel.verl_glue.hidden import install_hidden_passes
from verl_tokensel.verl_glue.loss import METRIC_PREFIX, SelectingLoss
from verl_tokensel.verl_glue.micro_batch import assign_update_micro_batching, unpack_micro_batch
from verl_tokensel.verl_glue.no_graph import install_no_graph_entropy
from verl_tokensel.verl_glue.vocab import install_vocab_reductions
from verl_tokensel.verl_glue.weight_versions import install_weight_versions, old_pass_is_current

PREPASS_METRIC_PREFIX = METRIC_PREFIX + "prepass/"
_WRAPPED = "_tokensel_prepass_base_train_batch"


def _selecting_config(loss_fn) -> Optional[Any]:
    """The actor config of the worker's :class:`SelectingLoss` when it selects by prepass, else None."""
    if not isinstance(loss_fn, SelectingLoss):
        return None
    sel = loss_fn.selection
    return loss_fn.config if sel is not None and sel.score_source == "prepass" else None


def old_pass_measured_these_weights(worker: TrainingWorker, data: TensorDict, config) -> bool:
    """Whether the old-log-prob pass of this step measured the weights the pre-pass would measure, and left
    everything the score needs in ``data``: then its values are used instead of a second forward.

    True when ``token_selection.prepass_reuse`` is on, this worker's last ``infer_batch`` (verl's
    ``compute_log_prob``, with the LoRA adapter on) came after its last update (``train_batch``) and after
    any checkpoint load (so: the first mini-batch of the first PPO epoch of a step, and every mini-batch
    when a step has one), and ``data`` carries that pass's ``old_log_probs`` and, for a score that needs it,
    its ``entropy``. A score that reads ``sum_pi_squared`` always gets the forward (the old pass's is not
    in the update batch). The decision is the same on every rank (same calls on each).

    A score that reads nothing of the policy (``ScoreSpec.reads_policy=False``: only fields fixed before the
    update, such as ``old_log_probs`` and ``rollout_log_probs``) takes these values at any weights, whatever
    ``prepass_reuse``: a forward would measure values it does not read.
    """
    sel = config.selection
    if not sel.score_reads_policy:
        return fields.OLD_LOG_PROBS in data.keys()
    if not getattr(config.token_selection, "prepass_reuse", True):
        return False
    if not old_pass_is_current(worker):  # verl_glue.weight_versions
        return False
    if sel.uses_sum_pi_squared or "old_log_probs" not in data.keys():
        return False
    return not sel.score_needs_entropy or fields.ENTROPY in data.keys()


def _as_response_field(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Padded ``(batch, max_resp)`` values laid out like ``response_mask`` (nested, or padded to its width)."""
    if response_mask.is_nested:
        return response_to_nested(values, response_mask)
    out = values.new_zeros(response_mask.shape)
    width = min(out.shape[1], values.shape[1])
    out[:, :width] = values[:, :width]
    return out


def _forward_no_grad(worker: TrainingWorker, data: TensorDict, sel: Selection) -> Optional[dict]:
    """The engine's forward-only path over ``data`` (a shallow copy; ``data`` is not changed).

    Returns the nested ``model_output`` (``log_probs``, ``entropy`` / ``sum_pi_squared`` when the score
    needs them), in ``data``'s row order, or None on a rank the engine gives no outputs (such a rank
    never runs the loss either). The engine is called directly rather
    than through ``TrainingWorker.infer_batch``, whose post-processing keeps the outputs on one
    sequence-parallel rank only, while every rank runs the loss.
    """
    probe = data.copy()
    tu.assign_non_tensor(
        probe,
        calculate_entropy=bool(sel.score_needs_entropy),
        calculate_sum_pi_squared=bool(sel.uses_sum_pi_squared),
        compute_loss=False,
    )
    engine = worker.engine
    assign_update_micro_batching(worker, probe)  # the data is one update mini-batch
    with engine.eval_mode(disable_auto_offload=True):
        out = engine.infer_batch(probe, loss_function=None)
    model_output = (out or {}).get("model_output") or {}
    return model_output if "log_probs" in model_output else None


def prepass_select(worker: TrainingWorker, data: TensorDict, config) -> dict[str, float]:
    """Score ``data`` (one rank's mini-batch) with a no-grad forward, select, write the per-token fields.

    ``config`` is the selecting actor config (its ``selection`` has ``score_source=prepass``). Collective
    over the engine's data-parallel group for ``mini_batch`` and ``group``: every rank must call it for
    the same mini-batch. Returns the metrics (``tokensel/prepass/*``), equal on every rank:
    ``selected_fraction`` (selected / valid tokens over all ranks), ``selected_tokens``, ``valid_tokens``,
    ``groups`` (group scope), ``seconds`` (this rank's forward + selection time) and ``reused_old_pass``
    (1 when the old-log-prob pass's values were used instead of a forward, see
    :func:`old_pass_measured_these_weights`).
    """
    sel: Selection = config.selection
    t0 = time.perf_counter()
    reused = old_pass_measured_these_weights(worker, data, config)
    if reused:
        batch, _ = unpack_micro_batch(config, sel, None, data)
    else:
        model_output = _forward_no_grad(worker, data, sel)
        if model_output is None:
            return {}
        batch, _ = unpack_micro_batch(config, sel, model_output, data)
    response_mask = batch.valid
    dp_group = worker.engine.get_data_parallel_group()
    selected = apply_rule(sel, batch, dp_group=dp_group, stats=False)
    mask, group_ids = selected.mask, batch.group_ids

    rm = data[fields.RESPONSE_MASK]
    if data.is_locked:  # a chunk verl's dispatch produced; the fields must travel with the mini-batch
        data.unlock_()
    data[fields.MASK] = _as_response_field(mask.to(rm.dtype), rm)
    data[fields.SCORE] = _as_response_field(selected.scores, rm)
    if sel.normaliser == "kept":
        # the kept tokens are the loss's only tokens: verl's engine counts the mini-batch's token-mean denominator
        # (batch_num_tokens, all-reduced over the data-parallel ranks) from loss_mask; a new tensor, so
        # response_mask (which loss_mask may alias) keeps every valid token
        data["loss_mask"] = _as_response_field((mask & selected.tokens).to(rm.dtype), rm)
    seconds = time.perf_counter() - t0

    counts = torch.stack([mask.sum(), response_mask.sum()]).to(torch.float64)
    world = torch.distributed.get_world_size(dp_group) if torch.distributed.is_initialized() else 1
    if world > 1:
        torch.distributed.all_reduce(counts, group=dp_group)
    n_sel, n_valid = float(counts[0]), float(counts[1])
    metrics = {
        PREPASS_METRIC_PREFIX + "selected_fraction": n_sel / n_valid if n_valid else 0.0,
        PREPASS_METRIC_PREFIX + "selected_tokens": n_sel,
        PREPASS_METRIC_PREFIX + "valid_tokens": n_valid,
        PREPASS_METRIC_PREFIX + "seconds": seconds,
        PREPASS_METRIC_PREFIX + "reused_old_pass": float(reused),
    }
    if group_ids is not None:
        metrics[PREPASS_METRIC_PREFIX + "groups"] = float(global_group_ids(group_ids, dp_group, world).numel())
    return metrics


def install_prepass(worker: TrainingWorker) -> TrainingWorker:
    """Put the selection's worker-side steps on ``worker`` (idempotent; what every tokensel actor worker runs,
    :class:`~verl_tokensel.verl_glue.workers.TokenselTrainingWorker`). Each reads the worker's CURRENT loss at each
    call; any other loss passes through them untouched:

    - the pre-pass: ``train_batch`` (one PPO mini-batch) runs :func:`prepass_select` before it trains when the
      selection has ``score_source=prepass``, its ``tokensel/prepass/*`` metrics added to the mini-batch's;
    - the weight versions the pre-pass's reuse reads
      (:func:`~verl_tokensel.verl_glue.weight_versions.install_weight_versions`);
    - the update pass's entropy / sum p^2 without an autograd graph, installed on the worker's engine at the first
      ``train_batch`` or ``infer_batch`` under a selecting loss, so the old-log-prob pass's entropy comes from the
      same function (:func:`~verl_tokensel.verl_glue.no_graph.install_no_graph_entropy`);
    - before ``train_mini_batch`` (the step's update), a rule's passes over the last hidden states
      (:func:`~verl_tokensel.verl_glue.hidden.install_hidden_passes`);
    - a rule's per-token reductions over the vocabulary, in the old-log-prob pass and the update forward
      (:func:`~verl_tokensel.verl_glue.vocab.install_vocab_reductions`).

    ``train_batch`` runs them in this order: the no-graph install, then the pre-pass and the update, then the
    version's rise (also when the update fails).
    """
    _install_prepass_step(worker)  # innermost: the version rises after the pre-pass and the update
    install_weight_versions(worker)
    install_no_graph_entropy(worker)
    install_hidden_passes(worker)
    install_vocab_reductions(worker)  # outermost: its engine wrap goes in before the no-graph one
    return worker


def _install_prepass_step(worker: TrainingWorker) -> None:
    """Wrap ``worker.train_batch`` with :func:`prepass_select` for a selection with ``score_source=prepass``."""
    if getattr(worker, _WRAPPED, None) is not None:
        return
    base = worker.train_batch

    def train_batch(data: TensorDict, *args, **kwargs):
        config = _selecting_config(worker.loss_fn)
        if config is None:
            return base(data, *args, **kwargs)
        metrics = prepass_select(worker, data, config)
        output = base(data, *args, **kwargs)
        if output is not None and metrics:
            tu.get(output, "metrics").update(metrics)
        return output

    setattr(worker, _WRAPPED, base)
    worker.train_batch = train_batch


__all__ = [
    "PREPASS_METRIC_PREFIX",
    "install_prepass",
    "old_pass_measured_these_weights",
    "prepass_select",
]
