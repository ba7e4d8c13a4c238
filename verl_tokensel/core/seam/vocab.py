"""Per-token reductions over the whole vocabulary, computed where verl turns logits into log-probs.

A rule that reads more of the distribution at each token than the sampled token's log-prob, the entropy and
``sum pi^2`` declares it: ``Needs(vocab=(VocabStat(...), ...))``. Each :class:`VocabStat` names a reduction and the
forward it is computed in:

- ``forward="old"``: verl's old-log-prob pass (the old policy, no gradient); the values travel with the step's batch
  to every mini-batch and epoch of the update. No forward is added.
- ``forward="update"``: the update's own forward, with the gradient where the reduction has one (``top_k``).

The reductions (each over the temperature-scaled logits verl's log-prob reads, in chunks of rows, so nothing of size
tokens x vocabulary is held beyond the logits verl holds itself):

- ``top_k``: the ``k`` largest log-probs of the token's distribution, descending, ``(batch, response_len, k)``; in
  the update forward they carry the gradient to the logits of those ``k`` entries and the normaliser.
- ``min_p``: the log-prob of the sampled token under the min-p filtered distribution (every entry whose probability,
  before the temperature, is below ``kappa`` times the largest set to the logit ``-1e4``, then the log-softmax of the
  logits over the temperature), ``(batch, response_len)``, no gradient. ``kappa``: a number, or the name of the rule's
  knob that holds it.

A rule reads them as ``x.vocab[stat.key]`` (``"old_top_k"``, ``"update_min_p"``, ...). A rule that declares none pays
nothing. Under tensor parallelism over the vocabulary (Megatron) every maximum, normaliser and top-k is merged over
the tensor-parallel group (``tp_group``). Pure torch, no verl import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

#: the reductions and the forwards they may be computed in
KINDS = ("top_k", "min_p")
FORWARDS = ("old", "update")
#: logits per chunk of rows (2^25 float32 values, 128 MiB: 220 rows at a vocabulary of 151,936)
CHUNK_ELEMENTS = 1 << 25
#: the logit the min-p filter gives a removed entry (before the temperature)
FILTERED_LOGIT = -1e4


@dataclass(frozen=True)
class VocabStat:
    """One per-token reduction over the vocabulary a rule reads: ``Needs(vocab=(VocabStat(...), ...))``, read as
    ``x.vocab[stat.key]`` (``"old_top_k"``, ``"old_min_p"``, ``"update_top_k"``, ...). Computed over the
    temperature-scaled logits where verl turns them into log-probs, in chunks of rows: nothing of size tokens x
    vocabulary beyond the logits verl holds itself; merged over the tensor-parallel group where the vocabulary is
    split. A rule that declares none pays nothing.

    Attributes:
        kind: ``top_k``: the ``k`` largest log-probs of the token's distribution, descending,
            ``(batch, response_len, k)`` (in the update forward with the gradient to those ``k`` logits and the
            normaliser). ``min_p``: the log-prob of the sampled token under the min-p filtered distribution (every
            entry whose probability before the temperature is below ``kappa`` times the largest gets the logit
            ``-1e4``, then log-softmax of the logits over the temperature), ``(batch, response_len)``, no gradient.
        forward: ``old``: verl's old-log-prob pass (the old policy, no gradient; the values travel with the step's
            batch to every mini-batch and epoch of the update, no forward added). ``update``: the update forward.
        k: ``top_k``: how many log-probs per token (>= 1), or the name of the rule's knob holding it.
        kappa: ``min_p``: the threshold relative to the largest probability, or the name of the rule's knob holding it.
    """

    kind: str
    forward: str = "old"
    k: Union[int, str] = 1
    kappa: Union[float, str] = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"VocabStat.kind={self.kind!r}: valid kinds are {', '.join(KINDS)}")
        if self.forward not in FORWARDS:
            raise ValueError(f"VocabStat.forward={self.forward!r}: valid forwards are {', '.join(FORWARDS)}")
        if self.kind == "top_k" and not isinstance(self.k, str) and int(self.k) < 1:
            raise ValueError(f"VocabStat(kind='top_k').k={self.k!r}: must be >= 1 or the name of a knob")

    @property
    def key(self) -> str:
        """The name the rule reads it by: ``x.vocab[key]``."""
        return f"{self.forward}_{self.kind}"

    @property
    def width(self) -> int:
        """Values per token."""
        return int(self.k) if self.kind == "top_k" else 1

    def resolve(self, knobs: Any) -> "VocabStat":
        """This stat with ``k`` and ``kappa`` read from ``knobs`` where they name a knob."""
        k = int(getattr(knobs, self.k)) if isinstance(self.k, str) else self.k
        kappa = float(getattr(knobs, self.kappa)) if isinstance(self.kappa, str) else self.kappa
        return self if (k, kappa) == (self.k, self.kappa) else VocabStat(self.kind, self.forward, k, kappa)


def _rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_lse(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maximum and log-sum-exp of float32 rows ``x`` (this shard's columns), merged over ``group``."""
    m = _all_reduce(x.amax(dim=-1), dist.ReduceOp.MAX, group)
    s = _all_reduce(torch.exp(x - m.unsqueeze(-1)).sum(-1), dist.ReduceOp.SUM, group)
    return m, m + torch.log(s)


