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

from verl_tokensel.core.cov import pooled_count
from verl_tokensel.core.dist_topk import topk_mask_distributed
from verl_tokensel.core.errors import check_number, config_error
from verl_tokensel.core.rules.base import Ranking, Rule, knob, register_rule, share
from verl_tokensel.core.rules.checks import check_no_budget, check_ranking
from verl_tokensel.core.scopes import world_size
from verl_tokensel.core.scores import ScoreInputs, need_entropy, register_score
from verl_tokensel.core.select import keep_first_k

NAME = "stapo"


@register_score(NAME, needs_entropy=True, needs_omega=False, rule=NAME,
                help="H_t; keeps every token but STAPO's spurious ones (A > 0, pi < stapo_prob, H under the "
                     "candidates' stapo_entropy_quantile)")
def stapo_score(inp: ScoreInputs) -> torch.Tensor:
    return need_entropy(inp, NAME)


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
                    group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spurious, candidates)`` bool masks over this rank's tokens, the quantile pooled over ``group``."""
    cand = stapo_candidates(advantages, log_prob, pool, prob_threshold)
    k = quantile_below_count(pooled_count(cand, group), entropy_quantile)
    ent = entropy.detach().float()
    if group is None or world_size(group) <= 1:
        return keep_first_k(ent, cand, k, "bottom"), cand
    spurious = torch.zeros_like(cand)
    spurious[cand] = topk_mask_distributed(ent[cand], k, group, largest=False)
    return spurious, cand


@dataclass(frozen=True)
class StapoKnobs(Ranking):
    stapo_prob: float = knob(0.002, "tau_p: a spurious token has pi < tau_p (and A > 0).", "0.002 (STAPO, Sec. 5.1)")
    stapo_entropy_quantile: float = knob(
        0.75, "q: a candidate (A > 0, pi < tau_p) is spurious when its entropy is under the q quantile of the "
        "mini-batch's candidates (exact over the data-parallel ranks).",
        "0.75 (STAPO Sec. 5.1 and its hyperparameter table, the latest text; early summaries: 0.8)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("token_selection.stapo_prob", self.stapo_prob, 0.0, 1.0, "a number in (0, 1]", open_low=True)
        check_number("token_selection.stapo_entropy_quantile", self.stapo_entropy_quantile, 0.0, 1.0,
                     "a number in [0, 1]")


@register_rule(NAME)
class Stapo(Rule):
    """Every token but the spurious ones keeps the gradient; the loss averages over the kept tokens only."""

    Knobs = StapoKnobs

    def check(self, sel) -> None:
        check_ranking(sel, self)
        check_no_budget(sel, "every token but STAPO's spurious ones")
        want = (("scope", "mini_batch"), ("score_source", "prepass"), ("normaliser", "kept"))
        for key, value in want:
            if getattr(sel, key) != value:
                raise config_error(f"token_selection.{key}", getattr(sel, key), f"{value} (with score={NAME})",
                                   "STAPO takes its entropy quantile over each mini-batch's candidates, at the policy "
                                   "that starts the mini-batch's update, and averages the loss over the kept tokens "
                                   "only. Fix: use token_selector=stapo as it is (scope mini_batch, score_source "
                                   "prepass, normaliser kept).")

    def score(self, sel, batch):
        return None  # scored over the pool of finite tokens, in select

    def select(self, sel, batch, scores, pool, *, ratio, scope, dp_group):
        inp, k = batch.inputs, sel.knobs
        scores = batch.score(k.score)
        adv = batch.advantages if batch.advantages is not None else inp.advantages
        spurious, _ = spurious_tokens(adv, inp.log_prob, scores, pool, prob_threshold=k.stapo_prob,
                                      entropy_quantile=k.stapo_entropy_quantile,
                                      group=None if scope in ("micro_batch", "sequence") else dp_group)
        return pool & ~spurious, scores

    def stats(self, sel, batch, mask, scores, tokens, transform) -> dict[str, float]:
        n_spur, n_pool = int((tokens & ~mask).sum()), int(tokens.sum())
        return {f"{NAME}/spurious_tokens": float(n_spur), f"{NAME}/spurious_share": share(n_spur, n_pool)}


__all__ = ["Stapo", "StapoKnobs", "quantile_below_count", "spurious_tokens", "stapo_candidates", "stapo_score"]
