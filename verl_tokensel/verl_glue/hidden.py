"""The passes over the last hidden states a rule declares (``Needs(hidden_states=...)``), in verl's actor worker.

At the start of each step's update (``TrainingWorker.train_mini_batch``: this rank's share of the step's batch, the
advantages given, the weights still those of verl's old-log-prob pass; wrapped by :func:`install_hidden_passes`),
:func:`hidden_sweeps` runs the rule's :class:`~verl_tokensel.core.seam.hidden.HiddenStates` passes: each is the
engine's own forward-only path (``engine.infer_batch`` with a per-micro-batch collector in place of a loss), during
which a forward pre-hook on the output layer (``lm_head``; Megatron's ``output_layer``) holds that micro-batch's
input to it until the collector has laid it out like the log-probs (:func:`packed_hidden`: gathered over Ulysses or
Megatron's tensor-parallel sequence parallelism and context parallelism, padding dropped, by verl's own functions
where verl maps the logits) and handed the valid response tokens to the rule. Nothing of size ``[B, S, H]`` outlives
a micro-batch. The last pass's per-token values become the batch field :data:`~verl_tokensel.core.fields.HIDDEN`,
which verl's mini-batching carries to every mini-batch and epoch of the step; the loss hands them to the rule as
``x.hidden``.

On the Megatron engine the collector runs where verl runs a loss: every tensor-parallel (and context-parallel) rank
of the last pipeline stage; each computes the rule's values over the gathered hidden states, and the rule's
collectives run over the data-parallel group of that stage. The earlier pipeline stages hold no output layer and
never run the loss: they take part in every forward of the passes (the pipeline's send and receive) and call none
of the rule's methods; the field holds ones there. Megatron's dynamic context parallelism (which moves samples
between data-parallel ranks) is refused with a clear error.
"""

from __future__ import annotations

import inspect
import time
from typing import Optional

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.utils.padding import no_padding_2_padding, response_to_nested

from verl_tokensel.core import fields
from verl_tokensel.core.seam.hidden import HiddenBatch, HiddenStates
from verl_tokensel.verl_glue.errors import config_error_at
from verl_tokensel.verl_glue.loss import SelectingLoss
from verl_tokensel.verl_glue.micro_batch import assign_update_micro_batching

#: the output layer's module name: HF causal LMs, Megatron's GPTModel
OUTPUT_LAYER_NAMES = ("lm_head", "output_layer")
_WRAPPED = "_tokensel_hidden_base_train_mini_batch"


def is_megatron(engine) -> bool:
    """Whether ``engine`` is verl's Megatron engine (or a subclass of it); no megatron import."""
    return any(c.__module__.startswith("verl.workers.engine.megatron") for c in type(engine).__mro__)


def _find_output_layer(engine) -> Optional[tuple[torch.nn.Module, torch.nn.Module]]:
    """The output layer and the model holding it (its parent module), or None."""
    modules = engine.module if isinstance(engine.module, (list, tuple)) else [engine.module]
    for chunk in reversed(modules):  # Megatron: the last virtual stage holds it
        for name, module in chunk.named_modules():
            if name.split(".")[-1] in OUTPUT_LAYER_NAMES:
                parent = chunk.get_submodule(name.rpartition(".")[0]) if "." in name else chunk
                return module, parent
    return None


def output_layer(engine) -> Optional[torch.nn.Module]:
    """The engine's output layer (the module whose input is the last hidden state), or None on a Megatron rank of an
    earlier pipeline stage (which has none); a clear error for a model without one."""
    found = _find_output_layer(engine)
    if found is not None:
        return found[0]
    if is_megatron(engine):
        from megatron.core import parallel_state as mpu

        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return None
    modules = engine.module if isinstance(engine.module, (list, tuple)) else [engine.module]
    raise RuntimeError(
        f"token_selection's rule reads the last hidden states, but the actor model has no output layer named "
        f"{' or '.join(OUTPUT_LAYER_NAMES)} ({type(modules[-1]).__name__}): a model verl trains as a causal LM "
        "has one.")


