"""Lp-Reg ("Low-probability Tokens Sustain Exploration in RLVR", arXiv 2510.03222; released code
CarlanLark/Lp-Reg-dev, ``compute_policy_loss_lp_reg`` of its ``core_algos.py``). Pure torch, no verl import.

A proxy of the old policy keeps only its confident tokens: the min-p filter (every entry whose probability, before the
temperature, is below ``kappa`` times the largest gets the logit -1e4), renormalised, read at the sampled token
(``x.vocab["old_min_p"]``, from verl's old-log-prob pass: no forward of its own). Among the valid tokens with
``A < 0``, the ``k = max(1, int(n * rho))`` with the lowest current log-prob are candidates, and only when ``k > 1``
(the release's gate: no token is regularised until the pool holds ``2 / rho`` negative tokens, 200 at ``rho`` 1%);
a candidate whose log-prob is strictly below the proxy's is regularised. Its loss is ``-A r + beta *
clamp(k3, -10, 10)``, ``k3 = e^(lp_proxy - lp) - (lp_proxy - lp) - 1`` (the sampled token only, no clip); every other
token the PPO clip ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` without the dual clip, as released; the
actor's ``loss_agg_mode`` (token-mean in every script).

The pool is the whole mini-batch over every data-parallel rank by default (``scope=mini_batch``, measured at the
mini-batch's start: the weights every micro-batch of it is updated from), exact; the release's per-micro-batch pool
(which depends on how dynamic batching packs sequences) is ``scope=micro_batch score_source=current``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from verl_tokensel.core.rules.maths import masked_mean, share
from verl_tokensel.rules import Knobs, LossTransform, Needs, Pool, Rule, VocabStat, knob, register_rule, register_score

NAME = "lp_reg"
#: the proxy, from verl's old-log-prob pass
PROXY = VocabStat("min_p", "old", kappa="lp_reg_kappa")


@register_score(NAME, needs_entropy=False, needs_omega=False, rule=NAME,
                help="log pi(a_t), detached: Lp-Reg's candidates are the lowest among the A < 0 tokens")
def lp_reg_score(inp) -> torch.Tensor:
    return inp.log_prob.detach().float()


@dataclass(frozen=True)
class LpRegKnobs(Knobs):
    lp_reg_kappa: float = knob(
        0.02, "kappa: the proxy keeps the old policy's tokens with p >= kappa * p_max (before the temperature) and "
        "renormalises.", "0.02 (minp_p_threshold, every released script)", gt=0, le=1)
    lp_reg_rho: float = knob(
        0.01, "rho: the share of the pool's A < 0 tokens, lowest current log-prob first, that are candidates "
        "(k = max(1, int(n * rho)); none when k = 1).",
        "0.01 (logp_neg_k_percent, the Qwen3-14B scripts; 0.005 for Qwen2.5-32B)", gt=0, le=1)
    lp_reg_beta: float = knob(
        1.0, "beta: the weight of the clamped k3 term of a regularised token.",
        "1.0 (ppo_kl_coef, every released script)", ge=0)


def regularised_tokens(log_prob: torch.Tensor, proxy: torch.Tensor, advantages: torch.Tensor, tokens: torch.Tensor,
                       rho: float, pool: Pool) -> tuple[torch.Tensor, int]:
    """``(regularised, k)``: the candidates (the ``k`` lowest ``log_prob`` among the ``A < 0`` tokens of the pool, over
    its ranks; none when ``k <= 1``) whose log-prob is strictly below the proxy's."""
    negative = tokens & (advantages < 0)
    k = max(1, int(pool.count(negative) * rho))
    if k <= 1:
        return torch.zeros_like(tokens), k
    candidates = pool.top_k(log_prob.float(), negative, k, largest=False)
    return candidates & (log_prob < proxy), k


def lp_reg_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                        regularised: torch.Tensor, proxy: torch.Tensor,
                        beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token losses of ``compute_policy_loss_lp_reg``: the PPO clip without the dual clip (the release reads
    ``clip_ratio_c`` and never passes it), the regularised tokens ``-A r + beta * clamp(k3, -10, 10)``."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(-advantages * ratio, clipped)
    reg = regularised.to(torch.bool) & response_mask.to(torch.bool)
    gap = torch.where(reg, proxy.to(log_prob.dtype) - log_prob, 0.0)  # only where regularised: finite elsewhere
    k3 = (torch.exp(gap) - gap - 1).clamp(-10, 10)
    pg_losses = torch.where(reg, -advantages * ratio + beta * k3, pg_losses)
    mask = response_mask.to(ratio.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean((torch.gt(clipped, -advantages * ratio) & ~reg).to(ratio.dtype), mask).item(),
        "actor/ppo_kl": masked_mean(-(log_prob - old_log_prob).detach(), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return pg_losses, metrics


@register_rule(NAME, knobs=LpRegKnobs,
               needs=Needs(scores=(NAME,), sources={"prepass": ("mini_batch",), "current": ("micro_batch",)},
                           normalisers=("all",), policy_loss=True, vocab=(PROXY,)))
class LpReg(Rule):
    """Every token keeps its gradient; the regularised ones (``x.mask``) get the proxy's k3 term instead of the clip."""

    def score(self, x):
        return None  # the candidates are ranked in select, among the A < 0 tokens only

    def select(self, x):
        x.scores = x.score(NAME)
        adv = x.advantages if x.advantages is not None else x.weighted_advantages
        reg, _ = regularised_tokens(x.scores, x.vocab[PROXY.key], adv, x.tokens, x.knobs.lp_reg_rho, x.pool)
        return reg

    def transform(self, x) -> LossTransform:
        return LossTransform(token_loss=partial(lp_reg_token_losses, regularised=x.mask, beta=x.knobs.lp_reg_beta,
                                                proxy=x.vocab[PROXY.key]))

    def stats(self, x) -> dict[str, float]:
        proxy = x.vocab[PROXY.key]
        n = int(x.tokens.sum())
        filtered = x.tokens & (proxy < -1000)  # the sampled token outside the proxy (logit -1e4): never regularised
        adv = x.advantages if x.advantages is not None else x.weighted_advantages
        return {"regularised_tokens": float(x.mask.sum()), "regularised_share": share(int(x.mask.sum()), n),
                "negative_share": share(int((x.tokens & (adv < 0)).sum()), n),
                "filtered_share": share(int(filtered.sum()), n)}


__all__ = ["LpReg", "LpRegKnobs", "lp_reg_score", "lp_reg_token_losses", "regularised_tokens"]
