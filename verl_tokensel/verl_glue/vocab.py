"""The per-token vocabulary reductions a rule declares (``Needs(vocab=...)``), in verl's FSDP and Megatron engines.

Where (FSDP/FSDP2): the engine's ``prepare_model_outputs`` (wrapped by :func:`install_vocab_engine`), at the one call of
``logprobs_from_logits`` on the temperature-scaled logits, rows = tokens (remove-padding's packed rows, this Ulysses
rank's slice; or the padded path's valid rows). The reductions
(:func:`~verl_tokensel.core.seam.vocab.reduce_rows`) run in chunks of rows there, and their per-row values are laid
out like verl's log-probs (gathered over Ulysses, padding dropped, by verl's own ``_gather_and_unpad_packed``).

When:
- ``VocabStat(forward="old")``: in verl's old-log-prob pass (``TrainingWorker.infer_batch`` with ``compute_loss``
  off, under the selecting loss). Each sequence's values are kept on the worker, keyed by its tokens, until the
  step's update (``train_mini_batch``), which lays them out as per-token fields of the batch, so that verl's
  mini-batching and micro-batching carry them to every mini-batch and epoch; they never leave the worker. No forward
  is added. verl sends the update each rank the rows it sent that rank's old-log-prob pass (one dispatch, one batch
  order); a row the pass did not see is an error naming the cause.
- ``VocabStat(forward="update")``: in the update forward, with the gradient of ``top_k`` to the logits (verl's
  log-prob then runs without its in-place backward, which would overwrite the logits that gradient reads).

Megatron: inside verl's logits processor (``_lm_head_logits_processor``) on this tensor-parallel rank's vocabulary
shard, every maximum, normaliser and top-k merged over the tensor-parallel group; verl unpacks the values like its
log-probs (:func:`_install_megatron`).

Not here: verl's fused kernels (no logits: refused on the driver, :func:`check_vocab_engine`), bypass mode (no
old-log-prob pass: refused by ``rollout_source.check_bypass_mode``).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu

from verl_tokensel.core import fields
from verl_tokensel.core.seam.vocab import VocabStat, reduce_rows
from verl_tokensel.verl_glue.errors import config_error_at

_ENGINE_WRAPPED = "_tokensel_vocab_base"
_WORKER_WRAPPED = "_tokensel_vocab_worker_base"
_CACHE = "_tokensel_vocab_old"
_OLD_PASS = "_tokensel_vocab_in_old_pass"


def vocab_stats(config: Any, forward: Optional[str] = None) -> tuple[VocabStat, ...]:
    """The resolved reductions (``kappa`` read from the knobs) the actor config's rule declares, for ``forward``
    (None: both); () without a selection."""
    sel = getattr(config, "selection", None) if config is not None else None
    if sel is None:
        return ()
    return tuple(s.resolve(sel.knobs) for s in sel.impl.needs.vocab if forward is None or s.forward == forward)


def selecting_config(worker) -> Optional[Any]:
    """The actor config of the worker's current loss when it is the selecting loss (it carries ``selection``)."""
    config = getattr(getattr(worker, "loss_fn", None), "config", None)
    return config if getattr(config, "selection", None) is not None else None


def needs_logit_grad(config: Any) -> bool:
    """Whether the update forward's reductions carry a gradient to the logits (``top_k``)."""
    return any(s.kind == "top_k" for s in vocab_stats(config, "update"))


def check_vocab_engine(config, sel) -> None:
    """Refuse, on the driver, a rule with vocabulary reductions where they are not computed: verl's fused kernels
    (no logits)."""
    if sel is None or not sel.impl.needs.vocab:
        return
    from omegaconf import OmegaConf

    key = "actor_rollout_ref.model.use_fused_kernels"
    if OmegaConf.select(config, key, default=False):
        raise config_error_at(
            key, True, "False",
            f"token_selection rule {sel.rule!r} reads per-token reductions over the vocabulary, and verl's fused "
            f"kernels never form the logits. Fix: {key}=False.")


def _row_temperature(output_args: dict, micro_batch: TensorDict, rows: int) -> Optional[torch.Tensor]:
    """The temperature of each row of the logits verl's log-prob reads (None: 1 everywhere)."""
    t = output_args.get("temperature_rmpad")
    if t is not None:
        return t.reshape(-1)
    t = output_args.get("temperature")
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return torch.full((rows,), float(t))
    lengths = micro_batch["input_ids"].offsets().diff().to(t.device)
    return t.reshape(-1).repeat_interleave(lengths)


