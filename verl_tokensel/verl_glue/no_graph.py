"""The update pass's ranking values (entropy, sum_j p_j^2) without an autograd graph.

Stock verl computes the update pass's entropy WITH autograd: the softmax over the whole vocabulary of every token is
kept for a backward that, with ``entropy_coeff = 0`` (every DAPO recipe, both papers), carries a zero gradient. A
selector needs the values, not their gradient: :func:`install_no_graph_scores` wraps one FSDP engine's
``prepare_model_outputs`` (on an actor worker's first call under a selecting loss: :func:`install_no_graph_entropy`)
so that, while the worker's loss is a selecting loss that asks for it (:func:`wants_no_graph`), verl's entropy and
sum p^2 functions are swapped for versions computed under ``no_grad`` in chunks of :data:`CHUNK_ELEMENTS` logits,
and the log-prob reuses the entropy pass's row ``logsumexp`` (:func:`logprobs_from_lse`, same value and gradient).
Forward-only passes (old log-prob, pre-pass) get the same entropy function, so every entropy a selector ranks by
comes from one place. Values equal verl's to float rounding, except on ``-inf`` logits (a masked vocabulary), where
verl's is NaN and this one is the masked distribution's.

The graph stays with ``entropy_coeff != 0``, ``token_selection.no_grad_scores=false``, a stock loss, fused kernels,
and engines other than FSDP/FSDP2. The verl names it swaps are in ARCHITECTURE.md's Seams table.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

#: logits per chunk (2^25 = 32M float32 values, 128 MiB; 220 rows at a vocabulary of 151,936)
CHUNK_ELEMENTS = 1 << 25
_WRAPPED = "_tokensel_no_graph_base"
_WORKER_WRAPPED = "_tokensel_no_graph_worker_base"


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


class _LseCache:
    """The log-sum-exp of the last logits :func:`entropy_no_graph` saw, for the log-prob call that follows."""

    def __init__(self):
        self.logits: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None


def entropy_no_graph(logits: torch.Tensor, chunk_size: Optional[int] = None, *,
                     cache: Optional[_LseCache] = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, nats, with no autograd graph, chunked over rows.

    One exponential per logit: per chunk ``m = max x``, ``e = exp(x - m)``, ``s = sum e``, ``lse = m + log s``;
    ``H = lse - (e . x) / s``, verl's ``logsumexp(x) - sum softmax(x) x``, in float32. ``chunk_size`` (verl's
    ``entropy_from_logits_chunk_size``, passed by the chunking variant) caps the rows per chunk; the memory
    bound :data:`CHUNK_ELEMENTS` applies either way. With ``cache``, the rows' ``logsumexp`` is kept for
    :func:`logprobs_from_lse` (the engine's log-prob call on the same logits then needs no second pass).
    Returns float32 when verl's chunking variant would (``chunk_size`` given), else ``logits.dtype``,
    shaped ``logits.shape[:-1]``.
    """
    vocab = logits.shape[-1]
    flat = logits.detach().reshape(-1, vocab)
    rows = _rows_per_chunk(vocab) if chunk_size is None else max(1, min(int(chunk_size), _rows_per_chunk(vocab)))
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    lse = torch.empty_like(out) if cache is not None else None
    with torch.no_grad():
        for i in range(0, flat.shape[0], rows):
            x = flat[i:i + rows].float()
            m = x.amax(dim=-1, keepdim=True)
            e = torch.sub(x, m)
            e.exp_()
            sums = e.sum(-1)
            dot = torch.bmm(e.unsqueeze(1), x.unsqueeze(2)).view(-1)  # sum_j e_j x_j
            row_lse = torch.log(sums) + m.view(-1)
            h = row_lse - dot / sums
            bad = torch.isnan(h)
            if bad.any():  # -inf logits (a masked vocabulary): e_j x_j is 0 x -inf there; count it as 0
                h[bad] = _entropy_masked_rows(x[bad], e[bad], sums[bad], m.view(-1)[bad])
            out[i:i + rows] = h
            if lse is not None:
                lse[i:i + rows] = row_lse
    if cache is not None:
        cache.logits, cache.lse = logits, lse
    out = out.view(logits.shape[:-1])
    return out if chunk_size is not None else out.to(logits.dtype)


