"""CE-GPPO (Su et al., arXiv 2509.20712; released code Kwai-Klear/CE-GPPO). Pure torch, no verl import.

The PPO/DAPO loss whose clipped tokens keep a bounded gradient (``compute_gppo_loss_general_beta`` of the released
``core_algos.py``): with ``r = exp(log pi - log pi_old)`` and ``sg`` the stop-gradient,

- ``r < 1 - eps_low`` and ``A < 0``: ``-beta1 * (1 - eps_low) * r / sg(r) * A`` (the clipped value, with the gradient
  of ``r`` scaled by ``beta1 * (1 - eps_low) / r``);
- ``r > 1 + eps_high`` and ``A > 0``: ``-beta2 * (1 + eps_high) * r / sg(r) * A``;
- every other token: ``-r * A``, unclipped (the clip cannot act there: a token outside the interval on the other side
  of its advantage is not clipped by PPO either);

then verl's dual clip for ``A < 0`` (``min(-A * clip_ratio_c, .)``) and the actor's ``loss_agg_mode``. Every token is
treated (nothing is ranked: the preset's score is ``all``); the clip bounds and ``clip_ratio_c`` are the actor's.
The released loss takes the ratio unclamped (verl's vanilla loss clamps the log-ratio to +-20); so does this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from verl_tokensel.core.rules.maths import masked_mean, share
from verl_tokensel.rules import Knobs, LossTransform, Needs, Rule, knob, register_rule

NAME = "ce_gppo"


@dataclass(frozen=True)
class CeGppoKnobs(Knobs):
    ce_gppo_beta1: float = knob(
        0.75, "Gradient scale of the clipped tokens with A < 0 and r < 1 - clip_ratio_low (0: PPO's zero gradient).",
        "0.75 (the released README and 7B script; 0.5 in its 1.5B script, 0.25 its YAML default)", ge=0)
    ce_gppo_beta2: float = knob(
        1.0, "Gradient scale of the clipped tokens with A > 0 and r > 1 + clip_ratio_high (0: PPO's zero gradient).",
        "1.0 (every released script)", ge=0)


def clipped_classes(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the PPO clip clips: ``(r < 1 - clip_low and A < 0, r > 1 + clip_high and A > 0)``."""
    ratio = torch.exp(log_prob.detach() - old_log_prob.detach())
    return (ratio < 1 - clip_low) & (advantages < 0), (ratio > 1 + clip_high) & (advantages > 0)


def gppo_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                      beta1: float, beta2: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token losses and verl's metrics of the released ``compute_gppo_loss_general_beta``."""
    if not clip_ratio_c > 1.0:  # the error verl's vanilla loss and the released loss raise here (an assert)
        raise AssertionError(f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c} is invalid; valid values: a number "
                             "> 1 (the dual clip's lower bound of the ratio for A < 0)")
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    low, high = clipped_classes(log_prob, old_log_prob, advantages, clip_low, clip_high)
    scale = torch.where(low, beta1 * (1 - clip_low) / ratio.detach(),
                        torch.where(high, beta2 * (1 + clip_high) / ratio.detach(), torch.ones_like(ratio)))
    pg_losses1 = -advantages * ratio * scale
    pg_losses3 = -advantages * clip_ratio_c
    pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses3, pg_losses1), pg_losses1)
    mask = response_mask.to(ratio.dtype)
    metrics = {
        "actor/pg_clipfrac": masked_mean((low | high).to(ratio.dtype), mask).item(),
        "actor/ppo_kl": masked_mean(-negative_approx_kl.detach(), mask).item(),
        "actor/pg_clipfrac_lower": masked_mean(
            (torch.gt(pg_losses1, pg_losses3) & (advantages < 0)).to(ratio.dtype), mask).item(),
    }
    return pg_losses, metrics


@register_rule(NAME, knobs=CeGppoKnobs, needs=Needs(normalisers=("all",), policy_loss=True))
class CeGppo(Rule):
    """Every token keeps its gradient; the clipped ones a bounded one (the policy loss of the rule's own)."""

    def transform(self, x) -> LossTransform:
        k = x.knobs
        return LossTransform(token_loss=partial(gppo_token_losses, beta1=k.ce_gppo_beta1, beta2=k.ce_gppo_beta2))

    def stats(self, x) -> dict[str, float]:
        if x.old_log_prob is None or x.advantages is None:
            return {}
        low, high = clipped_classes(x.log_prob, x.old_log_prob, x.advantages, x.clip_ratio_low, x.clip_ratio_high)
        n = int(x.tokens.sum())
        return {"low_clipped_share": share(int((low & x.tokens).sum()), n),
                "high_clipped_share": share(int((high & x.tokens).sum()), n)}


__all__ = ["CeGppo", "CeGppoKnobs", "clipped_classes", "gppo_token_losses"]