class _Capture:
    """Forward pre-hooks holding, while installed, the output layer's latest input (detached) and, on Megatron, the
    arguments of the latest call of the model holding it (``packed_seq_params`` / ``attention_mask``: the packing
    the engine chose for that micro-batch, so that the hidden states are unpacked exactly like the logits)."""

    def __init__(self, engine) -> None:
        layer, model = _find_output_layer(engine)
        self.layer = layer
        self.value: Optional[torch.Tensor] = None
        self.call: dict = {}
        self._handles = [layer.register_forward_pre_hook(self._hook)]
        if is_megatron(engine):
            self._params = inspect.signature(model.forward).parameters
            self._handles.append(model.register_forward_pre_hook(self._model_hook, with_kwargs=True))

    def _hook(self, module, args):
        self.value = args[0].detach()

    def _model_hook(self, module, args, kwargs):
        call = dict(zip(self._params, args))  # positional arguments by the forward's parameter names
        call.update(kwargs)
        self.call = call

    def take(self) -> tuple[torch.Tensor, dict]:
        if self.value is None:
            raise config_error_at(  # the driver refuses it first (install.validate_driver_config)
                "actor_rollout_ref.model.use_fused_kernels", True, "False",
                "token_selection's rule reads the last hidden states, but the output layer was not called in the "
                "forward: verl's fused kernels bypass it. Fix: actor_rollout_ref.model.use_fused_kernels=False.")
        value, self.value = self.value, None
        call, self.call = self.call, {}
        return value, call

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _megatron_hidden(layer: torch.nn.Module, hidden: torch.Tensor, micro_batch: TensorDict,
                     call: dict) -> torch.Tensor:
    """Megatron's output-layer input (sequence first: ``[T, 1, H]`` packed ``thd``, ``[s, b, H]`` ``bshd``; this
    tensor-parallel rank's slice along the sequence under sequence parallelism, this context-parallel rank's chunks
    under context parallelism) as the rows of the nested log-probs, by verl's own unpacking of the logits
    (``postprocess_thd_engine`` / ``postprocess_bshd_engine``, which gather over context parallelism)."""
    from verl.models.mcore.util import postprocess_bshd_engine, postprocess_thd_engine

    if getattr(layer, "sequence_parallel", False):  # ColumnParallelLinear gathers its input itself: do the same
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                      group=getattr(layer, "tp_group", None))
    h = hidden.transpose(0, 1).contiguous()  # [b, s, H], as the logits reach verl's postprocess
    input_ids = micro_batch["input_ids"]
    packed = call.get("packed_seq_params")
    if packed is not None:
        nested = postprocess_thd_engine(
            h, packed, input_ids, input_ids.shape[0], post_process=True,
            local_cp_size=tu.get_non_tensor_data(data=micro_batch, key="local_cp_size", default=None),
            cp_layout=getattr(packed, "cp_partition_mode", None) or "zigzag")
    else:
        mask = call.get("attention_mask")
        if mask is None:
            raise RuntimeError("token_selection's rule reads the last hidden states, but the Megatron model was "
                               "called with neither packed_seq_params (thd) nor attention_mask (bshd)")
        nested = postprocess_bshd_engine(h, mask, post_process=True)
    return nested.values()


def packed_hidden(engine, hidden: torch.Tensor, micro_batch: TensorDict, call: Optional[dict] = None,
                  layer: Optional[torch.nn.Module] = None) -> torch.Tensor:
    """The captured output-layer input of one micro-batch as ``(total_nnz, H)``: the rows of the engine's nested
    log-probs (every token of every sequence, prompt included, in order).

    FSDP: remove-padding's packed ``(1, L, H)`` (gathered over Ulysses) or padded ``(b, s, H)``. Megatron
    (``call``: the model's arguments for the micro-batch, ``layer``: its output layer): see
    :func:`_megatron_hidden`."""
    if is_megatron(engine):
        return _megatron_hidden(layer, hidden, micro_batch, call or {})
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets()
    nnz = int(offsets[-1])
    use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    if use_rmpad:
        h = hidden.reshape(-1, hidden.shape[-1])  # (1, L, H): one packed row, this sequence-parallel rank's slice
        sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
        if sp > 1:
            from verl.utils.ulysses import gather_outputs_and_unpad

            return gather_outputs_and_unpad(h, gather_dim=0, unpad_dim=0, padding_size=h.shape[0] * sp - nnz)
        return h[:nnz]
    lengths = offsets.diff()  # (b, s, H) right-padded rows
    keep = torch.arange(hidden.shape[1], device=hidden.device) < lengths.to(hidden.device).unsqueeze(1)
    return hidden[keep]


