"""Lopti, Low-Probability Token Isolation (Yang et al., "Do Not Let Low-Probability Tokens Over-Dominate in RL for
LLMs", arXiv 2505.12929; released code zhyang2226/AR-Lopti, ``ray_trainer.py``). Pure torch, no verl import.

The tokens with ``pi_old < eta`` (strict) are updated in a first whole update pass (every mini-batch, every epoch),
the others in a second one; in each pass the other tokens' advantages, KL and entropy terms are zeroed but stay in
the denominators, and both passes use the step's old log-probs, so a step makes twice the optimizer and lr-scheduler
steps. The drivers run the passes the rule asks for (:meth:`Lopti.update_passes`) and merge their metrics as the
released code does (:meth:`Lopti.merge_pass_metrics`); the loss gets the pass number and applies
:meth:`Lopti.transform`. Any ranking may feed it (``gmts`` + Lopti: the passes split the selected tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_tokensel.rules import Knobs, LossTransform, Needs, Rule, knob, register_rule

NAME = "lopti"
#: actor metrics also reported per pass (``tokensel/lopti/phase<n>/<key>``)
PER_PASS_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl")


def low_probability(old_log_prob: torch.Tensor, eta: float) -> torch.Tensor:
    """The first pass's tokens: ``exp(old_log_prob) < eta`` (the released code's strict comparison)."""
    return torch.exp(old_log_prob.detach().float()) < eta


def active_tokens(old_log_prob: torch.Tensor, eta: float, update_pass: int) -> torch.Tensor:
    """The tokens pass ``update_pass`` (1 or 2) updates: the low-probability ones, then the rest."""
    if update_pass not in (1, 2):
        raise ValueError(f"Lopti's update pass must be 1 or 2, got {update_pass!r}")
    low = low_probability(old_log_prob, eta)
    return low if update_pass == 1 else ~low


@dataclass(frozen=True)
class LoptiKnobs(Knobs):
    lopti_eta: float = knob(0.5, "The first pass updates the tokens with pi_old < eta (strict).",
                            "0.5 (paper; AR-Lopti script); 0.4 (Lopti-only script)", gt=0, le=1)


@register_rule(NAME, knobs=LoptiKnobs, needs=Needs(passes=2))
class Lopti(Rule):
    """Two whole update passes: the low-probability tokens first, then the rest."""

    def merge_passes(self, per_pass: list[dict[str, Any]]) -> dict[str, Any]:
        """The released code's merge: numbers averaged over the passes that report them, lists concatenated; plus
        :data:`PER_PASS_KEYS` of each pass under ``tokensel/lopti/phase<n>/``."""
        merged: dict[str, Any] = {}
        for key in dict.fromkeys(k for m in per_pass for k in m):
            values = [m[key] for m in per_pass if key in m]
            if all(isinstance(v, list) for v in values):
                merged[key] = [x for v in values for x in v]
            else:
                try:
                    merged[key] = sum(float(v) for v in values) / len(values)
                except (TypeError, ValueError):
                    merged[key] = values[-1]
        for n, m in enumerate(per_pass, start=1):
            for key in PER_PASS_KEYS:
                if key in m:
                    v = m[key]
                    merged[f"tokensel/{NAME}/phase{n}/{key}"] = sum(v) / len(v) if isinstance(v, list) and v else v
        return merged

    def transform(self, x) -> LossTransform:
        if x.update_pass is None:  # outside the loss (the driver's, the pre-pass's selection): no zeroing
            return LossTransform(gate=x.mask)
        active = active_tokens(x.old_log_prob, x.knobs.lopti_eta, x.update_pass).to(torch.float32)
        return LossTransform(gate=x.mask, advantage_weight=active, kl_weight=active, entropy_weight=active)

    def stats(self, x) -> dict[str, float]:
        tokens = x.tokens
        n_pool = int(tokens.sum())
        if not n_pool:
            return {}
        out = {"low_share": float((low_probability(x.old_log_prob, x.knobs.lopti_eta) & tokens).sum()) / n_pool}
        if x.transform.entropy_weight is not None:
            out["active_share"] = float(x.transform.entropy_weight[tokens].sum()) / n_pool
        return out


__all__ = ["Lopti", "LoptiKnobs", "PER_PASS_KEYS", "active_tokens", "low_probability"]
