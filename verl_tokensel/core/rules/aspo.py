"""ASPO (arXiv 2510.06062; released code wizard-III/Archer2.0, ``compute_policy_loss_archer``). Pure torch, no verl
import.

Per response, the tokens above its 0.8 entropy quantile (current policy; ``budget=quantile``, ``ratio`` 0.2, as
Archer) get the wider clip bounds ``aspo_clip_ratio_low`` / ``_high`` (0.4 / 0.4); the others the actor's
(0.2 / 0.2 in the released script). With ``r = exp(clamp(log pi - log pi_old, +-20))``:

- ``A < 0``: ``rn = max(r, 1 - eps_low)``; the loss ``-A rn``, and where ``rn > clip_ratio_c`` the dual clip
  ``-A * clip_ratio_c * log pi`` (the gradient of ``log pi`` scaled by the constant);
- ``A > 0``, the flipped ratio: ``rp = min(r, 1 + eps_high)``; the loss ``-A (rp / sg(rp)) / sg(rp)`` (value ``-A /
  rp``, gradient that of ``-A rp`` divided by ``rp^2``: ``-A grad(log pi) / r`` where unclipped), and where ``1 / rp
  > clip_ratio_c`` the soft dual clip ``-A * clip_ratio_c * log pi``;

then the actor's ``loss_agg_mode``. The released call hard-codes 0.2 / 0.4 and 3.0 for both signs; here the
low-entropy bounds and ``clip_ratio_c`` are the actor's (the released script sets 0.2 and 3.0) and the high-entropy
bounds the knobs. The released mask named ``high_entropy_mask`` holds the LOW-entropy tokens (``<= q80``) and its
bound names are swapped to match, so the two inversions cancel: the high-entropy tokens get 0.4, as here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
import torch

from verl_tokensel.core.rules.maths import masked_mean, share
from verl_tokensel.rules import LossTransform, Needs, Ranking, Rule, knob, register_rule

NAME = "aspo"


@dataclass(frozen=True)
class AspoKnobs(Ranking):
    aspo_clip_ratio_low: float = knob(
        0.4, "The high-entropy tokens' lower clip ratio (A < 0: r is clipped below at 1 - this); the others keep "
        "the actor's clip_ratio_low.", "0.4 (Archer2.0, its compute_policy_loss_archer call)", ge=0, lt=1)
    aspo_clip_ratio_high: float = knob(
        0.4, "The high-entropy tokens' upper clip ratio (A > 0: r is clipped above at 1 + this); the others keep "
        "the actor's clip_ratio_high.", "0.4 (Archer2.0, its compute_policy_loss_archer call)", ge=0, lt=1)


def aspo_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                      selected: torch.Tensor, selected_low: float, selected_high: float,
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token losses and metrics of the released ``compute_policy_loss_archer`` (``selected``: the
    high-entropy tokens, which get ``selected_low`` / ``selected_high``; the others ``clip_low`` / ``clip_high``)."""
    if not clip_ratio_c > 1.0:  # the error the released loss (an assert) and verl's vanilla loss raise here
        raise AssertionError(f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c} is invalid; valid values: a number "
                             "> 1 (the dual clips' bound)")
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    low = torch.where(selected, 1 - selected_low, 1 - clip_low).to(ratio.dtype)
    high = torch.where(selected, 1 + selected_high, 1 + clip_high).to(ratio.dtype)
    neg_ratio = torch.maximum(ratio, low)
    pos_ratio = torch.minimum(ratio, high)
    neg_dual = neg_ratio > clip_ratio_c
    pos_dual = 1 / pos_ratio > clip_ratio_c
    dual_losses = -advantages * clip_ratio_c * log_prob
    neg_losses = torch.where(neg_dual, dual_losses, -advantages * neg_ratio)
    pos_losses = torch.where(pos_dual, dual_losses,
                             -advantages * (pos_ratio / pos_ratio.detach()) / pos_ratio.detach())
    pg_losses = torch.where(advantages < 0, neg_losses, pos_losses)
    mask = response_mask.to(ratio.dtype)
    clip_ratio = torch.where(advantages < 0, neg_ratio, pos_ratio)
    metrics = {
        "actor/pg_clipfrac": masked_mean(torch.gt(ratio, clip_ratio).to(ratio.dtype), mask).item(),
        "actor/pg_clipfrac_lower": masked_mean(torch.lt(ratio, clip_ratio).to(ratio.dtype), mask).item(),
        f"tokensel/{NAME}/negative_dual_clipfrac": masked_mean(
            neg_dual.to(ratio.dtype), mask * (advantages < 0)).item(),
        f"tokensel/{NAME}/positive_dual_clipfrac": masked_mean(
            pos_dual.to(ratio.dtype), mask * (advantages > 0)).item(),
    }
    return pg_losses, metrics


@register_rule(NAME, knobs=AspoKnobs, needs=Needs(normalisers=("all",), policy_loss=True))
class Aspo(Rule):
    """High-entropy tokens (per-response quantile) get wider bounds; positive-advantage tokens the flipped ratio."""

    def transform(self, x) -> LossTransform:
        k = x.knobs
        return LossTransform(token_loss=partial(aspo_token_losses, selected=x.mask & x.tokens,
                                                selected_low=k.aspo_clip_ratio_low,
                                                selected_high=k.aspo_clip_ratio_high))

    def stats(self, x) -> dict[str, float]:
        n_sel, n_pool = int((x.mask & x.tokens).sum()), int(x.tokens.sum())
        return {"selected_tokens": float(n_sel), "selected_share": share(n_sel, n_pool)}


__all__ = ["Aspo", "AspoKnobs", "aspo_token_losses"]