class _Collector:
    """verl's loss-function slot of a forward-only pass: each micro-batch's valid response tokens to the rule.

    Both engines call it as ``loss_function(model_output=..., data=micro_batch, dp_group=...)`` and read back
    ``(loss, metrics)``; Megatron only on the last pipeline stage (every tensor- and context-parallel rank there)."""

    def __init__(self, engine, capture: _Capture, states: HiddenStates, sweep: int, values: Optional[torch.Tensor],
                 cache: Optional[list]) -> None:
        self.engine, self.capture, self.states, self.sweep = engine, capture, states, sweep
        self.values, self.cache = values, cache

    def __call__(self, model_output, data: TensorDict, dp_group=None):
        captured, call = self.capture.take()
        hidden = packed_hidden(self.engine, captured, data, call=call, layer=self.capture.layer)
        batch = response_tokens(hidden, model_output, data)
        self._give(batch)
        if self.cache is not None:
            self.cache.append(batch)
        return torch.zeros((), device=hidden.device), {}

    def _give(self, batch: HiddenBatch) -> None:
        out = self.states.sweep(self.sweep, batch)
        if self.values is not None:
            if out is None or out.shape != batch.rows.shape:
                raise RuntimeError(f"{type(self.states).__name__}.sweep must return one value per token in its last "
                                   f"pass ({tuple(batch.rows.shape)}), got {None if out is None else tuple(out.shape)}")
            self.values[batch.rows, batch.cols] = out.to(self.values.dtype)


def response_tokens(hidden: torch.Tensor, model_output, data: TensorDict) -> HiddenBatch:
    """The valid response tokens of one micro-batch: their hidden states, log-probs, advantages, rows, columns."""
    h = no_padding_2_padding(hidden, data)  # (b, R, H): transient, this micro-batch only
    log_prob = no_padding_2_padding(model_output[fields.LOG_PROBS], data).float()
    padded = data.select(fields.RESPONSE_MASK, fields.ADVANTAGES).to_padded_tensor()
    width = min(h.shape[1], log_prob.shape[1], padded[fields.RESPONSE_MASK].shape[1])
    valid = padded[fields.RESPONSE_MASK][:, :width].to(torch.bool).to(h.device)
    row_idx, cols = valid.nonzero(as_tuple=True)
    rows = data[fields.ROW].to(h.device)[row_idx]
    return HiddenBatch(hidden=h[:, :width][valid], log_prob=log_prob[:, :width][valid],
                       advantages=padded[fields.ADVANTAGES][:, :width].to(h.device).float()[valid],
                       rows=rows, cols=cols)


def _probe(worker, data: TensorDict) -> TensorDict:
    """A shallow copy of the step's batch for the forward-only passes, with each row's index and the update's
    micro-batching (verl checked it against this batch)."""
    probe = data.copy()
    if probe.is_locked:
        probe.unlock_()
    probe[fields.ROW] = torch.arange(data.batch_size[0])
    tu.assign_non_tensor(probe, calculate_entropy=False, calculate_sum_pi_squared=False, compute_loss=False)
    assign_update_micro_batching(worker, probe)
    return probe


def _pipeline_group(engine):
    """Megatron's pipeline-parallel group when it has more than one stage, else None."""
    if not is_megatron(engine):
        return None
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_group() if mpu.get_pipeline_model_parallel_world_size() > 1 else None


def _device() -> torch.device:
    """The accelerator verl's collectives take tensors on (the CPU when there is none)."""
    name = get_device_name()
    return torch.device(name) if name == "cpu" else torch.device(name, get_device_id())


def _fits_everywhere(size: float, budget: float, engine, dp_group, world: int) -> bool:
    """Whether the largest cache of every rank that runs the passes fits ``budget``: the same answer on every rank
    (the maximum over the data-parallel group, then over the pipeline stages, whose earlier ones hold nothing), so
    that every rank runs the same number of forwards (their collectives and the pipeline's send/receive pair up)."""
    largest = torch.tensor([float(size)], dtype=torch.float64, device=_device())
    if world > 1:
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    pipeline = _pipeline_group(engine)
    if pipeline is not None:
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=pipeline)
    return float(largest) <= budget


