"""The glue between a rule's own per-token policy loss and verl's loss conventions.

A rule that computes the policy loss itself carries it in its :class:`~verl_tokensel.core.seam.rule.LossTransform`
(``token_loss``, pure torch, in the rule's module). :func:`rule_token_loss` gives it verl's registry signature: the
actor's clip bounds and dual-clip constant in, verl's ``agg_loss`` over the per-token losses (times the rollout
importance weights) out. :func:`register_policy_losses` registers verl's vanilla clip with per-token bounds
(:mod:`~verl_tokensel.core.rules.ppo_clip`) as ``tokensel_ppo_clip`` in verl's registry: without per-token bounds
it is verl's vanilla loss bit for bit.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

from verl_tokensel.core.rules import LossTransform
from verl_tokensel.core.rules.ppo_clip import ppo_clip_token_losses

PPO_CLIP_PER_TOKEN = "tokensel_ppo_clip"


def _bounds(config) -> tuple[float, float]:
    clip_ratio = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    return low, high


def rule_token_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None, *, token_loss: Callable):
    """A rule's own policy loss (``LossTransform.token_loss``, pure torch, per token) in verl's registry signature:
    the actor's clip bounds and dual-clip constant in, verl's ``agg_loss`` over the rule's per-token losses (times the
    rollout importance weights) out."""
    from verl.trainer.ppo.core_algos import agg_loss  # here: importing core_algos runs the plugin's hook

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


#: ``tokensel_ppo_clip``: verl's vanilla loss through :func:`rule_token_loss` (per-token bounds as keywords)
ppo_clip_per_token = partial(rule_token_loss, token_loss=ppo_clip_token_losses)


def transform_policy_loss(transform: LossTransform) -> Optional[Callable]:
    """The rule's own policy loss in verl's registry signature, or None (the configured ``loss_mode`` runs)."""
    if transform.token_loss is None:
        return None
    return partial(rule_token_loss, token_loss=transform.token_loss)


def register_policy_losses() -> None:
    """Register verl's vanilla clip with per-token bounds as ``tokensel_ppo_clip`` in verl's policy-loss registry
    (idempotent; refuses to overwrite a loss of that name registered by someone else)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    existing = POLICY_LOSS_REGISTRY.get(PPO_CLIP_PER_TOKEN)
    if existing is ppo_clip_per_token:
        return
    if existing is not None:
        raise RuntimeError(f"verl policy loss {PPO_CLIP_PER_TOKEN!r} is already registered by someone else; "
                           "refusing to overwrite")
    register_policy_loss(PPO_CLIP_PER_TOKEN)(ppo_clip_per_token)


__all__ = ["PPO_CLIP_PER_TOKEN", "ppo_clip_per_token", "register_policy_losses", "rule_token_loss",
           "transform_policy_loss"]