@contextlib.contextmanager
def _reducing(stats: tuple[VocabStat, ...], output_args: dict, micro_batch: TensorDict, grad: bool, sink: list):
    """Swap the engine's ``logprobs_from_logits`` (whatever is installed: verl's, or the no-graph one) for one that
    first computes ``stats`` on the same logits and labels, for one ``prepare_model_outputs`` call."""
    from verl.workers.engine.fsdp import transformer_impl

    inner = transformer_impl.logprobs_from_logits

    def logprobs(logits, labels, inplace_backward=True):
        rows = logits.reshape(-1, logits.shape[-1])
        temps = _row_temperature(output_args, micro_batch, rows.shape[0])
        if temps is not None:
            temps = temps.to(rows.device)
        sink.append(reduce_rows(stats, rows, labels.reshape(-1), temps, grad=grad))
        return inner(logits=logits, labels=labels, inplace_backward=inplace_backward and not grad)

    transformer_impl.logprobs_from_logits = logprobs
    try:
        yield
    finally:
        transformer_impl.logprobs_from_logits = inner


def _columns(key: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """One reduction's ``(rows,)`` or ``(rows, k)`` values as the per-token keys it travels under: one per column,
    ``<prefix><key>_<j>`` (verl's layouts and mini-batching carry per-token tensors)."""
    values = values.reshape(values.shape[0], -1)
    return {f"{fields.VOCAB_PREFIX}{key}_{j}": values[:, j] for j in range(values.shape[1])}


def _lay_out(engine, values: torch.Tensor, output_args: dict, micro_batch: TensorDict) -> torch.Tensor:
    """One column's per-row values as verl lays out its log-probs: nested, one row per sequence."""
    use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    if use_rmpad:
        values = engine._gather_and_unpad_packed(values, output_args["pad_size"])
    return torch.nested.nested_tensor_from_jagged(values, micro_batch["input_ids"].offsets())


def _sequence_key(ids: torch.Tensor) -> bytes:
    return hashlib.blake2b(ids.detach().to("cpu", torch.int64).numpy().tobytes(), digest_size=16).digest()


def _keep_old(worker, model_output: dict, micro_batch: TensorDict, stats: tuple[VocabStat, ...]) -> None:
    """The old-log-prob pass's values of each sequence of the micro-batch, into the worker's cache (and out of the
    pass's output: they never leave the worker)."""
    cache = worker.__dict__.setdefault(_CACHE, {})
    rows = micro_batch["input_ids"].unbind()
    for s in stats:
        cols = [model_output.pop(f"{fields.VOCAB_PREFIX}{s.key}_{j}").unbind() for j in range(s.width)]
        for i, ids in enumerate(rows):
            value = torch.stack([c[i] for c in cols], -1).detach().to("cpu", torch.float32)
            cache.setdefault(_sequence_key(ids), {})[s.key] = value


def _stats_now(worker, config) -> tuple[VocabStat, ...]:
    """The reductions this forward computes: the update's under autograd, the old pass's in verl's old-log-prob
    pass, none in any other forward-only pass (the pre-pass, the hidden-state passes, the reference model)."""
    if config is None:
        return ()
    if torch.is_grad_enabled():
        return vocab_stats(config, "update")
    return vocab_stats(config, "old") if getattr(worker, _OLD_PASS, False) else ()


def _is_megatron(engine) -> bool:
    return any(c.__module__.startswith("verl.workers.engine.megatron") for c in type(engine).__mro__)


def install_vocab_engine(worker) -> bool:
    """Wrap the worker's engine (idempotent): the reductions of the worker's current selecting loss, in the
    old-log-prob pass and in the update forward. FSDP/FSDP2: ``prepare_model_outputs`` (the log-prob call inside
    it); Megatron: ``_lm_head_logits_processor`` (this tensor-parallel rank's vocabulary shard, merged over the
    group) and ``prepare_model_outputs`` (the old pass's values, unpacked by verl). Returns whether it is installed."""
    engine = getattr(worker, "engine", None)
    if engine is None:
        return False
    if getattr(engine, _ENGINE_WRAPPED, None) is not None:
        return True
    if _is_megatron(engine) and hasattr(engine, "_lm_head_logits_processor"):
        _install_megatron(worker, engine)
        return True
    if not (hasattr(engine, "compute_entropy_from_logits") and hasattr(engine, "prepare_model_outputs")):
        return False  # verl's FSDP LM-head engine has both
    base = engine.prepare_model_outputs

    def prepare_model_outputs(output, output_args, micro_batch, logits_processor_func):
        config = selecting_config(worker)
        stats = _stats_now(worker, config)
        if not stats:
            return base(output, output_args, micro_batch, logits_processor_func)
        grad = torch.is_grad_enabled()
        sink: list = []
        with _reducing(stats, output_args, micro_batch, grad, sink):
            model_output = base(output, output_args, micro_batch, logits_processor_func)
        if not sink:
            raise RuntimeError(
                f"token_selection rule {config.selection.rule!r} reads per-token reductions over the vocabulary, but "
                "this forward computed no log-probs from logits (verl's fused kernels, or a distillation-only "
                "pass). Fix: actor_rollout_ref.model.use_fused_kernels=False.")
        for key, values in sink[-1].items():
            for name, column in _columns(key, values).items():
                model_output[name] = _lay_out(engine, column, output_args, micro_batch)
        if not grad:
            _keep_old(worker, model_output, micro_batch, stats)
        return model_output

    setattr(engine, _ENGINE_WRAPPED, base)
    engine.prepare_model_outputs = prepare_model_outputs
    return True


def _install_megatron(worker, engine) -> None:
    """Megatron: the reductions inside verl's logits processor (``_lm_head_logits_processor(logits, label,
    temperature, ...)``, on the last pipeline stage; ``logits`` this tensor-parallel rank's vocabulary shard, before
    verl divides them by the temperature in place), returned next to verl's ``log_probs`` as per-token keys, which
    verl's own unpacking (``postprocess_thd_engine`` / ``postprocess_bshd_engine``, gathered over context parallelism)
    lays out like the log-probs. Under autograd (the update's ``top_k``) the scaled logits are a copy that keeps the
    graph (verl's processor divides and, for the entropy, overwrites its own in place); no-grad passes divide per
    chunk."""
    from megatron.core import parallel_state as mpu

    base_processor, base_outputs = engine._lm_head_logits_processor, engine.prepare_model_outputs

    def processor(logits, label, temperature, **kwargs):
        config = selecting_config(worker)
        stats = _stats_now(worker, config)
        if not stats:
            return base_processor(logits, label, temperature, **kwargs)
        grad = torch.is_grad_enabled()
        tp = mpu.get_tensor_model_parallel_world_size()
        group = mpu.get_tensor_model_parallel_group() if tp > 1 else None
        start = logits.shape[-1] * mpu.get_tensor_model_parallel_rank()
        t = temperature.detach().float().clone()
        t[t <= 0] = 1e-8  # verl's guard on padding
        rows = logits.reshape(-1, logits.shape[-1])
        t_rows = t.reshape(-1).to(rows.device)
        if grad:
            values = reduce_rows(stats, rows / t_rows.unsqueeze(-1).to(rows.dtype), label.reshape(-1), t_rows,
                                 grad=True, tp_group=group, vocab_start=start)
        else:
            values = reduce_rows(stats, rows, label.reshape(-1), t_rows, divide=True, tp_group=group,
                                 vocab_start=start)
        ret = base_processor(logits, label, temperature, **kwargs)
        for key, v in values.items():
            for name, column in _columns(key, v).items():
                ret[name] = column.reshape(label.shape)
        return ret

    def prepare_model_outputs(output, data):
        model_output = base_outputs(output, data)
        stats = () if torch.is_grad_enabled() else _stats_now(worker, selecting_config(worker))
        if stats:
            _keep_old(worker, model_output, data, stats)
        return model_output

    setattr(engine, _ENGINE_WRAPPED, (base_processor, base_outputs))
    engine._lm_head_logits_processor = processor
    engine.prepare_model_outputs = prepare_model_outputs


def attach_old(worker, data: TensorDict, stats: tuple[VocabStat, ...]) -> None:
    """Lay the old-log-prob pass's values of each row of ``data`` (the step's update batch on this rank) out as
    per-token fields of ``data``, one per reduction and column (``<prefix><key>_<j>``), nested like ``input_ids``."""
    cache = worker.__dict__.get(_CACHE) or {}
    engine = getattr(worker, "engine", None)
    if engine is not None and _is_megatron(engine):
        from megatron.core import parallel_state as mpu

        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return  # an earlier pipeline stage: no output layer, no loss, nothing computed or read here
    rows = data["input_ids"].unbind()
    offsets = data["input_ids"].offsets()
    per_key: dict[str, list[torch.Tensor]] = {s.key: [] for s in stats}
    for i, ids in enumerate(rows):
        entry = cache.get(_sequence_key(ids))
        missing = [s.key for s in stats if entry is None or s.key not in entry]
        if missing:
            raise RuntimeError(
                f"token_selection: the update batch's row {i} has no {missing} from verl's old-log-prob pass on this "
                f"worker ({len(cache)} sequences kept): the pass did not run on these rows here (bypass mode, a "
                "custom trainer that sends the update other rows than the pass, or a pass under a stock loss).")
        for s in stats:
            per_key[s.key].append(entry[s.key])
    if data.is_locked:
        data.unlock_()
    for s in stats:
        values = torch.cat(per_key[s.key]).reshape(-1, s.width)
        for j in range(s.width):
            data[f"{fields.VOCAB_PREFIX}{s.key}_{j}"] = torch.nested.nested_tensor_from_jagged(
                values[:, j].contiguous(), offsets.to(values.device))


def install_vocab_reductions(worker):
    """Wrap ``worker.infer_batch`` and ``train_mini_batch`` (idempotent). Under a selecting loss whose rule declares
    ``Needs(vocab=...)``: the first call installs :func:`install_vocab_engine`; ``infer_batch`` with
    ``compute_loss`` off (verl's old-log-prob pass) keeps the ``forward="old"`` values of its sequences, replacing
    those of the last step; ``train_mini_batch`` lays them out on its batch. Any other loss passes through."""
    if getattr(worker, _WORKER_WRAPPED, None) is not None:
        return worker
    base_infer, base_train = worker.infer_batch, worker.train_mini_batch

    def _config():
        return selecting_config(worker)

    def infer_batch(data, *args, **kwargs):
        config = _config()
        if config is not None:  # under any selecting loss: installed before the no-graph wrap, so it runs inside it
            install_vocab_engine(worker)
        old = vocab_stats(config, "old")
        if not old or tu.get(data, key="compute_loss", default=True):
            return base_infer(data, *args, **kwargs)
        worker.__dict__[_CACHE] = {}
        setattr(worker, _OLD_PASS, True)
        try:
            return base_infer(data, *args, **kwargs)
        finally:
            setattr(worker, _OLD_PASS, False)

    def train_mini_batch(data, *args, **kwargs):
        config = _config()
        if config is not None:
            install_vocab_engine(worker)
        old = vocab_stats(config, "old")
        if old:
            attach_old(worker, data, old)
        return base_train(data, *args, **kwargs)

    setattr(worker, _WORKER_WRAPPED, (base_infer, base_train))
    worker.infer_batch = infer_batch
    worker.train_mini_batch = train_mini_batch
    return worker


def padded_vocab(model_output, data: TensorDict, stats: tuple[VocabStat, ...]) -> dict:
    """The rule's reductions on one micro-batch as ``(batch, response_len[, k])`` tensors keyed
    ``<prefix><key>``: the update forward's from ``model_output`` (with their graph), the old pass's from the fields
    of ``data``."""
    from verl.workers.utils.padding import no_padding_2_padding

    out = {}
    for s in stats:
        name = fields.VOCAB_PREFIX + s.key
        source = data if s.forward == "old" else (model_output or {})
        cols = [f"{name}_{j}" for j in range(s.width)]
        if not all(c in source.keys() for c in cols):
            continue
        value = torch.stack([no_padding_2_padding(source[c], data).float() for c in cols], -1)
        out[name] = value if s.kind == "top_k" else value.squeeze(-1)
    return out


__all__ = ["attach_old", "check_vocab_engine", "install_vocab_engine", "install_vocab_reductions",
           "needs_logit_grad", "padded_vocab", "vocab_stats"]
