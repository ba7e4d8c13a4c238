"""The per-token vocabulary reductions a rule declares (``Needs(vocab=...)``), in verl's FSDP/FSDP2 engine.

Where: the engine's ``prepare_model_outputs`` (wrapped by :func:`install_vocab_reductions`), at the one call of
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

Not here: verl's fused kernels (no logits: refused on the driver), the Megatron engine (refused on the driver:
:func:`check_vocab_engine`), bypass mode (no old-log-prob pass: refused by ``rollout_source.check_bypass_mode``).
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
    """Refuse, on the driver, a rule with vocabulary reductions where they are not computed: the Megatron engine,
    verl's fused kernels (no logits)."""
    if sel is None or not sel.impl.needs.vocab:
        return
    from omegaconf import OmegaConf

    key = "actor_rollout_ref.actor.strategy"
    strategy = OmegaConf.select(config, key, default="fsdp")
    if strategy not in ("fsdp", "fsdp2"):
        raise config_error_at(
            key, strategy, "fsdp, fsdp2",
            f"token_selection rule {sel.rule!r} reads per-token reductions over the vocabulary, computed where verl's "
            f"FSDP engine turns logits into log-probs; the {strategy} engine is not supported for it yet. Fix: "
            f"{key}=fsdp2.")
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


def _lay_out(engine, values: torch.Tensor, output_args: dict, micro_batch: TensorDict) -> torch.Tensor:
    """One reduction's per-row values as verl lays out its log-probs: nested, one row per sequence."""
    use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    if use_rmpad:
        values = engine._gather_and_unpad_packed(values, output_args["pad_size"])
    return torch.nested.nested_tensor_from_jagged(values, micro_batch["input_ids"].offsets())


def _sequence_key(ids: torch.Tensor) -> bytes:
    return hashlib.blake2b(ids.detach().to("cpu", torch.int64).numpy().tobytes(), digest_size=16).digest()


def _keep_old(worker, model_output: dict, micro_batch: TensorDict, keys: list[str]) -> None:
    """The old-log-prob pass's values of each sequence of the micro-batch, into the worker's cache (and out of the
    pass's output: they never leave the worker)."""
    cache = worker.__dict__.setdefault(_CACHE, {})
    rows = micro_batch["input_ids"].unbind()
    for key in keys:
        nested = model_output.pop(fields.VOCAB_PREFIX + key)
        for ids, value in zip(rows, nested.unbind()):
            cache.setdefault(_sequence_key(ids), {})[key] = value.detach().to("cpu", torch.float32)


def install_vocab_engine(worker) -> bool:
    """Wrap ``worker.engine.prepare_model_outputs`` (idempotent): the reductions of the worker's current selecting
    loss, in the old-log-prob pass and in the update forward. Only verl's FSDP engine has the seam; returns whether
    it is installed."""
    engine = getattr(worker, "engine", None)
    if engine is None or not (hasattr(engine, "compute_entropy_from_logits") and
                              hasattr(engine, "prepare_model_outputs")):  # verl's FSDP LM-head engine
        return False
    if getattr(engine, _ENGINE_WRAPPED, None) is not None:
        return True
    base = engine.prepare_model_outputs

    def prepare_model_outputs(output, output_args, micro_batch, logits_processor_func):
        config = selecting_config(worker)
        if config is None:
            return base(output, output_args, micro_batch, logits_processor_func)
        grad = torch.is_grad_enabled()
        if grad:
            stats = vocab_stats(config, "update")
        else:
            stats = vocab_stats(config, "old") if getattr(worker, _OLD_PASS, False) else ()
        if not stats:
            return base(output, output_args, micro_batch, logits_processor_func)
        sink: list = []
        with _reducing(stats, output_args, micro_batch, grad, sink):
            model_output = base(output, output_args, micro_batch, logits_processor_func)
        if not sink:
            raise RuntimeError(
                f"token_selection rule {config.selection.rule!r} reads per-token reductions over the vocabulary, but "
                "this forward computed no log-probs from logits (verl's fused kernels, or a distillation-only "
                "pass). Fix: actor_rollout_ref.model.use_fused_kernels=False.")
        for key, values in sink[-1].items():
            model_output[fields.VOCAB_PREFIX + key] = _lay_out(engine, values, output_args, micro_batch)
        if not grad:
            _keep_old(worker, model_output, micro_batch, list(sink[-1]))
        return model_output

    setattr(engine, _ENGINE_WRAPPED, base)
    engine.prepare_model_outputs = prepare_model_outputs
    return True


def attach_old(worker, data: TensorDict, stats: tuple[VocabStat, ...]) -> None:
    """Lay the old-log-prob pass's values of each row of ``data`` (the step's update batch on this rank) out as
    per-token fields of ``data``, one per reduction and column (``<prefix><key>_<j>``), nested like ``input_ids``."""
    cache = worker.__dict__.get(_CACHE) or {}
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
        if s.forward == "update":
            value = None if model_output is None else model_output.get(name, None)
            if value is not None:
                value = no_padding_2_padding(value, data)
                out[name] = value.squeeze(-1) if s.kind != "top_k" and value.dim() == 3 else value
            continue
        cols = [f"{name}_{j}" for j in range(s.width)]
        if all(c in data.keys() for c in cols):
            value = torch.stack([no_padding_2_padding(data[c], data).float() for c in cols], -1)
            out[name] = value if s.kind == "top_k" else value.squeeze(-1)
    return out


__all__ = ["attach_old", "check_vocab_engine", "install_vocab_engine", "install_vocab_reductions",
           "needs_logit_grad", "padded_vocab", "vocab_stats"]
