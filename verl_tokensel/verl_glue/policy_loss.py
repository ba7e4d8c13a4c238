"""The per-token policy losses a rule's transform may name, in verl's conventions (:data:`RULE_POLICY_LOSSES`), and
the adapter of a rule's own one (``LossTransform.token_loss``, :func:`rule_token_loss`).

A rule whose selected tokens get more than a gradient mask names one of these in its
:class:`~verl_tokensel.core.rules.base.LossTransform` (``policy_loss``, with its per-token ``policy_loss_args``);
verl's registered losses read the same quantities as scalars from the config, or not at all:

- ``abs_log_ratio_penalty``: verl 0.9.1's ``compute_policy_loss_kl_cov`` with the penalised tokens given (unclipped
  ``-A r`` for every token, ``+ coef * |log r|`` on the penalised ones);
- ``zeroed_tokens``: verl's ``compute_policy_loss_clip_cov`` with the zeroed tokens given (PPO clip without dual
  clip, ``* corr``);
- ``per_token_clip``: :func:`ppo_clip_per_token`, verl's ``compute_policy_loss_vanilla`` (log-ratio clamp, dual
  clip with ``clip_ratio_c``, its metrics) with per-token bounds. It is registered in verl's policy-loss registry
  as ``tokensel_ppo_clip``: without per-token bounds it is verl's vanilla loss.

Given the same tokens, each equals its verl counterpart bit for bit (tests/test_policy_loss_on_cpu.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss

from verl_tokensel.core.rules import LossTransform

PPO_CLIP_PER_TOKEN = "tokensel_ppo_clip"


def _bounds(config) -> tuple[float, float]:
    clip_ratio = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    return low, high


def _ratio_bound(bound, fallback: float, sign: float) -> Any:
    """``1 + sign * bound`` for a scalar or a per-token float64 tensor (computed in float64 then cast, so a token
    whose bound equals the config's scalar gets the scalar's float32 bound, as verl's clamp does)."""
    if bound is None:
        return 1 + sign * fallback
    if isinstance(bound, torch.Tensor):
        return (1 + sign * bound.to(torch.float64)).to(torch.float32)
    return 1 + sign * bound


def ppo_clip_per_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    clip_low: Optional[torch.Tensor] = None,
    clip_high: Optional[torch.Tensor] = None,
    classes: Optional[torch.Tensor] = None,
    metric_group: str = "per_token_clip",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's vanilla PPO/DAPO loss with per-token clip ratios ``clip_low`` / ``clip_high`` (None: the config's).

    Same conventions as ``compute_policy_loss_vanilla`` of verl 0.9.1: the log-ratio clamped to +-20, the dual clip
    ``-A * clip_ratio_c`` for ``A < 0``, the same metrics (``pg_clipfrac`` counts every token the clip clipped,
    whatever its bound). ``classes`` (bool, the selected tokens): adds the clip fraction of each class,
    ``tokensel/<metric_group>/clipfrac_selected`` / ``_unselected`` (the rule's name).
    """
    if config is None:
        raise ValueError(f"{PPO_CLIP_PER_TOKEN} needs the actor config (clip_ratio, clip_ratio_c)")
    low, high = _bounds(config)
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c} is invalid; valid values: a number > 1 "
                         "(the dual clip's lower bound of the ratio for A < 0)")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    if (clip_low is None) != (clip_high is None):  # torch.clamp takes two tensors or two numbers
        clip_low = torch.full_like(clip_high, low, dtype=torch.float64) if clip_low is None else clip_low
        clip_high = torch.full_like(clip_low, high, dtype=torch.float64) if clip_high is None else clip_high
    pg_losses2 = -advantages * torch.clamp(ratio, _ratio_bound(clip_low, low, -1.0), _ratio_bound(clip_high, high, 1.0))
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    metrics = {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item(),
               "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item()}
    if classes is not None:
        clipped = torch.gt(pg_losses2, pg_losses1).float()
        for name, part in (("selected", classes), ("unselected", ~classes)):
            metrics[f"tokensel/{metric_group}/clipfrac_{name}"] = verl_F.masked_mean(
                clipped, response_mask.bool() & part).detach().item()
    return pg_loss, metrics


def abs_log_ratio_penalty_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=None, rollout_is_weights=None, *, penalty: torch.Tensor):
    """verl 0.9.1's ``compute_policy_loss_kl_cov`` with the penalty given per token (``penalty``: the
    coefficient on the penalised tokens, 0 elsewhere) instead of chosen inside the micro-batch."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = verl_F.masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + penalty * abs_kl
    pg_losses = torch.where(penalty != 0, pg_losses_kl, pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    return pg_loss, {"actor/ppo_kl": ppo_kl_abs.detach().item()}


def zeroed_tokens_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                       rollout_is_weights=None, *, loss_weight: torch.Tensor):
    """verl 0.9.1's ``compute_policy_loss_clip_cov`` with ``corr`` given per token (``loss_weight``: 0 on the
    detached tokens, 1 elsewhere) instead of drawn inside the micro-batch with ``torch.randperm``."""
    low, high = _bounds(config)
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = loss_weight.to(advantages.dtype)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pg_clipfrac = verl_F.masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.detach().item(), "actor/ppo_kl": ppo_kl.detach().item()}


