"""Per-token scores of responses under a causal LM, chunked over the vocabulary.

Memory stays bounded: the full ``(tokens, vocab)`` logits are never materialised. The LM head is
applied one vocabulary chunk at a time and an online (streaming) softmax accumulates, per token,

    m = max_j z_j,  s = sum_j e^(z_j - m),  u = sum_j e^(z_j - m) (z_j - m),  q = sum_j e^(2(z_j - m))

(rescaled whenever m grows), from which, with z = logits / T:

    log Z = m + log s,   H = log s - u / s  (nats),   sum_j p_j^2 = q / s^2,   log p_a = z_a - log Z.

Accumulators are float64 (``(tokens,)`` vectors, negligible memory); each chunk's logits are float32.
Peak extra memory is ``tokens x chunk_size`` floats instead of ``tokens x vocab``.

Supported models: those whose logits are ``lm_head(hidden)`` (+ optional bias) of the base model's
last hidden state (Qwen2/3, Llama, Mistral, ...). Models with logit soft-capping or scaling are
refused with a clear error rather than scored wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from verl_tokensel.core.scores import logit_grad_norm

DEFAULT_CHUNK = 8192


@dataclass
class TokenScores:
    """Scores of one response. All 1-D, one entry per response token.

    Attributes:
        token_ids: int64 response token ids.
        logp: log p(a_t) in nats (temperature-scaled distribution).
        entropy: H_t in nats.
        sum_p2: sum_j p_j^2.
        grad_norm: ||e_a - p||, the exact norm of d log p_a / d logits (times T).
    """

    token_ids: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    sum_p2: torch.Tensor
    grad_norm: torch.Tensor


def streaming_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp_a, entropy, sum_p2) of ``softmax(hidden @ weight.T / T)``, chunked over the vocabulary.

    Args:
        hidden: ``(tokens, d)`` hidden states (any float dtype).
        weight: ``(vocab, d)`` LM-head weight.
        targets: ``(tokens,)`` token ids whose log-prob is wanted.
        bias: optional ``(vocab,)`` LM-head bias.
    Returns float32 ``(tokens,)`` tensors.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    n, vocab = hidden.shape[0], weight.shape[0]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"target ids outside the model's vocabulary [0, {vocab})")
    dev = hidden.device
    f64 = torch.float64
    m = torch.full((n,), -float("inf"), dtype=f64, device=dev)
    s = torch.zeros(n, dtype=f64, device=dev)
    u = torch.zeros(n, dtype=f64, device=dev)
    q = torch.zeros(n, dtype=f64, device=dev)
    z_target = torch.zeros(n, dtype=f64, device=dev)
    h = hidden.float()
    for start in range(0, vocab, chunk_size):
        stop = min(vocab, start + chunk_size)
        z = h @ weight[start:stop].float().T
        if bias is not None:
            z = z + bias[start:stop].float()
        if temperature != 1.0:
            z = z / temperature
        cmax = z.max(dim=-1).values.double()
        m_new = torch.maximum(m, cmax)
        # rescale the running sums to the new max (exp(-inf) = 0 on the first chunk)
        scale = torch.exp(m - m_new)
        shift = (m - m_new)  # <= 0
        u = torch.where(s > 0, (u + s * shift) * scale, u)
        s = s * scale
        q = q * scale.square()
        zc = z.double() - m_new.unsqueeze(-1)
        e = torch.exp(zc)
        s = s + e.sum(-1)
        u = u + (e * zc).sum(-1)
        q = q + e.square().sum(-1)
        m = m_new
        in_chunk = (targets >= start) & (targets < stop)
        if in_chunk.any():
            idx = in_chunk.nonzero(as_tuple=True)[0]
            z_target[idx] = z[idx, targets[idx] - start].double()
    log_z = m + torch.log(s)
    entropy = torch.log(s) - u / s
    sum_p2 = q / s.square()
    logp = z_target - log_z
    return logp.float(), entropy.clamp(min=0).float(), sum_p2.float()


def naive_token_stats(hidden, weight, targets, *, bias=None, temperature: float = 1.0):
    """Reference: the same three statistics from the full ``(tokens, vocab)`` softmax."""
    z = hidden.float() @ weight.float().T
    if bias is not None:
        z = z + bias.float()
    z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    entropy = -(p * logp_all).sum(-1)
    return logp_all.gather(-1, targets.view(-1, 1)).squeeze(-1), entropy, p.square().sum(-1)


def lm_head_of(model) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight, bias) of a HF causal LM's output projection; refuses models that post-process logits."""
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"model config has {attr}={value!r}: its logits are not lm_head(hidden), which this chunked "
                "scorer assumes; scoring it would give wrong entropies."
            )
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to chunk over")
    return head.weight, getattr(head, "bias", None)


def _base_model(model):
    base = getattr(model, "base_model_prefix", None)
    inner = getattr(model, base, None) if base else None
    if inner is None:
        inner = getattr(model, "model", None)
    if inner is None:
        raise ValueError(f"cannot find the base transformer of {type(model).__name__}")
    return inner


@torch.no_grad()
def score_responses(
    model,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    device: Optional[torch.device | str] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> list[TokenScores]:
    """Score each ``(prompt_ids, response_ids)`` pair under ``model`` (one sequence per forward).

    The response token t is scored from the hidden state at the position before it, exactly as in
    training. ``progress`` is called with the number of pairs done after each one.
    """
    weight, bias = lm_head_of(model)
    base = _base_model(model)
    dev = torch.device(device) if device is not None else weight.device
    vocab = weight.shape[0]
    out: list[TokenScores] = []
    for i, (prompt, response) in enumerate(pairs):
        prompt = torch.as_tensor(list(prompt), dtype=torch.long)
        response = torch.as_tensor(list(response), dtype=torch.long)
        if prompt.numel() == 0:
            raise ValueError(f"pair {i}: empty prompt (the first response token needs a preceding position)")
        ids = torch.cat([prompt, response])
        if ids.numel() and int(ids.max()) >= vocab:
            raise ValueError(
                f"pair {i}: token id {int(ids.max())} >= model vocabulary {vocab}: tokenizer and model do not match"
            )
        if response.numel() == 0:
            empty = torch.zeros(0)
            out.append(TokenScores(response, empty, empty, empty, empty))
        else:
            hidden = base(input_ids=ids.unsqueeze(0).to(dev)).last_hidden_state[0]
            h = hidden[prompt.numel() - 1 : ids.numel() - 1]
            logp, ent, sp2 = streaming_token_stats(h, weight, response.to(dev), bias=bias,
                                                   temperature=temperature, chunk_size=chunk_size)
            logp, ent, sp2 = logp.cpu(), ent.cpu(), sp2.cpu()
            out.append(TokenScores(response, logp, ent, sp2, logit_grad_norm(logp, sp2)))
        if progress is not None:
            progress(i + 1)
    return out


__all__ = [
    "DEFAULT_CHUNK",
    "TokenScores",
    "lm_head_of",
    "naive_token_stats",
    "score_responses",
    "streaming_token_stats",
]
