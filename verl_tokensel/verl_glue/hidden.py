"""The passes over the last hidden states a rule declares (``Needs(hidden_states=...)``), in verl's actor worker.

At the start of each step's update (``TrainingWorker.train_mini_batch``: this rank's share of the step's batch, the
advantages given, the weights still those of verl's old-log-prob pass), :func:`hidden_sweeps` runs the rule's
:class:`~verl_tokensel.core.rules.hidden.HiddenStates` passes: each is the engine's own forward-only path
(``engine.infer_batch`` with a per-micro-batch collector in place of a loss), during which a forward pre-hook on the
output layer (``lm_head``; Megatron's ``output_layer``) holds that micro-batch's input to it until the collector
has laid it out like the log-probs (gathered over Ulysses sequence parallel, padding dropped) and handed the valid
response tokens to the rule. Nothing of size ``[B, S, H]`` outlives a micro-batch. The last pass's per-token values
become the batch field :data:`~verl_tokensel.core.fields.HIDDEN`, which verl's mini-batching carries to every
mini-batch and epoch of the step; the loss hands them to the rule as ``x.hidden``.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding, response_to_nested

from verl_tokensel.core import fields
from verl_tokensel.core.rules.hidden import HiddenBatch, HiddenStates

#: the output layer's module name: HF causal LMs, Megatron's GPTModel
OUTPUT_LAYER_NAMES = ("lm_head", "output_layer")


def output_layer(engine) -> torch.nn.Module:
    """The engine's output layer (the module whose input is the last hidden state); a clear error if none."""
    modules = engine.module if isinstance(engine.module, (list, tuple)) else [engine.module]
    for chunk in reversed(modules):  # Megatron: the last virtual stage holds it
        for name, module in chunk.named_modules():
            if name.split(".")[-1] in OUTPUT_LAYER_NAMES:
                return module
    raise RuntimeError(
        f"token_selection's rule reads the last hidden states, but the actor model has no output layer named "
        f"{' or '.join(OUTPUT_LAYER_NAMES)} ({type(modules[-1]).__name__}): a model verl trains as a causal LM "
        "has one.")


class _Capture:
    """A forward pre-hook on the output layer holding its latest input (detached), while installed."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.value: Optional[torch.Tensor] = None
        self.calls = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.value = args[0].detach()
        self.calls += 1

    def take(self) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError(
                "token_selection's rule reads the last hidden states, but the output layer (lm_head) was not called "
                "in the forward: verl's fused kernels (actor_rollout_ref.model.use_fused_kernels=True) bypass it. "
                "Fix: set actor_rollout_ref.model.use_fused_kernels=False for this rule.")
        value, self.value = self.value, None
        return value

    def remove(self) -> None:
        self._handle.remove()


def packed_hidden(engine, hidden: torch.Tensor, micro_batch: TensorDict) -> torch.Tensor:
    """The captured output-layer input of one micro-batch as ``(total_nnz, H)``: the rows of the engine's nested
    log-probs (every token of every sequence, prompt included, in order)."""
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
    """verl's loss-function slot of a forward-only pass: each micro-batch's valid response tokens to the rule."""

    def __init__(self, engine, capture: _Capture, states: HiddenStates, sweep: int, values: Optional[torch.Tensor],
                 cache: Optional[list]) -> None:
        self.engine, self.capture, self.states, self.sweep = engine, capture, states, sweep
        self.values, self.cache, self.cached_bytes = values, cache, 0
        self.tokens = 0

    def __call__(self, model_output, data: TensorDict, dp_group=None):
        hidden = packed_hidden(self.engine, self.capture.take(), data)
        batch = response_tokens(hidden, model_output, data)
        self.tokens += batch.rows.numel()
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
    model_config, engine_config = worker.model_config, worker.engine_config
    defaults = dict(
        use_remove_padding=model_config.get("use_remove_padding", False),
        use_dynamic_bsz=engine_config.use_dynamic_bsz,
        max_token_len_per_gpu=engine_config.max_token_len_per_gpu,
        micro_batch_size_per_gpu=engine_config.micro_batch_size_per_gpu,
        use_fused_kernels=engine_config.use_fused_kernels,
    )
    tu.assign_non_tensor(probe, **{k: v for k, v in defaults.items() if k not in probe.keys()})
    return probe


def hidden_sweeps(worker, data: TensorDict, config, states_cls: type) -> dict[str, float]:
    """Run the rule's hidden-state passes over ``data`` (this rank's share of the step's batch) and write their
    per-token values as ``data[fields.HIDDEN]``. Collective over the engine's data-parallel group (every rank
    calls it for the same step). Returns the step's metrics (``tokensel/<rule>/...``)."""
    t0 = time.perf_counter()
    engine = worker.engine
    dp_group = engine.get_data_parallel_group()
    world = torch.distributed.get_world_size(dp_group) if torch.distributed.is_initialized() else 1
    sel = config.selection
    states: HiddenStates = states_cls(sel.knobs, dp_group=dp_group if world > 1 else None)
    probe = _probe(worker, data)
    rm = data[fields.RESPONSE_MASK]
    rm_padded = rm.to_padded_tensor(0) if rm.is_nested else rm
    values = torch.zeros(rm_padded.shape, dtype=torch.float32)
    cache: Optional[list] = [] if states.cache_bytes > 0 else None
    capture = _Capture(output_layer(engine))
    forwards = 0
    try:
        for i in range(states.sweeps):
            last = i == states.sweeps - 1
            out = values if last else None
            if i > 0 and cache is not None:
                collector = _Collector(engine, capture, states, i, out, None)
                for batch in cache:
                    collector._give(batch)
            else:
                collector = _Collector(engine, capture, states, i, out, cache if i == 0 else None)
                with engine.eval_mode():
                    engine.infer_batch(probe, loss_function=collector)
                forwards += 1
                if cache is not None and i == 0:
                    size = sum(b.hidden.numel() * b.hidden.element_size() for b in cache)
                    if size > states.cache_bytes:
                        cache = None  # over the budget: the other passes run their own forwards
            states.end_sweep(i)
    finally:
        capture.remove()
    values = states.finish(values, rm_padded.to(torch.bool))
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


__all__ = ["OUTPUT_LAYER_NAMES", "hidden_states_of", "hidden_sweeps", "output_layer", "packed_hidden",
           "response_tokens"]
