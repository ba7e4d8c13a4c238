"""STAPO's spurious tokens (Liu et al., "STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare
Spurious Tokens", arXiv 2602.15620, Sec. 3). Pure torch, no verl import.

A token is spurious when ``A > 0`` (a correct response), ``pi(o_t) < tau_p`` and ``H_t < tau_h``, all strict, where
``tau_h`` is the ``q``-quantile of the entropy "over the low-probability tokens within correct responses in each
mini-batch" (the candidates ``A > 0, pi < tau_p``); ``pi`` and ``H`` are the policy's at the start of the
mini-batch's update (the paper's Algorithm 1). STAPO's loss is the token-mean over the other tokens only.

Exact over the data-parallel ranks: the candidates are counted over the group, and the ``ceil(q (n - 1))``
lowest-entropy candidates of the ``n`` (the exact distributed bottom-k, ties by rank then position) are spurious:
with distinct entropies, exactly the candidates with ``H < torch.quantile(H, q)`` (linear interpolation).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.cov import pooled_count
from verl_tokensel.core.dist_topk import topk_mask_distributed
from verl_tokensel.core.pools import world_size
from verl_tokensel.core.select import keep_first_k


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


__all__ = ["quantile_below_count", "spurious_tokens", "stapo_candidates"]