def _entropy_masked_rows(x: torch.Tensor, e: torch.Tensor, sums: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The entropy of rows whose logits hold ``-inf`` (masked vocabulary entries, probability 0): verl's formula
    gives NaN there (``softmax(x) x`` is ``0 x -inf``); the limit ``p log p -> 0`` drops those entries. Rows that
    are NaN for another reason (a NaN logit, every logit ``-inf``) stay NaN."""
    dot = (e * torch.where(e > 0, x, 0.0)).sum(-1)  # m: the rows' max, as the caller measured it
    return torch.log(sums) + m - dot / sums


class _LogProbFromLse(torch.autograd.Function):
    """``log p(label) = x[label] - lse`` with ``lse`` measured already; backward ``(onehot - softmax(x)) * g``,
    recomputed per chunk from ``x`` and ``lse`` (what autograd of verl's ``logsumexp`` computes, minus its
    forward pass). With ``inplace`` the gradient is written into the logits' own storage, chunk by chunk (each
    chunk is read before it is overwritten), as flash-attn's cross-entropy does for verl's stock log-prob
    (``inplace_backward=True``): no tokens x vocab gradient buffer is allocated. Only valid when nothing else
    reads the logits in the backward (then: the no-graph entropy; autograd's version check would raise
    otherwise)."""

    @staticmethod
    def forward(ctx, logits, labels, lse, inplace):
        ctx.save_for_backward(logits, labels, lse)
        ctx.inplace = bool(inplace)
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        return picked.float() - lse if logits.dtype != torch.float64 else picked - lse.double()

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse = ctx.saved_tensors
        g = logits if ctx.inplace else torch.empty_like(logits)
        rows = _rows_per_chunk(logits.shape[-1])
        for i in range(0, logits.shape[0], rows):
            p = torch.exp(logits[i:i + rows].float() - lse[i:i + rows].unsqueeze(-1))
            g[i:i + rows] = p.mul_(-grad[i:i + rows].float().unsqueeze(-1))
        g.scatter_add_(-1, labels.unsqueeze(-1), grad.unsqueeze(-1).to(g.dtype))
        return g, None, None, None


def logprobs_from_lse(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                      inplace: bool = False) -> torch.Tensor:
    """Differentiable ``log softmax(logits)[label]`` of 2-D ``logits`` given their (detached) row ``lse``;
    ``inplace``: the backward overwrites ``logits`` with their gradient (see :class:`_LogProbFromLse`)."""
    return _LogProbFromLse.apply(logits, labels, lse, inplace)


def sum_pi_squared_no_graph(logits: torch.Tensor) -> torch.Tensor:
    """``sum_j p_j^2`` of ``softmax(logits)`` (verl's ``exp(lse(2x) - 2 lse(x))``), no graph, chunked; dtype of
    ``logits``."""
    vocab = logits.shape[-1]
    flat = logits.detach().reshape(-1, vocab)
    rows = _rows_per_chunk(vocab)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        for i in range(0, flat.shape[0], rows):
            x = flat[i:i + rows].float()
            out[i:i + rows] = torch.exp(torch.logsumexp(2.0 * x, dim=-1) - 2.0 * torch.logsumexp(x, dim=-1))
    return out.view(logits.shape[:-1]).to(logits.dtype)


def wants_no_graph(config: Any) -> bool:
    """Whether the update pass may compute its entropy / sum p^2 without a graph for this actor config.

    True when a selector is on, ``token_selection.no_grad_scores`` is true (the default) and
    ``entropy_coeff == 0`` (no entropy bonus, so no gradient of the entropy is used anywhere).
    """
    sel = getattr(config, "selection", None)
    if sel is None:
        return False
    knobs = getattr(config, "token_selection", None)
    if not getattr(knobs, "no_grad_scores", True):
        return False
    return float(getattr(config, "entropy_coeff", 0.0) or 0.0) == 0.0


@contextlib.contextmanager
def _no_graph_functions(engine, inplace_ok: bool = True, log_prob: bool = True):
    """Swap the engine's entropy / sum p^2 / log-prob functions for the no-graph ones, for one call.

    verl asks its log-prob for ``inplace_backward=False`` whenever it computes the entropy, because verl's
    entropy graph reads the logits in the backward. With the entropy computed here nothing does, so the
    log-prob's backward may overwrite the logits in place as in stock verl without entropy (``inplace_ok``;
    False when another consumer of the logits may keep a graph, e.g. verl's top-k distillation). ``log_prob=False``
    keeps verl's log-prob (forward-only passes: their log-probs stay verl's bit for bit)."""
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    cache = _LseCache()
    stock_logprobs = transformer_impl.logprobs_from_logits

    def compute_entropy(logits, chunk_size=None):
        return entropy_no_graph(logits, chunk_size, cache=cache)

    def logprobs(logits, labels, inplace_backward=True):
        inplace = inplace_ok or inplace_backward
        # the log-prob call right after the entropy call, on the same logits (use_remove_padding): reuse its lse
        if cache.logits is logits and logits.dim() == 2 and labels.shape == logits.shape[:1]:
            lse, cache.logits, cache.lse = cache.lse, None, None
            return logprobs_from_lse(logits, labels, lse, inplace=inplace)
        return stock_logprobs(logits=logits, labels=labels, inplace_backward=inplace)

    saved = (verl_F.entropy_from_logits, verl_F.calculate_sum_pi_squared_from_logits,
             engine.__dict__.get("compute_entropy_from_logits"))
    verl_F.entropy_from_logits = entropy_no_graph
    verl_F.calculate_sum_pi_squared_from_logits = sum_pi_squared_no_graph
    engine.compute_entropy_from_logits = compute_entropy if log_prob else entropy_no_graph
    if log_prob:
        transformer_impl.logprobs_from_logits = logprobs
    try:
        yield
    finally:
        cache.logits = cache.lse = None
        transformer_impl.logprobs_from_logits = stock_logprobs
        verl_F.entropy_from_logits, verl_F.calculate_sum_pi_squared_from_logits = saved[0], saved[1]
        if saved[2] is None:
            engine.__dict__.pop("compute_entropy_from_logits", None)
        else:
            engine.compute_entropy_from_logits = saved[2]


def supports_no_graph(engine) -> bool:
    """Only verl's FSDP/FSDP2 LM-head engine has the seam (``compute_entropy_from_logits``)."""
    return hasattr(engine, "compute_entropy_from_logits") and hasattr(engine, "prepare_model_outputs")


