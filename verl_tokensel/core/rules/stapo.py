"""STAPO (Liu et al., "STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens", arXiv
2602.15620, Sec. 3): the spurious tokens leave the loss. Pure torch, no verl import.

A token is spurious when ``A > 0`` (a correct response), ``pi(o_t) < tau_p`` and ``H_t < tau_h``, all strict, where
``tau_h`` is the ``q``-quantile of the entropy "over the low-probability tokens within correct responses in each
mini-batch" (the candidates ``A > 0, pi < tau_p``); ``pi`` and ``H`` are the policy's at the start of the
mini-batch's update (the paper's Algorithm 1: the pre-pass). STAPO's loss is the token-mean over the other tokens
only (``normaliser=kept``). docs/toolbox.md says which version of the paper the defaults follow.

Exact over the data-parallel ranks: the candidates are counted over the group, and the ``ceil(q (n - 1))``
lowest-entropy candidates of the ``n`` (the exact distributed bottom-k, ties by rank then position) are spurious:
with distinct entropies, exactly the candidates with ``H < torch.quantile(H, q)`` (linear interpolation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.rules.maths import share
from verl_tokensel.rules import Knobs, Needs, Pool, Rule, config_error, knob, register_rule, register_score

NAME = "stapo"


@register_score(NAME, needs_entropy=True, needs_omega=False, rule=NAME,
                help="H_t; keeps every token but STAPO's spurious ones (A > 0, pi < stapo_prob, H under the "
                     "candidates' stapo_entropy_quantile)")
def stapo_score(inp) -> torch.Tensor:
    return inp.need_entropy(NAME)


def stapo_candidates(advantages: torch.Tensor, log_prob: torch.Tensor, pool: torch.Tensor,
                     prob_threshold: float) -> torch.Tensor:
    """Candidates of the entropy quantile: pool tokens with ``A > 0`` and ``pi < prob_threshold``."""
    return pool.to(torch.bool) & (advantages.detach() > 0) & (torch.exp(log_prob.detach().float()) < prob_threshold)


def quantile_below_count(n: int, q: float) -> int:
    """How many of ``n`` distinct values lie strictly below their linear-interpolation ``q``-quantile:
    ``ceil(q (n - 1))``."""
    if n <= 1:
        return 0
    return int(math.ceil(q * (n - 1) - 1e-9))


def spurious_tokens(advantages: torch.Tensor, log_prob: torch.Tensor, entropy: torch.Tensor, pool: torch.Tensor,
                    *, prob_threshold: float, entropy_quantile: float,
                    dp_group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spurious, candidates)`` bool masks over this rank's tokens, the quantile pooled over ``dp_group``."""
    cand = stapo_candidates(advantages, log_prob, pool, prob_threshold)
    pool_ranks = Pool(dp_group)
    k = quantile_below_count(pool_ranks.count(cand), entropy_quantile)
    return pool_ranks.top_k(entropy.detach().float(), cand, k, largest=False), cand


@dataclass(frozen=True)
class StapoKnobs(Knobs):
    stapo_prob: float = knob(0.002, "tau_p: a spurious token has pi < tau_p (and A > 0).", "0.002 (STAPO, Sec. 5.1)",
                             gt=0, le=1)
    stapo_entropy_quantile: float = knob(
        0.75, "q: a candidate (A > 0, pi < tau_p) is spurious when its entropy is under the q quantile of the "
        "mini-batch's candidates (exact over the data-parallel ranks).",
        "0.75 (STAPO Sec. 5.1 and its hyperparameter table, the latest text; early summaries: 0.8)", ge=0, le=1)


@register_rule(NAME, knobs=StapoKnobs, needs=Needs(scores=(NAME,)))
class Stapo(Rule):
    """Every token but the spurious ones keeps the gradient; the loss averages over the kept tokens only."""

    def check(self, c) -> None:
        want = (("scope", "mini_batch"), ("score_source", "prepass"), ("normaliser", "kept"))
        for key, value in want:
            if getattr(c, key) != value:
                raise config_error(f"token_selection.{key}", getattr(c, key), f"{value} (with score={NAME})",
                                   "STAPO takes its entropy quantile over each mini-batch's candidates, at the policy "
                                   "that starts the mini-batch's update, and averages the loss over the kept tokens "
                                   "only. Fix: use token_selector=stapo as it is (scope mini_batch, score_source "
                                   "prepass, normaliser kept).")

    def score(self, x):
        return None  # scored over the pool of finite tokens, in select

    def select(self, x):
        k = x.knobs
        x.scores = x.score(NAME)
        adv = x.advantages if x.advantages is not None else x.weighted_advantages
        spurious, _ = spurious_tokens(adv, x.log_prob, x.scores, x.tokens, prob_threshold=k.stapo_prob,
                                      entropy_quantile=k.stapo_entropy_quantile,
                                      dp_group=None if x.scope in ("micro_batch", "sequence") else x.dp_group)
        return x.tokens & ~spurious

    def stats(self, x) -> dict[str, float]:
        n_spur, n_pool = int((x.tokens & ~x.mask).sum()), int(x.tokens.sum())
        return {"spurious_tokens": float(n_spur), "spurious_share": share(n_spur, n_pool)}


__all__ = ["Stapo", "StapoKnobs", "quantile_below_count", "spurious_tokens", "stapo_candidates", "stapo_score"]
