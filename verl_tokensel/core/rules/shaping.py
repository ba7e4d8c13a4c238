"""Advantage shapings: per-token reweighting, no ranking, run before the rule (``token_selection.shaping``). Pure
torch, no verl import.

- ``ar``, Advantage Reweighting (Yang et al., "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
  arXiv 2505.12929; released code zhyang2226/AR-Lopti, ``ray_trainer.py``, ``reweight_method=both_linear_normal``):
  ``A'_t = (alpha * pi_old(o_t) + 1 - alpha) * A_t``, ``pi_old = exp(old_log_prob)`` of the sampled token (a
  constant: no gradient). The released code applies it once per step on the driver; the weight reads only the old
  log-prob, so applying it in each micro-batch's loss gives the same numbers.
- ``entropy_adv`` (Cheng et al., "Reasoning with Exploration: An Entropy Perspective",
  arXiv 2506.14758, Sec. 3.2, Eq. 5-6): ``A'_t = A_t + min(alpha * H_t.detach(), |A_t| / kappa)``, ``H_t`` the
  current policy's entropy at the token (the update pass's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_tokensel.core.seam.shaping import Shaping, register_shaping
from verl_tokensel.rules import Knobs, Needs, knob


def ar_weight(old_log_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """AR's per-token factor ``alpha * exp(old_log_prob) + 1 - alpha`` (float32, in [1 - alpha, 1])."""
    return (alpha * torch.exp(old_log_prob.detach().float()) + (1.0 - alpha)).float()


def entropy_shift(advantages: torch.Tensor, entropy: torch.Tensor, alpha: float, kappa: float) -> torch.Tensor:
    """The entropy term ``min(alpha * H.detach(), |A| / kappa)`` added to the advantage (float32, >= 0)."""
    adv = advantages.detach().float()
    return torch.minimum(alpha * entropy.detach().float(), adv.abs() / kappa)


@dataclass(frozen=True)
class ARKnobs(Knobs):
    ar_alpha: float = knob(0.3, "alpha in [0, 1] of A * (alpha * pi_old + 1 - alpha).",
                           "0.3 (K&K figure, AR-Lopti script); 0.2 (AR-only script); 0.1 (math table)", ge=0, le=1)


@register_shaping("ar", knobs=ARKnobs)
class AdvantageReweighting(Shaping):
    """A * (ar_alpha * pi_old + 1 - ar_alpha)"""

    source = "AR, arXiv 2505.12929"

    def shape(self, x, advantages):
        if x.old_log_prob is None:
            raise ValueError("shaping=ar needs the old log-probs of the sampled tokens")
        return ar_weight(x.old_log_prob, x.knobs.ar_alpha), None

    def stats(self, x):
        if not x.tokens.any():
            return {}
        return {"mean_weight": float(ar_weight(x.old_log_prob, x.knobs.ar_alpha)[x.tokens].mean())}


@dataclass(frozen=True)
class EntropyKnobs(Knobs):
    entropy_alpha: float = knob(0.4, "alpha of min(alpha * H, |A| / kappa).", "0.4 (GRPO); 0.1 (PPO)", ge=0)
    entropy_kappa: float = knob(2.0, "kappa > 1 of min(alpha * H, |A| / kappa): the shaped advantage keeps its sign "
                                "(the paper's condition; its value is 2).", "2", gt=1)


@register_shaping("entropy_adv", knobs=EntropyKnobs, needs=Needs(entropy=True))
class EntropyShaping(Shaping):
    """A + min(entropy_alpha * H, |A| / entropy_kappa), H the update pass's entropy, detached"""

    source = "arXiv 2506.14758"

    def shape(self, x, advantages):
        entropy, knobs = x.entropy, x.knobs
        if entropy is None:
            raise ValueError(f"shaping={self.name} needs the policy entropy of the update pass: set "
                             "actor_rollout_ref.actor.calculate_entropy=True (or token_selection.auto_enable_entropy)")
        return None, entropy_shift(advantages, entropy, knobs.entropy_alpha, knobs.entropy_kappa)

    def stats(self, x):
        shift, tokens = x.transform.advantage_shift, x.tokens
        if not tokens.any() or shift is None:
            return {}
        out = {"mean_shift": float(shift[tokens].mean())}
        if x.advantages is not None:
            capped = (shift < x.knobs.entropy_alpha * x.entropy.float()) & tokens
            out["capped_share"] = float(capped.sum()) / int(tokens.sum())
        return out


__all__ = ["ARKnobs", "AdvantageReweighting", "EntropyKnobs", "EntropyShaping", "ar_weight", "entropy_shift"]