def rule_token_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None, *, token_loss: Callable):
    """A rule's own policy loss (``LossTransform.token_loss``, pure torch, per token) in verl's registry signature:
    the actor's clip bounds and dual-clip constant in, verl's ``agg_loss`` over the rule's per-token losses (times the
    rollout importance weights) out."""
    if config is None:
        raise ValueError("a rule's token_loss needs the actor config (clip_ratio, clip_ratio_c)")
    low, high = _bounds(config)
    pg_losses, metrics = token_loss(old_log_prob, log_prob, advantages, response_mask, clip_low=low, clip_high=high,
                                    clip_ratio_c=config.get("clip_ratio_c", 3.0))
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    return pg_loss, metrics


#: the per-token policy losses a rule's transform names (``LossTransform.policy_loss``)
RULE_POLICY_LOSSES: dict[str, Callable] = {
    "abs_log_ratio_penalty": abs_log_ratio_penalty_loss,
    "zeroed_tokens": zeroed_tokens_loss,
    "per_token_clip": ppo_clip_per_token,
}


def transform_policy_loss(transform: LossTransform) -> Optional[Callable]:
    """The policy loss ``transform`` names, bound to its per-token arguments (verl's registry signature), or None
    when it names none (the configured ``loss_mode`` runs)."""
    if transform.token_loss is not None:
        return partial(rule_token_loss, token_loss=transform.token_loss)
    if transform.policy_loss is None:
        return None
    try:
        fn = RULE_POLICY_LOSSES[transform.policy_loss]
    except KeyError:
        raise ValueError(f"a rule's transform names the policy loss {transform.policy_loss!r}; valid: "
                         f"{sorted(RULE_POLICY_LOSSES)}") from None
    return partial(fn, **transform.policy_loss_args)


def register_policy_losses() -> None:
    """Register :func:`ppo_clip_per_token` as ``tokensel_ppo_clip`` in verl's policy-loss registry (idempotent;
    refuses to overwrite a loss of that name registered by someone else)."""
    existing = POLICY_LOSS_REGISTRY.get(PPO_CLIP_PER_TOKEN)
    if existing is ppo_clip_per_token:
        return
    if existing is not None:
        raise RuntimeError(f"verl policy loss {PPO_CLIP_PER_TOKEN!r} is already registered by someone else; "
                           "refusing to overwrite")
    register_policy_loss(PPO_CLIP_PER_TOKEN)(ppo_clip_per_token)


__all__ = ["PPO_CLIP_PER_TOKEN", "RULE_POLICY_LOSSES", "abs_log_ratio_penalty_loss", "ppo_clip_per_token",
           "register_policy_losses", "rule_token_loss", "transform_policy_loss", "zeroed_tokens_loss"]
