"""``score_source=prepass``: score and select at the start of each PPO mini-batch, before its update.

The GMTS released code's timing (arXiv 2608.30632): one no-grad forward over the rank's mini-batch (or, where the
weights are those verl's old-log-prob pass measured, that pass's values) feeds the rule step over a pool wider than
one micro-batch: ``mini_batch`` (every data-parallel rank's mini-batch, exact), ``group`` (the responses of one
prompt, wherever they sit) or ``sequence``. The mask and the scores travel as per-token fields of the mini-batch
(:data:`~verl_tokensel.core.fields.MASK`, :data:`~verl_tokensel.core.fields.SCORE`), so the engine's micro-batching
keeps them on their rows; the selecting loss applies them. A score that reads no policy value (only fields fixed
before the update) never needs the forward.

Installed without editing verl: :func:`install_prepass` wraps ``train_batch`` of one ``TrainingWorker`` (reading the
rule from the worker's current :class:`~verl_tokensel.verl_glue.loss.SelectingLoss`), and
:func:`tokensel_worker_class` sets verl's ``actor_worker_cls`` on a subclass of the actor worker class so the wrap is
there in every Ray worker. Cost: one no-grad forward per mini-batch (none when the old pass is reused, or when the
score reads no policy value).
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
from verl_tokensel.core.dist_topk import global_group_ids
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.selection import Selection
from verl_tokensel.verl_glue.hidden import hidden_states_of, hidden_sweeps
from verl_tokensel.verl_glue.loss import METRIC_PREFIX, SelectingLoss
from verl_tokensel.verl_glue.micro_batch import assign_update_micro_batching, unpack_micro_batch
from verl_tokensel.verl_glue.no_graph import install_no_graph_scores

PREPASS_METRIC_PREFIX = METRIC_PREFIX + "prepass/"
_WRAPPED = "_tokensel_prepass_base_train_batch"
# per worker: updates and checkpoint loads so far, and that count at the last old-log-prob pass
_WEIGHTS_VERSION = "_tokensel_weights_version"
_INFER_AT = "_tokensel_infer_at_version"


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
    version = getattr(worker, _WEIGHTS_VERSION, None)
    if version is None or getattr(worker, _INFER_AT, None) != version:
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
        mb = unpack_micro_batch(config, sel, None, data)
    else:
        model_output = _forward_no_grad(worker, data, sel)
        if model_output is None:
            return {}
        mb = unpack_micro_batch(config, sel, model_output, data)
    response_mask = mb.response_mask
    dp_group = worker.engine.get_data_parallel_group()
    selected = apply_rule(sel, mb.scores, dp_group=dp_group, stats=False)
    mask, group_ids = selected.mask, mb.scores.group_ids

    rm = data[fields.RESPONSE_MASK]
    if data.is_locked:  # a chunk verl's dispatch produced; the fields must travel with the mini-batch
        data.unlock_()
    data[fields.MASK] = _as_response_field(mask.to(rm.dtype), rm)
    data[fields.SCORE] = _as_response_field(selected.scores, rm)
    if sel.normaliser == "kept":
        # the kept tokens are the loss's only tokens: verl's engine counts the mini-batch's token-mean denominator
        # (batch_num_tokens, all-reduced over the data-parallel ranks) from loss_mask; a new tensor, so
        # response_mask (which loss_mask may alias) keeps every valid token
        data["loss_mask"] = _as_response_field((mask & selected.loss_tokens).to(rm.dtype), rm)
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
    """Wrap ``worker.train_batch`` (one PPO mini-batch) with the selection's worker-side steps (idempotent).

    At each call, with the worker's CURRENT loss: the update pass's entropy / sum p^2 without an autograd graph
    when the loss's config allows it (:func:`verl_tokensel.verl_glue.no_graph.install_no_graph_scores`, on
    the worker's engine, installed at the first ``train_batch`` or ``infer_batch`` under a selecting loss, so
    the old-log-prob pass's entropy comes from the same function); and, when its selection has
    ``score_source=prepass``, :func:`prepass_select` on the mini-batch before it trains, its
    ``tokensel/prepass/*`` metrics added to the mini-batch's metrics. And ``train_mini_batch`` (the step's update)
    runs first, for a rule with ``Needs(hidden_states=...)``, its passes over the last hidden states
    (:func:`~verl_tokensel.verl_glue.hidden.hidden_sweeps`). Any other loss passes through untouched.
    """
    if getattr(worker, _WRAPPED, None) is not None:
        return worker
    base = worker.train_batch
    base_mini = worker.train_mini_batch
    base_infer = worker.infer_batch
    base_load = getattr(worker, "load_checkpoint", None)
    setattr(worker, _WEIGHTS_VERSION, 0)

    def train_batch(data: TensorDict, *args, **kwargs):
        if isinstance(worker.loss_fn, SelectingLoss):
            install_no_graph_scores(worker)
        config = _selecting_config(worker.loss_fn)
        try:
            if config is None:
                return base(data, *args, **kwargs)
            metrics = prepass_select(worker, data, config)
            output = base(data, *args, **kwargs)
        finally:  # the update changed the weights (or may have, if it failed)
            setattr(worker, _WEIGHTS_VERSION, getattr(worker, _WEIGHTS_VERSION) + 1)
        if output is not None and metrics:
            tu.get(output, "metrics").update(metrics)
        return output

    def train_mini_batch(data: TensorDict, *args, **kwargs):
        loss_fn = worker.loss_fn
        states = hidden_states_of(loss_fn.config) if isinstance(loss_fn, SelectingLoss) else None
        if states is None:
            return base_mini(data, *args, **kwargs)
        metrics = hidden_sweeps(worker, data, loss_fn.config, states)
        output = base_mini(data, *args, **kwargs)
        if output is not None:
            tu.get(output, "metrics").update({k: [v] for k, v in metrics.items()})
        return output

    def infer_batch(data: TensorDict, *args, **kwargs):
        if isinstance(worker.loss_fn, SelectingLoss):  # the old-log-prob pass's entropy: the selectors' function
            install_no_graph_scores(worker)
        with_adapter = not tu.get_non_tensor_data(data=data, key="no_lora_adapter", default=False)
        out = base_infer(data, *args, **kwargs)
        if with_adapter:  # the policy itself (verl's ref pass may run this worker with the adapter off)
            setattr(worker, _INFER_AT, getattr(worker, _WEIGHTS_VERSION))
        return out

    setattr(worker, _WRAPPED, base)
    worker.train_batch = train_batch
    worker.train_mini_batch = train_mini_batch
    worker.infer_batch = infer_batch
    if base_load is not None:
        def load_checkpoint(*args, **kwargs):
            setattr(worker, _WEIGHTS_VERSION, getattr(worker, _WEIGHTS_VERSION) + 1)
            return base_load(*args, **kwargs)

        worker.load_checkpoint = load_checkpoint
    return worker


class TokenselTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` with the pre-pass wrap installed (:func:`install_prepass`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install_prepass(self)


_WORKER_CLASSES: dict[type, type] = {}


def tokensel_worker_class(base: type) -> type:
    """A subclass of the actor worker class ``base`` whose actor ``TrainingWorker`` runs the pre-pass.

    ``base``: ``ActorRolloutRefWorker`` or a subclass of it (verl's separate-async trainer swaps in
    ``DetachActorWorker``); a Ray actor class (``ray.remote(...)``) is unwrapped. Only the class attribute
    ``actor_worker_cls`` changes, so every registered RPC of ``base`` stays as it is. Cached per base;
    the class is not a module attribute, so Ray ships it by value to the worker processes.
    """
    base = getattr(base, "__ray_actor_class__", base)
    if getattr(base, "_tokensel_prepass", False):
        return base
    if base not in _WORKER_CLASSES:
        inner = base.actor_worker_cls
        if inner is TrainingWorker:
            inner = TokenselTrainingWorker
        elif not issubclass(inner, TokenselTrainingWorker):  # a custom actor TrainingWorker: keep it, add the wrap
            inner = type(f"Tokensel{inner.__name__}", (TokenselTrainingWorker, inner), {"__module__": __name__})
        _WORKER_CLASSES[base] = type(
            f"Tokensel{base.__name__}",
            (base,),
            {"actor_worker_cls": inner, "_tokensel_prepass": True, "__module__": __name__,
             "__doc__": f"verl's {base.__name__} whose actor runs the token-selection pre-pass each mini-batch."},
        )
    return _WORKER_CLASSES[base]


def use_tokensel_workers(role_worker_mapping: dict) -> None:
    """Swap, in place, every actor worker class of a trainer's ``role_worker_mapping`` for its tokensel twin.

    Called after verl (or a trainer subclass such as separate-async) filled the mapping, so it composes
    with whatever class is there. Roles whose class has no ``actor_worker_cls`` (critic) are left alone.
    """
    import ray

    for role, remote_cls in list(role_worker_mapping.items()):
        cls = getattr(remote_cls, "__ray_actor_class__", remote_cls)
        if hasattr(cls, "actor_worker_cls") and not getattr(cls, "_tokensel_prepass", False):
            role_worker_mapping[role] = ray.remote(tokensel_worker_class(cls))


def selection_uses_tokensel_workers(config) -> bool:
    """Whether the (OmegaConf) trainer config selects at all: then the actor workers are the tokensel twins
    (the pre-pass for ``score_source=prepass``, the no-graph entropy for every selector)."""
    from verl_tokensel.verl_glue.actor_config import actor_selection

    return actor_selection(config) is not None


__all__ = [
    "PREPASS_METRIC_PREFIX",
    "TokenselTrainingWorker",
    "install_prepass",
    "prepass_select",
    "selection_uses_tokensel_workers",
    "tokensel_worker_class",
    "use_tokensel_workers",
]
