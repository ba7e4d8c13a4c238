"""M2PO (Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv
2510.01161; released as AReaL's ``actor.m2_threshold``, ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` of
``areal/trainer/ppo/actor.py``): the tokens with the largest second moment leave the loss. Pure torch, no verl import.

Each valid token has ``m2 = (log pi_behav - log pi_prox)^2``: ``pi_behav`` the policy that sampled it (the rollout
engine's log-probs, verl's ``rollout_log_probs``; AReaL's ``logprobs``) and ``pi_prox`` the recomputed proximal
policy (verl's ``old_log_probs``; AReaL's ``prox_logp``). Sorted from the largest down, the first ``k`` are masked,
``k`` the smallest count for which the mean ``m2`` of the rest is strictly under ``m2po_threshold``; when no count
gets there every token but one (the smallest) is masked. The masked tokens leave the loss and its denominator
(AReaL rewrites ``loss_mask``; here ``normaliser=kept``).

AReaL takes the pool per rank and per micro-batch; here it is the whole mini-batch over every data-parallel rank,
exact, with nothing of size N leaving a rank: the kept count is found by a radix descent over the float32 order of
``m2`` (4 passes, each one all-reduce of a 256-bin histogram of counts and sums of ``m2 - threshold``: the rest's
mean is under the threshold while its sum of ``m2 - threshold`` is negative), and the masked tokens are then the
exact distributed top-k (:mod:`~verl_tokensel.core.ranking.dist_topk`): ties at the boundary are masked earliest first
(lower rank, then row-major position), as a stable descending sort of the concatenated pool would order them. Both
log-probs are fixed before the update, so the score reads no policy value and the pre-pass runs no forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.rules.maths import share
from verl_tokensel.rules import Knobs, Needs, Pool, Rule, knob, register_rule, register_score

NAME = "m2po"
_BITS, _PASSES, _BINS = 8, 4, 256
_INT32_MIN = -(2**31)


@register_score(NAME, needs_entropy=False, needs_omega=False, rule=NAME, needs_rollout_log_probs=True,
                reads_policy=False,
                help="(log pi_rollout - log pi_old)^2, the second moment of the rollout-vs-recomputed log-ratio; "
                     "M2PO masks the largest until the mean of the rest is under m2po_threshold")
def m2po_score(inp) -> torch.Tensor:
    if inp.rollout_log_prob is None or inp.old_log_prob is None:
        raise ValueError(
            f"score {NAME!r} needs the rollout engine's log-probs (rollout_log_probs) and verl's recomputed "
            "old_log_probs in the update batch, and this batch has no rollout_log_probs. Fix: set "
            "actor_rollout_ref.rollout.calculate_log_probs=True and algorithm.rollout_correction.bypass_mode=False "
            "(a custom trainer must keep the field in the batch it sends to update_actor).")
    delta = inp.rollout_log_prob.detach().float() - inp.old_log_prob.detach().float()
    return delta * delta


def _key_value(ukey: int) -> float:
    """The float32 value whose unsigned order key (:meth:`~verl_tokensel.rules.Pool.order_keys` shifted to
    ``[0, 2^32)``) is ``ukey``: the key map is its own inverse on the signed int32 bits."""
    key = torch.tensor([ukey + _INT32_MIN], dtype=torch.int32)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return float(bits.view(torch.float32).item())


def kept_count(values: torch.Tensor, threshold: float, dp_group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    """``(kept, n)``: how many of the ``n`` values of the pool (this rank's 1-D ``values`` over the ranks of
    ``dp_group``, compared as float32) M2PO keeps: the largest ``m`` such that the ``m`` smallest have a mean under
    ``threshold`` (at least 1; 0 for an empty pool). Every rank gets the same pair.

    The mean of the ``m`` smallest never decreases with ``m``, so the kept counts form a prefix: a radix descent
    over the float32 order finds the value at which the running sum of ``value - threshold`` (float64, ascending)
    stops being negative, and how many of its ties still fit.
    """
    ranks = Pool(dp_group)
    ukey = Pool.order_keys(values).to(torch.int64) - _INT32_MIN
    excess = values.detach().flatten().double() - float(threshold)
    n = int(ranks.sum(torch.tensor([ukey.numel()], dtype=torch.int64, device=ukey.device)).item())
    if n == 0:
        return 0, 0
    base, below, prefix, ties = 0.0, 0, 0, 0
    for p in range(_PASSES):
        shift = 32 - _BITS * (p + 1)
        digit = (ukey >> shift) & (_BINS - 1)
        hist = torch.zeros(2, _BINS, dtype=torch.float64, device=ukey.device)
        hist[0].index_add_(0, digit, torch.ones_like(excess))
        hist[1].index_add_(0, digit, excess)
        hist = ranks.sum(hist).cpu()
        counts, sums = hist[0], hist[1]
        running = base + torch.cumsum(sums, 0)  # sum of value - threshold up to the end of each bin
        crossing = ((counts > 0) & (running >= 0)).nonzero()
        if crossing.numel() == 0:  # the whole bucket fits under the threshold
            return min(n, below + int(counts.sum().item())), n
        b = int(crossing[0])
        base = base + float(sums[:b].sum())
        below += int(counts[:b].sum().item())
        ties = int(counts[b].item())
        prefix |= b << shift
        keep = digit == b
        ukey, excess = ukey[keep], excess[keep]
    step = _key_value(prefix) - float(threshold)  # every tie adds this; base + ties * step >= 0 > base (or base 0)
    fit = 0
    if base < 0 and step > 0:
        fit = min(ties - 1, max(0, math.ceil(-base / step) - 1)) if math.isfinite(step) else 0
        while fit + 1 <= ties - 1 and base + (fit + 1) * step < 0:
            fit += 1
        while fit > 0 and base + fit * step >= 0:
            fit -= 1
    return max(1, below + fit), n


def m2po_kept_tokens(m2: torch.Tensor, pool: torch.Tensor, threshold: float,
                     dp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Bool mask over this rank's ``(batch, response_len)`` tokens: the pool tokens M2PO keeps, the pool taken over
    the ranks of ``dp_group`` (None: this tensor alone). The masked tokens are the ``n - kept`` largest ``m2``
    (:func:`kept_count`), ties earliest first (lower rank, then row-major position)."""
    pool = pool.to(torch.bool)
    values = m2.detach().float()
    ranks = Pool(dp_group)
    kept, n = kept_count(values[pool], threshold, dp_group if ranks.world > 1 else None)
    if n - kept <= 0:
        return pool.clone()
    return pool & ~ranks.top_k(values, pool, n - kept)


