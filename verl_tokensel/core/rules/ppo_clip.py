"""verl's vanilla PPO/DAPO clip per token, with per-token clip bounds: the policy loss of a rule whose selected
tokens get their own bounds (Archer's entropy classes). Pure torch, no verl import.

Same conventions as ``compute_policy_loss_vanilla`` of verl 0.9.1: the log-ratio clamped to +-20, the dual clip
``-A * clip_ratio_c`` for ``A < 0``, the same metrics (``pg_clipfrac`` counts every token the clip clipped, whatever
its bound). Aggregated by the glue with verl's ``agg_loss``; without per-token bounds it is verl's vanilla loss bit
for bit (also registered in verl's policy-loss registry as ``tokensel_ppo_clip``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verl_tokensel.core.rules.maths import masked_mean


def _ratio_bound(bound, fallback: float, sign: float) -> Any:
    """``1 + sign * bound`` for a scalar or a per-token float64 tensor (computed in float64 then cast, so a token
    whose bound equals the config's scalar gets the scalar's float32 bound, as verl's clamp does)."""
    if bound is None:
        return 1 + sign * fallback
    if isinstance(bound, torch.Tensor):
        return (1 + sign * bound.to(torch.float64)).to(torch.float32)
    return 1 + sign * bound


def ppo_clip_token_losses(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                          response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float,
                          token_clip_low: Optional[torch.Tensor] = None, token_clip_high: Optional[torch.Tensor] = None,
                          classes: Optional[torch.Tensor] = None,
                          metric_group: str = "per_token_clip") -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token losses and metrics of verl's vanilla loss with per-token bounds ``token_clip_low`` /
    ``token_clip_high`` (float64 tensors; None: the actor's ``clip_low`` / ``clip_high``). ``classes`` (bool, the
    selected tokens): adds the clip fraction of each class, ``tokensel/<metric_group>/clipfrac_selected`` /
    ``_unselected``."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c} is invalid; valid values: a number > 1 "
                         "(the dual clip's lower bound of the ratio for A < 0)")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    low_t, high_t = token_clip_low, token_clip_high
    if (low_t is None) != (high_t is None):  # torch.clamp takes two tensors or two numbers
        low_t = torch.full_like(high_t, clip_low, dtype=torch.float64) if low_t is None else low_t
        high_t = torch.full_like(low_t, clip_high, dtype=torch.float64) if high_t is None else high_t
    pg_losses2 = -advantages * torch.clamp(ratio, _ratio_bound(low_t, clip_low, -1.0),
                                           _ratio_bound(high_t, clip_high, 1.0))
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    metrics = {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item(),
               "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item()}
    if classes is not None:
        clipped = torch.gt(pg_losses2, pg_losses1).float()
        for name, part in (("selected", classes), ("unselected", ~classes)):
            metrics[f"tokensel/{metric_group}/clipfrac_{name}"] = masked_mean(
                clipped, response_mask.bool() & part).detach().item()
    return pg_losses, metrics


__all__ = ["ppo_clip_token_losses"]
