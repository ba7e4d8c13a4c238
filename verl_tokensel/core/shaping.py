"""Advantage shaping and Lopti's update phases: per-token reweighting rules, no ranking. Pure torch, no verl import.

- AR, Advantage Reweighting (Yang et al., "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
  arXiv 2505.12929; released code zhyang2226/AR-Lopti, ``ray_trainer.py``, ``reweight_method=both_linear_normal``):
  ``A'_t = (alpha * pi_old(o_t) + 1 - alpha) * A_t`` on every token, ``pi_old = exp(old_log_prob)`` of the sampled
  token (a constant: no gradient). The released code applies it once per step on the driver; the weight reads only
  the old log-prob, so applying it in each micro-batch's loss gives the same numbers.
- Lopti, Low-Probability Token Isolation (same paper and code): the tokens with ``pi_old < eta`` (strict) are
  updated in a first whole update pass, the others in a second one; in each pass the other tokens' advantages (and
  KL / entropy terms) are zeroed but stay in the denominators, and both passes use the step's old log-probs.
- Entropy advantage shaping (Cheng et al., "Reasoning with Exploration: An Entropy Perspective", arXiv 2506.14758,
  Sec. 3.2, Eq. 5-6): ``A'_t = A_t + min(alpha * H_t.detach(), |A_t| / kappa)`` on every token, ``H_t`` the current
  policy's entropy at the token (the update pass's).
"""

from __future__ import annotations

from typing import Optional

import torch

#: advantage shaping rules (token_selection.shaping)
SHAPINGS = ("none", "ar", "entropy")
#: update schedules (token_selection.phases): one pass, or Lopti's two
PHASES = ("one", "lopti")
#: the non-tensor key the driver sets on each Lopti update pass (1: pi_old < eta, 2: the rest)
LOPTI_PHASE_KEY = "tokensel_lopti_phase"


def ar_weight(old_log_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """AR's per-token factor ``alpha * exp(old_log_prob) + 1 - alpha`` (float32, in [1 - alpha, 1])."""
    return (alpha * torch.exp(old_log_prob.detach().float()) + (1.0 - alpha)).float()


def entropy_shift(advantages: torch.Tensor, entropy: torch.Tensor, alpha: float, kappa: float) -> torch.Tensor:
    """The entropy term ``min(alpha * H.detach(), |A| / kappa)`` added to the advantage (float32, >= 0)."""
    adv = advantages.detach().float()
    return torch.minimum(alpha * entropy.detach().float(), adv.abs() / kappa)


def lopti_low(old_log_prob: torch.Tensor, eta: float) -> torch.Tensor:
    """Lopti's first-phase tokens: ``exp(old_log_prob) < eta`` (the released code's strict comparison)."""
    return torch.exp(old_log_prob.detach().float()) < eta


def lopti_active(old_log_prob: torch.Tensor, eta: float, phase: int) -> torch.Tensor:
    """The tokens phase ``phase`` (1 or 2) updates: the low-probability ones, then the rest."""
    if phase not in (1, 2):
        raise ValueError(f"Lopti phase must be 1 or 2, got {phase!r}")
    low = lopti_low(old_log_prob, eta)
    return low if phase == 1 else ~low


def shaped_advantages(kind: str, advantages: torch.Tensor, *, old_log_prob: Optional[torch.Tensor] = None,
                      entropy: Optional[torch.Tensor] = None, alpha: float = 0.0,
                      kappa: float = 2.0) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(weight, shift)`` of ``A' = weight * A + shift`` for the shaping ``kind`` (None where it leaves A as is)."""
    if kind == "none":
        return None, None
    if kind == "ar":
        if old_log_prob is None:
            raise ValueError("shaping=ar needs the old log-probs of the sampled tokens")
        return ar_weight(old_log_prob, alpha), None
    if kind == "entropy":
        if entropy is None:
            raise ValueError("shaping=entropy needs the policy entropy of the update pass: set "
                             "actor_rollout_ref.actor.calculate_entropy=True (or token_selection.auto_enable_entropy)")
        return None, entropy_shift(advantages, entropy, alpha, kappa)
    raise ValueError(f"unknown shaping {kind!r}; valid: {', '.join(SHAPINGS)}")


__all__ = ["LOPTI_PHASE_KEY", "PHASES", "SHAPINGS", "ar_weight", "entropy_shift", "lopti_active", "lopti_low",
           "shaped_advantages"]
