"""SimKO ("Simple Pass@K Policy Optimization", arXiv 2510.14807; released code CLR-Lab/SimKO,
``compute_policy_loss_simko`` of its ``core_algos.py``). Pure torch, no verl import.

Hot tokens: the current entropy (detached) strictly above the ``simko_quantile`` quantile (linear interpolation) of the
response's valid tokens. On a correct response's hot tokens the ratio becomes ``(1 - c) r + (c / K) sum_j carrier_j``,
``carrier_j = e^(sg d) / (e^(sg d_j) + 1e-8) * e^(d_j)``, ``d = lp - lp_old`` of the sampled token and ``d_j`` the
current log-prob of the j-th top token (with its gradient; ``x.vocab["update_top_k"]``) minus the old policy's
log-prob of ITS own j-th top token (``x.vocab["old_top_k"]``, from verl's old-log-prob pass): the value stays ``r``
(up to the 1e-8), the gradient is spread over the current top-K. On a response with negative advantage, a hot token
that is the current argmax gets ``A * simko_neg_scale``. Then the PPO clip ``max(-A r, -A clip(r, 1 - eps_low, 1 +
eps_high))`` without the dual clip, as released (symmetric 0.2 in its scripts: verl's defaults), and the actor's
``loss_agg_mode``.

A correct response is one with ``A > 0`` (the release reads ``token_level_scores.sum() == 1``, which the actor does
not receive): the same responses under a binary reward with group-normalised advantages (GRPO), where a correct
response of an all-correct group has ``A = 0`` and no gradient either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from verl_tokensel.core.rules.maths import masked_mean, share
from verl_tokensel.rules import Knobs, LossTransform, Needs, Rule, VocabStat, knob, register_rule

NAME = "simko"
OLD_TOP = VocabStat("top_k", "old", k="simko_k")
TOP = VocabStat("top_k", "update", k="simko_k")
#: a sampled token whose log-prob is this close to the largest is the argmax (the two come from one forward)
ARGMAX_TOL = 1e-6


@dataclass(frozen=True)
class SimkoKnobs(Knobs):
    simko_k: int = knob(3, "K: the current top-K log-probs that share a correct hot token's gradient.",
                        "3 (top_k, both released scripts)", ge=1)
    simko_mix: float = knob(
        0.01, "c: the share of a correct hot token's ratio carried by its top-K (1 - c stays on the sampled token).",
        "0.01 (mix_topk_coef, both released scripts)", ge=0, le=1)
    simko_quantile: float = knob(
        0.8, "tau: a token is hot when its entropy is strictly above this quantile of its response's tokens.",
        "0.8 (tau, both released scripts)", ge=0, le=1)
    simko_neg_scale: float = knob(
        1.1, "The advantage factor of a hot argmax token of a negative-advantage response.",
        "1.1 (hard-coded in the release)", ge=0)


def hot_tokens(entropy: torch.Tensor, valid: torch.Tensor, quantile: float) -> torch.Tensor:
    """Bool ``(batch, response_len)``: entropy strictly above its response's ``quantile`` (``torch.quantile``, linear)
    over the valid tokens; a response without valid tokens has none."""
    h = entropy.detach().float()
    hot = torch.zeros_like(valid, dtype=torch.bool)
    for b in range(h.shape[0]):
        row = valid[b].to(torch.bool)
        if row.any():
            hot[b] = row & (h[b] > torch.quantile(h[b][row], quantile))
    return hot


def simko_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                       mix: torch.Tensor, top: torch.Tensor, old_top: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The per-token losses of ``compute_policy_loss_simko``: ``mix`` the per-token share ``c`` (0 off the correct hot
    tokens), ``top`` / ``old_top`` the current (with gradient) / old top-K log-probs ``(batch, response_len, K)``."""
    d = log_prob - old_log_prob
    ok = response_mask.to(torch.bool).unsqueeze(-1)
    d_top = torch.where(ok, top.to(d.dtype) - old_top.to(d.dtype), 0.0)  # padding stays finite
    carriers = d.detach().exp().unsqueeze(-1) / (d_top.detach().exp() + 1e-8) * d_top.exp()
    mix = mix.float()
    ratio = torch.where(mix > 0, (1 - mix) * d.exp() + mix / top.shape[-1] * carriers.sum(-1), d.exp())
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(-advantages * ratio, clipped)
    mask = response_mask.to(pg_losses.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean(torch.gt(clipped, -advantages * ratio).to(pg_losses.dtype), mask).item(),
        "actor/ppo_kl": masked_mean(-d.detach(), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return pg_losses, metrics


@register_rule(NAME, knobs=SimkoKnobs,
               needs=Needs(entropy=True, sources={"current": ("micro_batch",)}, normalisers=("all",),
                           policy_loss=True, vocab=(OLD_TOP, TOP)))
class Simko(Rule):
    """Every token keeps its gradient; a correct response's hot tokens spread theirs over the current top-K, a
    negative response's hot argmax tokens weigh ``simko_neg_scale`` times more. ``x.mask``: the hot tokens."""

    def _parts(self, x):
        adv = x.advantages if x.advantages is not None else x.weighted_advantages
        valid = x.tokens
        hot = hot_tokens(x.entropy, valid, x.knobs.simko_quantile)
        per_response = torch.where(valid, adv, 0.0).sum(-1, keepdim=True)
        correct = (per_response > 0) & valid
        top1 = x.vocab[TOP.key][..., 0].detach().float()
        argmax = valid & (top1 - x.log_prob.detach().float() <= ARGMAX_TOL)
        boosted = (per_response < 0) & argmax & hot
        return hot, correct, boosted

    def select(self, x):
        hot, _, _ = self._parts(x)
        return hot

    def transform(self, x) -> LossTransform:
        k = x.knobs
        hot, correct, boosted = self._parts(x)
        mix = torch.where(hot & correct, float(k.simko_mix), 0.0)
        weight = torch.where(boosted, float(k.simko_neg_scale), 1.0)
        return LossTransform(advantage_weight=weight,
                             token_loss=partial(simko_token_losses, mix=mix, top=x.vocab[TOP.key],
                                                old_top=x.vocab[OLD_TOP.key]))

    def stats(self, x) -> dict[str, float]:
        hot, correct, boosted = self._parts(x)
        n = int(x.tokens.sum())
        return {"hot_share": share(int(hot.sum()), n), "mixed_share": share(int((hot & correct).sum()), n),
                "boosted_share": share(int(boosted.sum()), n), "correct_share": share(int(correct.sum()), n)}


__all__ = ["Simko", "SimkoKnobs", "hot_tokens", "simko_token_losses"]