def install_no_graph_scores(worker) -> bool:
    """Wrap ``worker.engine.prepare_model_outputs`` (idempotent); returns whether the engine has the seam.

    The wrap reads ``worker.loss_fn`` at call time, so a later ``set_loss_fn`` (a stock loss, another
    config) takes effect at once.
    """
    from verl_tokensel.verl_glue.loss import SelectingLoss

    engine = getattr(worker, "engine", None)
    if engine is None or not supports_no_graph(engine):
        return False
    if getattr(engine, _WRAPPED, None) is not None:
        return True
    from verl_tokensel.verl_glue.vocab import install_vocab_engine

    install_vocab_engine(worker)  # first, so that its log-prob swap runs inside this one's (verl calls it last)
    base = engine.prepare_model_outputs

    def prepare_model_outputs(output, output_args, micro_batch, logits_processor_func):
        loss_fn = getattr(worker, "loss_fn", None)
        if isinstance(loss_fn, SelectingLoss) and not _fused(micro_batch):
            if not torch.is_grad_enabled():  # old-log-prob pass, pre-pass: the scores' entropy, finite on -inf
                with _no_graph_functions(engine, log_prob=False):
                    return base(output, output_args, micro_batch, logits_processor_func)
            if wants_no_graph(loss_fn.config):
                from verl_tokensel.verl_glue.vocab import needs_logit_grad

                inplace_ok = not _distillation(micro_batch) and not needs_logit_grad(loss_fn.config)
                with _no_graph_functions(engine, inplace_ok=inplace_ok):
                    return base(output, output_args, micro_batch, logits_processor_func)
        return base(output, output_args, micro_batch, logits_processor_func)

    setattr(engine, _WRAPPED, base)
    engine.prepare_model_outputs = prepare_model_outputs
    return True


def install_no_graph_entropy(worker):
    """Wrap ``worker.train_batch`` and ``infer_batch`` (idempotent): the first call under a selecting loss installs
    :func:`install_no_graph_scores` on the worker's engine (built after the worker), so that the old-log-prob pass's
    entropy comes from the same function as the update's. Any other loss passes through untouched."""
    if getattr(worker, _WORKER_WRAPPED, None) is not None:
        return worker
    from verl_tokensel.verl_glue.loss import SelectingLoss

    base, base_infer = worker.train_batch, worker.infer_batch

    def train_batch(data, *args, **kwargs):
        if isinstance(worker.loss_fn, SelectingLoss):
            install_no_graph_scores(worker)
        return base(data, *args, **kwargs)

    def infer_batch(data, *args, **kwargs):
        if isinstance(worker.loss_fn, SelectingLoss):  # the old-log-prob pass's entropy: the selectors' function
            install_no_graph_scores(worker)
        return base_infer(data, *args, **kwargs)

    setattr(worker, _WORKER_WRAPPED, base)
    worker.train_batch = train_batch
    worker.infer_batch = infer_batch
    return worker


def _distillation(micro_batch) -> bool:
    """verl's top-k distillation reads the student logits with a graph (``logits_processor_func``)."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=micro_batch, key="distillation_use_topk", default=False))


def _fused(micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False))


__all__ = [
    "CHUNK_ELEMENTS",
    "entropy_no_graph",
    "logprobs_from_lse",
    "install_no_graph_entropy",
    "install_no_graph_scores",
    "sum_pi_squared_no_graph",
    "supports_no_graph",
    "wants_no_graph",
]