def _chunk_top_k(x: torch.Tensor, k: int, group, vocab_start: int) -> torch.Tensor:
    """The global column ids of the ``k`` largest entries of each row of ``x`` (ties: the lower id), merged over
    ``group`` (each rank's shard starts at column ``vocab_start``); ids off this shard are returned as they are."""
    kk = min(k, x.shape[-1])
    vals, ids = torch.topk(x, kk, dim=-1)
    ids = ids + vocab_start
    if group is None or dist.get_world_size(group) == 1:
        return ids
    world = dist.get_world_size(group)
    all_vals = [torch.empty_like(vals) for _ in range(world)]
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(all_vals, vals.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
    order = torch.topk(vals, k, dim=-1).indices
    return torch.gather(ids, -1, order)


class _TopKLogProbs(torch.autograd.Function):
    """``log softmax(logits)`` at ``ids`` (``(n, k)``), ``lse`` measured already (merged over the tensor-parallel
    group); backward ``sum_j g_j (onehot(ids_j) - softmax)``, recomputed per chunk of rows: one buffer the size of
    the logits (their gradient), as verl's own log-prob backward."""

    @staticmethod
    def forward(ctx, logits, ids, lse, vocab_start, group):
        ctx.save_for_backward(logits, ids, lse)
        ctx.vocab_start, ctx.group = vocab_start, group
        return _gather_shard(logits, ids, vocab_start, group).float() - lse.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        logits, ids, lse = ctx.saved_tensors
        g = torch.empty_like(logits)
        total = grad.float().sum(-1, keepdim=True)
        rows = _rows(logits.shape[-1])
        for i in range(0, logits.shape[0], rows):
            p = torch.exp(logits[i:i + rows].float() - lse[i:i + rows].unsqueeze(-1))
            g[i:i + rows] = p.mul_(-total[i:i + rows])
        local = ids - ctx.vocab_start
        here = (local >= 0) & (local < logits.shape[-1])
        g.scatter_add_(-1, local.clamp(0, logits.shape[-1] - 1), torch.where(here, grad, 0.0).to(g.dtype))
        return g, None, None, None, None


def _gather_shard(logits: torch.Tensor, ids: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """``logits`` at the global column ``ids`` (``(n, k)``), each from the rank whose shard holds it."""
    local = ids - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = torch.gather(logits.detach() if group is not None else logits, -1,
                          local.clamp(0, logits.shape[-1] - 1)).float()
    picked = torch.where(here, picked, 0.0)
    return _all_reduce(picked, dist.ReduceOp.SUM, group) if group is not None else picked


def reduce_rows(stats: tuple[VocabStat, ...], logits: torch.Tensor, labels: torch.Tensor,
                temperature: Optional[torch.Tensor] = None, *, grad: bool = False, divide: bool = False,
                tp_group: Optional[dist.ProcessGroup] = None, vocab_start: int = 0) -> dict[str, torch.Tensor]:
    """The ``stats`` of 2-D temperature-scaled ``logits`` (``(n, V)``: rows are tokens; under tensor parallelism this
    rank's vocabulary shard, starting at global column ``vocab_start``), the sampled tokens ``labels`` (``(n,)``,
    global ids) and the rows' ``temperature`` (``(n,)``; None: 1). ``divide``: the logits are not scaled yet; each
    chunk is divided by its rows' temperature (no copy of the whole). Returns ``key -> (n,)`` (``min_p``) or
    ``(n, k)`` (``top_k``), float32. ``grad``: ``top_k`` keeps the gradient to ``logits`` (the update forward; under
    tensor parallelism each rank's shard gets its part, as verl's vocabulary-parallel log-prob does)."""
    n, vocab = logits.shape
    rows = _rows(vocab)
    if grad and divide:
        raise ValueError("reduce_rows: grad=True needs the scaled logits (divide=False)")
    out: dict[str, list[torch.Tensor]] = {s.key: [] for s in stats}
    lse_all = torch.empty(n, dtype=torch.float32, device=logits.device)
    top_ids: dict[str, list[torch.Tensor]] = {s.key: [] for s in stats if s.kind == "top_k"}
    any_top_k = bool(top_ids)
    with torch.no_grad():
        for i in range(0, n, rows):
            x = logits[i:i + rows].detach().float()
            t = 1.0 if temperature is None else temperature[i:i + rows].float().unsqueeze(-1)
            if divide and temperature is not None:
                x = x / t
            if any_top_k:
                m, lse = _chunk_lse(x, tp_group)
                lse_all[i:i + rows] = lse
            else:  # min-p alone needs the row maximum, not the unfiltered normaliser
                m = _all_reduce(x.amax(dim=-1), dist.ReduceOp.MAX, tp_group)
            for s in stats:
                if s.kind == "top_k":
                    ids = _chunk_top_k(x, int(s.k), tp_group, vocab_start)
                    top_ids[s.key].append(ids)
                    if not grad:
                        out[s.key].append(_gather_shard(x, ids, vocab_start, tp_group) - lse.unsqueeze(-1))
                else:
                    out[s.key].append(_min_p_chunk(x, m, labels[i:i + rows], float(s.kappa), t, tp_group,
                                                   vocab_start))
    result: dict[str, torch.Tensor] = {}
    for s in stats:
        if s.kind == "top_k" and grad:
            ids = torch.cat(top_ids[s.key]) if top_ids[s.key] else torch.empty(0, int(s.k), dtype=torch.long,
                                                                              device=logits.device)
            result[s.key] = _TopKLogProbs.apply(logits, ids, lse_all, vocab_start, tp_group)
        elif out[s.key]:
            result[s.key] = torch.cat(out[s.key])
        else:
            result[s.key] = torch.empty((0, int(s.k)) if s.kind == "top_k" else (0,), device=logits.device)
    return result


def _min_p_chunk(x: torch.Tensor, m: torch.Tensor, labels: torch.Tensor, kappa: float, t, group,
                 vocab_start: int) -> torch.Tensor:
    """The min-p proxy's log-prob of ``labels`` for one chunk of temperature-scaled rows ``x`` (row maxima ``m``):
    keep ``p_v >= kappa * p_max`` of the distribution before the temperature (``(x_v - m) t >= log kappa``), give
    the others the logit ``-1e4`` (before the temperature: ``-1e4 / t`` here), log-softmax."""
    keep = (x - m.unsqueeze(-1)) * t >= torch.log(torch.tensor(kappa, dtype=torch.float32)) if kappa > 0 else \
        torch.ones_like(x, dtype=torch.bool)
    filtered = torch.where(keep, x, FILTERED_LOGIT / t if isinstance(t, float) else (FILTERED_LOGIT / t).expand_as(x))
    _, lse = _chunk_lse(filtered, group)
    picked = _gather_shard(filtered, labels.unsqueeze(-1), vocab_start, group).squeeze(-1)
    return picked - lse


__all__ = ["CHUNK_ELEMENTS", "FILTERED_LOGIT", "FORWARDS", "KINDS", "VocabStat", "reduce_rows"]
