"""FIPO, Future-KL Influenced Policy Optimization (Ma et al., arXiv 2603.19835; released in ms-swift as
``loss_type=fipo``, ``GRPOTrainer._compute_fipo_influence``). Pure torch, no verl import.

Each token's advantage is weighted by how the policy update has moved the rest of its response. With ``d_t = log pi
- log pi_old`` at the loss's log-probs (masked to the response; a token with ``r = exp(d_t) > clip_ratio_c`` adds
nothing, the release's ``delta``) and ``gamma = 2 ** (-1 / fipo_decay_rate)``:

- ``FutureKL_t = sum_{k >= t} gamma^(k - t) d_k`` over the tokens of the same response (0 off the response);
- ``f_t = clip(exp(FutureKL_t), lo, 1 + fipo_clip_range)``, ``lo = 1`` with ``fipo_clip_high_only`` (the release's
  default), else ``1 - fipo_clip_range``; ``fipo_clip_range = 0``: no clip;
- a token with ``A < 0`` and ``r > fipo_safety_threshold`` has ``f_t`` clamped to ``[0.8, 1]`` (0: no cap);
- ``f_t`` is detached and multiplies the advantage: ``A'_t = f_t A_t``, then verl's configured policy loss. For the
  vanilla loss this is the release's ``f_t * -min(r A, clip(r) A)`` (``f_t > 0`` commutes with the min) with verl's
  dual clip at ``clip_ratio_c`` (the release's ``delta`` bounds the ratio there too).

The weight reads the micro-batch's current log-probs, so it is computed in the loss of each micro-batch; a response
never straddles micro-batches, so the per-response sum is exact. Every token is weighted (the preset's score is
``all``); a ranking that selects fewer tokens gates the gradient as ``gradient_mask`` does and FIPO weights them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from verl_tokensel.core.rules.maths import masked_mean
from verl_tokensel.rules import Knobs, LossTransform, Needs, Rule, config_error, knob, register_rule

NAME = "fipo"
#: the release's safety cap of the weight of a negative-advantage token with a large ratio
SAFETY_CAP = (0.8, 1.0)
#: responses are summed in blocks of this many tokens (each block one matmul, the blocks chained backwards)
BLOCK = 128


@dataclass(frozen=True)
class FipoKnobs(Knobs):
    fipo_decay_rate: float = knob(
        32.0, "Half-life in tokens of the Future-KL sum: its discount is gamma = 2 ** (-1 / decay_rate); must be > 0.",
        "32 (ms-swift default and its fipo.sh)", gt=0)
    fipo_clip_range: float = knob(
        0.2, "Clip range of the influence weight exp(FutureKL): [1 - range, 1 + range] ([1, 1 + range] with "
        "fipo_clip_high_only); 0: no clip (the release's 0 / None).", "0.2 (ms-swift default and its fipo.sh)",
        ge=0)
    fipo_clip_high_only: bool = knob(
        True, "Clip the influence weight to [1, 1 + fipo_clip_range] only (a response whose future is being "
        "suppressed keeps weight 1); false: [1 - range, 1 + range], the paper's clip.",
        "true (ms-swift default); false (its fipo.sh, the paper's two-sided clip)")
    fipo_safety_threshold: float = knob(
        4.0, "A token with A < 0 and ratio r > this has its weight clamped to [0.8, 1] (it is never amplified); "
        "0: no cap (the release's None).", "4.0 (ms-swift default); 3.0 (its fipo.sh)", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.fipo_clip_high_only and not self.fipo_clip_range < 1.0:
            raise config_error("token_selection.fipo_clip_range", self.fipo_clip_range, "a number in [0, 1) (with "
                               "fipo_clip_high_only=false)", "The lower bound 1 - range must stay > 0. Fix: set "
                               "token_selection.fipo_clip_range below 1, or fipo_clip_high_only=true.")

    @property
    def gamma(self) -> float:
        return 2.0 ** (-1.0 / self.fipo_decay_rate)


def discounted_future_sum(values: torch.Tensor, gamma: float, block: int = BLOCK) -> torch.Tensor:
    """``out[b, t] = sum_{k >= t} gamma^(k - t) values[b, k]`` along the last dimension, exactly: each block of
    ``block`` positions by one matmul with its ``gamma^(k - t)`` upper-triangular matrix, plus the next block's first
    sum carried back by ``gamma^(end - t)``."""
    n_rows, length = values.shape
    out = torch.empty_like(values)
    if length == 0:
        return out
    pos = torch.arange(block, device=values.device)
    gap = pos.view(1, -1) - pos.view(-1, 1)  # gap[t, k] = k - t
    decay = torch.where(gap >= 0, torch.pow(torch.tensor(gamma, dtype=values.dtype, device=values.device),
                                            gap.clamp(min=0).to(values.dtype)), torch.zeros((), dtype=values.dtype))
    carry = torch.zeros(n_rows, dtype=values.dtype, device=values.device)
    for end in range(length, 0, -block):
        start = max(0, end - block)
        size = end - start
        back = torch.pow(torch.tensor(gamma, dtype=values.dtype, device=values.device),
                         (size - torch.arange(size, device=values.device)).to(values.dtype))  # gamma^(end - t)
        out[:, start:end] = values[:, start:end] @ decay[:size, :size].T + carry.view(-1, 1) * back.view(1, -1)
        carry = out[:, start]
    return out


class FipoWeights(NamedTuple):
    """The influence weights of one micro-batch and what they are made of (``(batch, response_len)``)."""

    weight: torch.Tensor  # f_t on the tokens, 1 elsewhere (detached, the log-probs' dtype)
    future_kl: torch.Tensor  # FutureKL_t on the tokens, 0 elsewhere (float64)
    high_clipped: torch.Tensor  # exp(FutureKL_t) above 1 + clip_range
    low_clipped: torch.Tensor  # exp(FutureKL_t) below the lower bound
    safety_capped: torch.Tensor  # A < 0 and r > fipo_safety_threshold: f_t clamped to [0.8, 1]


def fipo_weights(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, tokens: torch.Tensor,
                 *, gamma: float, clip_range: float, clip_high_only: bool, safety_threshold: Optional[float],
                 ratio_cap: Optional[float]) -> FipoWeights:
    """FIPO's influence weights (ms-swift's ``_compute_fipo_influence``): ``tokens`` the response tokens, ``ratio_cap``
    the ratio above which a token leaves the Future-KL sum (None: none leaves)."""
    with torch.no_grad():
        log_ratio = (log_prob.detach().double() - old_log_prob.detach().double())
        log_ratio = torch.where(tokens, log_ratio, torch.zeros_like(log_ratio))  # finite off the tokens
        ratio = torch.exp(log_ratio)
        shift = log_ratio if ratio_cap is None else torch.where(ratio > ratio_cap, 0.0, log_ratio)
        future_kl = torch.where(tokens, discounted_future_sum(shift, gamma), 0.0)
        raw = torch.exp(future_kl)
        high_clipped = low_clipped = torch.zeros_like(tokens)
        weight = raw
        if clip_range > 0:
            high, low = 1.0 + clip_range, 1.0 if clip_high_only else 1.0 - clip_range
            weight = raw.clamp(min=low, max=high)
            high_clipped, low_clipped = (raw > high) & tokens, (raw < low) & tokens
        capped = torch.zeros_like(tokens)
        if safety_threshold is not None:
            capped = (advantages < 0) & (ratio > safety_threshold) & tokens
            weight = torch.where(capped, weight.clamp(min=SAFETY_CAP[0], max=SAFETY_CAP[1]), weight)
        weight = torch.where(tokens, weight, 1.0).to(log_prob.dtype)
    return FipoWeights(weight, future_kl, high_clipped, low_clipped, capped)


def _weights(x) -> FipoWeights:
    k = x.knobs
    advantages = x.advantages if x.advantages is not None else torch.zeros_like(x.log_prob)
    return fipo_weights(x.log_prob, x.old_log_prob, advantages, x.tokens, gamma=k.gamma,
                        clip_range=float(k.fipo_clip_range), clip_high_only=k.fipo_clip_high_only,
                        safety_threshold=float(k.fipo_safety_threshold) or None, ratio_cap=x.clip_ratio_c)


@register_rule(NAME, knobs=FipoKnobs, needs=Needs(normalisers=("all",)))
class Fipo(Rule):
    """Every token's advantage times its clipped exp(discounted Future-KL), from the loss's current log-probs."""

    def transform(self, x) -> LossTransform:
        return LossTransform(gate=x.mask, advantage_weight=_weights(x).weight)

    def stats(self, x) -> dict[str, float]:
        w = _weights(x)
        m = x.tokens.to(torch.float64)
        return {"future_kl_mean": float(masked_mean(w.future_kl, m)),
                "influence_weight_mean": float(masked_mean(w.weight.double(), m)),
                "safety_keep_ratio": float(masked_mean((~w.safety_capped).double(), m)),
                "high_clipped_share": float(masked_mean(w.high_clipped.double(), m)),
                "low_clipped_share": float(masked_mean(w.low_clipped.double(), m))}


__all__ = ["Fipo", "FipoKnobs", "FipoWeights", "discounted_future_sum", "fipo_weights"]
