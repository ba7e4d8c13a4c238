"""Per-token logit gradients of a real verl update, for tests that check which tokens got gradient.

Use with the in-process harness (:mod:`verl_tokensel_cpu.worker`)::

    with capture_logit_grads(actor) as grads:            # one tensor per micro-batch backward
        run_train_step(actor, batch, loss_fn=SelectingLoss(cfg, observer=observe))
    norms = token_grad_norms(grads, micro, actor.use_remove_padding)

where ``observe`` appends, per micro-batch, a dict with ``mask`` (``(batch, max_resp)``),
``prompt_lens`` and ``resp_lens`` (:func:`prompt_lengths` / :func:`response_lengths` of the loss's
``data``). A token's norm is that of the gradient reaching the logits that predict it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def response_lengths(data) -> list[int]:
    """Valid response tokens per row of a micro-batch as the engine passes it (nested or padded)."""
    rm = data["response_mask"]
    if rm.is_nested:
        return rm.offsets().diff().tolist()
    return data["attention_mask"][:, data["prompts"].shape[1]:].sum(1).tolist()


def padded_response_field(field, resp_lens) -> torch.Tensor:
    """A per-token response field (nested, or padded wider) as ``(batch, max(resp_lens))``, zeros past each row."""
    rows = field.unbind(0) if field.is_nested else [field[i, :n] for i, n in enumerate(resp_lens)]
    out = torch.zeros(len(rows), max(resp_lens), dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def prompt_lengths(data) -> list[int]:
    """Valid prompt tokens per row (left padding excluded)."""
    prompts = data["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist()
    return data["attention_mask"][:, : prompts.shape[1]].sum(1).tolist()


def _lm_head(actor):
    """The module whose output is the logits: HF's ``lm_head``, or Megatron's ``output_layer`` on the last
    pipeline stage (None on an earlier stage, which computes no logits)."""
    module = actor.module
    if not isinstance(module, (list, tuple)):
        return module.lm_head
    from megatron.core.utils import unwrap_model

    return getattr(unwrap_model(module[-1]), "output_layer", None)


@contextlib.contextmanager
def capture_logit_grads(actor) -> Iterator[list]:
    """Record the gradient reaching the LM head's output at every backward of a training forward.

    Megatron's ``output_layer`` returns ``(logits, bias)`` laid out ``[seq, batch, vocab / TP]``: its gradient
    is stored as ``[batch, seq, vocab / TP]`` (this rank's vocabulary shard), like the HF head's."""
    grads: list = []
    head = _lm_head(actor)

    def fwd_hook(module, inputs, output):
        megatron = isinstance(output, tuple)
        logits = output[0] if megatron else output
        if torch.is_grad_enabled() and logits.requires_grad:
            slot = len(grads)
            grads.append(None)

            def keep(g, slot=slot):
                grads[slot] = (g.transpose(0, 1) if megatron else g).detach().clone()

            logits.register_hook(keep)

    handle = head.register_forward_hook(fwd_hook) if head is not None else None
    try:
        yield grads
    finally:
        if handle is not None:
            handle.remove()


def token_grad_norms(logit_grads: list, micro: list[dict], rmpad: bool, align: int = 1) -> list[torch.Tensor]:
    """Per micro-batch: ``(batch, max_resp)`` float64 norms of the logits' gradient at each response token.

    ``align``: packed (``rmpad``) sequences start at multiples of it (Megatron pads each packed sequence to a
    multiple of the tensor-parallel size)."""
    assert len(logit_grads) == len(micro), (len(logit_grads), len(micro))
    out = []
    for grad, m in zip(logit_grads, micro):
        norms = torch.zeros_like(m["mask"], dtype=torch.float64)
        offset = 0
        for i, (pl, rl) in enumerate(zip(m["prompt_lens"], m["resp_lens"])):
            for j in range(rl):
                pos = pl + j - 1  # logits at position t predict token t + 1
                norms[i, j] = (grad[0, offset + pos] if rmpad else grad[i, pos]).double().norm()
            offset += -(-(pl + rl) // align) * align
        out.append(norms)
    return out


def row_ids(data) -> list[tuple]:
    """(prompt ids, response ids) of each row, nested (V1) or padded (v0): a row's identity that survives
    reordering, balancing and the split over data-parallel ranks."""
    if data["responses"].is_nested:
        return [(tuple(p.tolist()), tuple(r.tolist()))
                for p, r in zip(data["prompts"].unbind(0), data["responses"].unbind(0))]
    attn = data["attention_mask"].bool()
    width = data["prompts"].shape[1]
    return [(tuple(data["prompts"][i][attn[i, :width]].tolist()), tuple(data["responses"][i][attn[i, width:]].tolist()))
            for i in range(data["responses"].shape[0])]
