"""Per-token scores of responses under a causal LM, chunked over the vocabulary (``analyze``, ``compare``, ``view``).

Memory stays bounded: the full ``(tokens, vocab)`` logits are never materialised. The LM head is applied
one vocabulary chunk at a time and an online (streaming) softmax accumulates, per token, the max, the
partition sum and the sums that give the entropy H (nats), sum_j p_j^2 and log p_a; the combine over chunks is
float64, so the result matches a float64 full softmax to ~1e-6 relative, and a near-certain token keeps a
relative-accurate ``log p`` and ``H``. Two ``(tokens, chunk_size)`` float32 buffers are reused, so the extra
peak memory is ``2 x tokens x chunk_size`` floats (``DEFAULT_CHUNK = 2048``, the fastest on CPU at
V = 151936). The maths and the measured cost: ``docs/analysis.md`` ("The scorer"), ``benchmarks/bench_scorer.py``.

Supported models: those whose logits are ``lm_head(hidden)`` (+ optional bias) of the base model's last
hidden state (Qwen2/3, Llama, Mistral, ...). Models with logit soft-capping or scaling are refused with a
clear error rather than scored wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from verl_tokensel.core.ranking.scores import logit_grad_norm

DEFAULT_CHUNK = 2048  # vocabulary columns per chunk; see the module docstring
# chunk sums below this are re-summed without their max term (see _streaming_stats)
_PEAKED_SUM = 1.01


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
        hidden: ``(tokens, d)`` hidden states (any float dtype; the matmul runs in float32).
        weight: ``(vocab, d)`` LM-head weight.
        targets: ``(tokens,)`` token ids whose log-prob is wanted.
        bias: optional ``(vocab,)`` LM-head bias.
        temperature: ``T > 0``.
        chunk_size: vocabulary columns per chunk (``> 0``; values above ``vocab`` mean one chunk).
    Returns float32 ``(tokens,)`` tensors. Runs without autograd (analysis only).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = weight.shape[0]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"target ids outside the model's vocabulary [0, {vocab})")
    with torch.no_grad():
        chunk = max(1, min(chunk_size, vocab))
        return _streaming_stats(hidden, weight, targets.reshape(-1), bias, float(temperature), chunk)


def _streaming_stats(hidden, weight, targets, bias, temperature, chunk):
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    f32, f64 = torch.float32, torch.float64
    inv_t = 1.0 / temperature
    h = hidden.to(f32)
    b = None if bias is None else bias.to(device=dev, dtype=f32)
    targets = targets.to(dev)
    n_chunks = -(-vocab // chunk)
    if n == 0 or n_chunks == 0:
        empty = torch.zeros(n, dtype=f32, device=dev)
        return empty, empty.clone(), empty.clone()

    # Bucket the targets by vocabulary chunk once (one host sync), so each chunk gathers its own.
    chunk_of = torch.div(targets, chunk, rounding_mode="floor")
    order = torch.argsort(chunk_of, stable=True)
    bounds = [0] + torch.bincount(chunk_of, minlength=n_chunks).cumsum(0).tolist()
    z_target = torch.empty(n, dtype=f32, device=dev)

    # Two reusable (tokens x chunk) float32 buffers: no per-chunk allocation (fresh large
    # allocations page-fault on every chunk on CPU) and no float64 per-element work.
    zbuf = torch.empty(n * chunk, dtype=f32, device=dev)
    ebuf = torch.empty(n * chunk, dtype=f32, device=dev)
    m = r = u = q = None  # float64 (tokens,) accumulators; m is the running max of the *raw* logits
    for k in range(n_chunks):
        start = k * chunk
        stop = min(vocab, start + chunk)
        width = stop - start
        z = zbuf[: n * width].view(n, width)
        e = ebuf[: n * width].view(n, width)
        w_t = weight[start:stop].to(f32).T
        if b is None:
            torch.mm(h, w_t, out=z)
        else:
            torch.addmm(b[start:stop], h, w_t, out=z)
        lo, hi = bounds[k], bounds[k + 1]
        if hi > lo:
            idx = order[lo:hi]
            z_target[idx] = z[idx, targets[idx] - start]
        cmax = z.amax(dim=-1, keepdim=True)
        z.sub_(cmax)  # raw differences first (exact-ish for large logits), then the temperature
        if inv_t != 1.0:
            z.mul_(inv_t)
        torch.exp(z, out=e)  # in (0, 1], the chunk max maps to exactly 1
        # The sum is carried as r = s - 1 (the max term is exactly 1), so that for a near-certain token
        # eps = s - 1 keeps its relative precision however small (log s = log1p(r)): log p_a and H of
        # such tokens, and 1 - p_a, would otherwise be rounding noise. A chunk dominated by its own
        # max (s_c < 1.01) holds exactly one e == 1 (two would make s_c >= 2): sum the others alone.
        r_c = e.sum(-1).to(f64).sub_(1.0)
        peaked = (r_c < _PEAKED_SUM - 1.0).nonzero().squeeze(-1)
        if peaked.numel():
            rest = e.index_select(0, peaked)
            r_c[peaked] = rest.masked_fill_(rest >= 1.0, 0.0).sum(-1).to(f64)
        u_c = z.mul_(e).sum(-1).to(f64)  # sum e (z - cmax) / T
        q_c = e.mul_(e).sum(-1).to(f64)  # sum e^2
        cmax = cmax.squeeze(-1).to(f64)
        if m is None:
            m, r, u, q = cmax, r_c, u_c, q_c
            continue
        # Combine (float64, tokens-sized): rescale the running sums and the chunk's sums to the new max.
        m_new = torch.maximum(m, cmax)
        d_old = (m - m_new).mul_(inv_t)  # <= 0
        d_new = (cmax - m_new).mul_(inv_t)  # <= 0
        a_old, a_new = torch.exp(d_old), torch.exp(d_new)
        s, s_c = r + 1.0, r_c + 1.0
        u = (u + s * d_old).mul_(a_old).add_((u_c + s_c * d_new).mul_(a_new))
        # the side holding the new max contributes its own r (its "1" is the new max term)
        r = torch.where(cmax > m, r_c + s * a_old, r + s_c * a_new)
        q = (q * a_old.square()).add_(q_c * a_new.square())
        m = m_new
    log_s = torch.log1p(r)
    s = r + 1.0
    logp = (z_target.to(f64) - m).mul_(inv_t).sub_(log_s)
    entropy = log_s - u / s
    sum_p2 = q / s.square()
    return logp.float(), entropy.clamp(min=0).float(), sum_p2.float()


def naive_token_stats(hidden, weight, targets, *, bias=None, temperature: float = 1.0, dtype=torch.float32):
    """Reference: the same three statistics from the full ``(tokens, vocab)`` softmax, computed in ``dtype``."""
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
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