@dataclass(frozen=True)
class M2poKnobs(Knobs):
    m2po_threshold: float = knob(
        0.04, "tau_M2: the largest (log pi_rollout - log pi_old)^2 tokens of the mini-batch (over all data-parallel "
        "ranks) are masked until the mean of the rest is under tau; a number > 0.",
        "0.04 (M2PO paper, every experiment; AReaL examples/math/gsm8k_m2po.yaml; AReaL's default None = off)", gt=0)


@register_rule(NAME, knobs=M2poKnobs,
               needs=Needs(scores=(NAME,), sources={"prepass": ("mini_batch",)}, normalisers=("kept", "all")))
class M2po(Rule):
    """Every token but those of the largest second moment keeps the gradient; the masked ones leave the loss."""

    def select(self, x):
        return m2po_kept_tokens(x.scores, x.tokens, x.knobs.m2po_threshold, dp_group=x.dp_group)

    def stats(self, x) -> dict[str, float]:
        tokens, mask = x.tokens, x.mask
        n_masked, n_pool = int((tokens & ~mask).sum()), int(tokens.sum())
        m2 = torch.where(tokens, x.scores.float(), 0.0)
        kept = tokens & mask
        return {"masked_tokens": float(n_masked), "masked_share": share(n_masked, n_pool),
                "m2_mean": share(float(m2.sum()), n_pool),
                "kept_m2_mean": share(float(torch.where(kept, m2, 0.0).sum()), int(kept.sum()))}


__all__ = ["M2po", "M2poKnobs", "kept_count", "m2po_kept_tokens", "m2po_score"]
