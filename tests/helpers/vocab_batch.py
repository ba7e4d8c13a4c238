"""A micro-batch built from logits, for the rules that read the whole distribution (Lp-Reg, SimKO): the engine's
nested log-probs, entropy and the rule's vocabulary reductions all come from one ``(tokens, V)`` logits leaf, as
verl's FSDP engine and ``verl_glue/vocab.py`` compute them; the old policy's from logits a little off the current.

Returns the model output and micro-batch the selecting loss reads, the logits leaf (for gradients) and the padded
``(batch, response_len, V)`` current and old logits, the sampled tokens and the response mask, for the released
computation written out in each test. ``boost``: up to this much added to each sampled token's logit (a sampled
token is likelier than a random one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.workers.utils.padding import no_padding_2_padding

from helpers.actor_configs import micro_batch
from verl_tokensel.core import fields
from verl_tokensel.core.seam.vocab import VocabStat, reduce_rows

VOCAB = 101  # the synthetic token ids are below 100


@dataclass
class VocabBatch:
    model_output: dict
    data: object
    logits: torch.Tensor  # (total tokens, V) leaf
    current: torch.Tensor  # (batch, response_len, V), in the graph
    old: torch.Tensor  # (batch, response_len, V)
    tokens: torch.Tensor  # (batch, response_len) sampled ids
    response_mask: torch.Tensor  # (batch, response_len) bool


def vocab_batch(seed: int, stats: tuple[VocabStat, ...], *, batch: int = 8, resp_len: int = 16, scale: float = 3.0,
                noise: float = 0.3, temperature: float = 1.0, negative_share: float = 0.5,
                boost: float = 0.0) -> VocabBatch:
    mo, data, _ = micro_batch(seed, batch=batch, resp_len=resp_len)
    g = torch.Generator().manual_seed(500 + seed)
    ids = data["input_ids"]
    offsets = ids.offsets()
    labels = torch.roll(ids.values(), -1)  # row t predicts token t + 1, as verl's input_ids_rmpad_rolled
    total = labels.shape[0]
    logits = torch.randn(total, VOCAB, generator=g) * scale
    logits[torch.arange(total), labels] += boost * torch.rand(total, generator=g)  # sampled tokens: likelier
    logits.requires_grad_(True)
    old_logits = logits.detach() + torch.randn(total, VOCAB, generator=g) * noise
    t = torch.full((total,), float(temperature))
    scaled, old_scaled = logits / temperature, old_logits / temperature

    def nested(v):
        return torch.nested.nested_tensor_from_jagged(v, offsets)

    log_prob = torch.log_softmax(scaled, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(scaled, -1) - (torch.softmax(scaled, -1) * scaled).sum(-1)
    old_lp = torch.log_softmax(old_scaled, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mo = {fields.LOG_PROBS: nested(log_prob), fields.ENTROPY: nested(entropy.detach())}
    rm = data["response_mask"].to(torch.bool)
    data["old_log_probs"] = no_padding_2_padding(nested(old_lp), data) * rm
    signs = torch.where(torch.rand(rm.shape[0], 1, generator=g) < negative_share, -1.0, 1.0)
    data["advantages"] = (signs * (0.2 + torch.rand(rm.shape[0], 1, generator=g))).expand(rm.shape).contiguous() * rm
    for stat in stats:
        # one per-token field per column, as verl_glue/vocab.py hands them on: the update forward's in the model output
        # (with the gradient), the old pass's in the micro-batch
        source, grad = (logits, True) if stat.forward == "update" else (old_logits, False)
        value = reduce_rows((stat,), source, labels, t, grad=grad)[stat.key].reshape(total, -1)
        target = mo if grad else data
        for j in range(value.shape[1]):
            target[f"{fields.VOCAB_PREFIX}{stat.key}_{j}"] = nested(value[:, j].contiguous())
    return VocabBatch(model_output=mo, data=data, logits=logits, current=no_padding_2_padding(nested(logits), data),
                      old=no_padding_2_padding(nested(old_logits), data),
                      tokens=no_padding_2_padding(nested(labels), data), response_mask=rm)


__all__ = ["VOCAB", "VocabBatch", "vocab_batch"]