def hidden_sweeps(worker, data: TensorDict, config, states_cls: type) -> dict[str, float]:
    """Run the rule's hidden-state passes over ``data`` (this rank's share of the step's batch) and write their
    per-token values as ``data[fields.HIDDEN]``. Collective over the engine's data-parallel group (every rank
    calls it for the same step). Returns the step's metrics (``tokensel/<rule>/...``).

    Megatron: on a rank of an earlier pipeline stage (no output layer, no loss) it runs the same forwards, calls
    none of the rule's methods and writes ones; the step's metrics come from the last stage."""
    t0 = time.perf_counter()
    engine = worker.engine
    if is_megatron(engine) and getattr(engine.engine_config, "dynamic_context_parallel", False):
        raise config_error_at(
            "actor_rollout_ref.actor.megatron.dynamic_context_parallel", True, "False",
            f"token_selection rule {config.selection.rule!r} reads the last hidden states, which is not supported "
            "with Megatron's dynamic context parallelism (it moves samples between data-parallel ranks). Fix: "
            "actor_rollout_ref.actor.megatron.dynamic_context_parallel=False.")
    dp_group = engine.get_data_parallel_group()
    world = torch.distributed.get_world_size(dp_group) if torch.distributed.is_initialized() else 1
    sel = config.selection
    states: HiddenStates = states_cls(sel.knobs, dp_group=dp_group if world > 1 else None)
    probe = _probe(worker, data)
    rm = data[fields.RESPONSE_MASK]
    rm_padded = rm.to_padded_tensor(0) if rm.is_nested else rm
    values = torch.zeros(rm_padded.shape, dtype=torch.float32)
    outputs_here = output_layer(engine) is not None  # Megatron: False on the earlier pipeline stages
    use_cache = states.cache_bytes > 0
    cache: Optional[list] = [] if use_cache and outputs_here else None
    capture = _Capture(engine) if outputs_here else None
    forwards = 0
    try:
        for i in range(states.sweeps):
            last = i == states.sweeps - 1
            out = values if last else None
            if i > 0 and use_cache:
                if outputs_here:
                    collector = _Collector(engine, capture, states, i, out, None)
                    for batch in cache:
                        collector._give(batch)
            else:
                collector = _Collector(engine, capture, states, i, out, cache) if outputs_here else None
                with engine.eval_mode():
                    engine.infer_batch(probe, loss_function=collector)
                forwards += 1
                if use_cache and i == 0:
                    size = sum(b.hidden.numel() * b.hidden.element_size() for b in cache) if outputs_here else 0
                    use_cache = _fits_everywhere(size, states.cache_bytes, engine, dp_group, world)
                    if not use_cache:
                        cache = None  # over the budget somewhere: the other passes run their own forwards
            if outputs_here:
                states.end_sweep(i)
    finally:
        if capture is not None:
            capture.remove()
    if outputs_here:
        values = states.finish(values, rm_padded.to(torch.bool))
    else:  # the loss never runs on this rank; the batch carries the field on every rank all the same
        values = torch.ones_like(values)
    if data.is_locked:
        data.unlock_()
    data[fields.HIDDEN] = response_to_nested(values, rm) if rm.is_nested else values.to(rm.device)
    prefix = f"tokensel/{sel.rule}/"
    metrics = {prefix + k: float(v) for k, v in states.metrics.items()}
    metrics[prefix + "forwards"] = float(forwards)
    metrics[prefix + "sweep_seconds"] = time.perf_counter() - t0
    return metrics


def hidden_states_of(config) -> Optional[type]:
    """The :class:`HiddenStates` class the worker's selecting actor config's rule declares, or None."""
    sel = getattr(config, "selection", None) if config is not None else None
    return None if sel is None else sel.impl.needs.hidden_states


def install_hidden_passes(worker):
    """Wrap ``worker.train_mini_batch`` (the step's update on this rank; idempotent): with the worker's CURRENT loss,
    a selecting loss whose rule declares ``Needs(hidden_states=...)`` gets its passes (:func:`hidden_sweeps`) before
    the update, their metrics added to the update's. Any other loss passes through untouched."""
    if getattr(worker, _WRAPPED, None) is not None:
        return worker
    base = worker.train_mini_batch

    def train_mini_batch(data: TensorDict, *args, **kwargs):
        loss_fn = worker.loss_fn
        states = hidden_states_of(loss_fn.config) if isinstance(loss_fn, SelectingLoss) else None
        if states is None:
            return base(data, *args, **kwargs)
        metrics = hidden_sweeps(worker, data, loss_fn.config, states)
        output = base(data, *args, **kwargs)
        if output is not None:
            tu.get(output, "metrics").update({k: [v] for k, v in metrics.items()})
        return output

    setattr(worker, _WRAPPED, base)
    worker.train_mini_batch = train_mini_batch
    return worker


__all__ = ["OUTPUT_LAYER_NAMES", "hidden_states_of", "hidden_sweeps", "install_hidden_passes", "is_megatron",
           "output_layer", "packed_hidden", "response_tokens"]
