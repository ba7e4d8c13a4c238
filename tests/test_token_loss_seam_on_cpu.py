"""The rule seam's own policy loss (``LossTransform.token_loss``): a rule's per-token losses, aggregated by the verl
glue (:func:`verl_tokensel.verl_glue.policy_loss.rule_token_loss`) with verl's ``agg_loss``, the actor's clip bounds
and the rollout importance weights. Held here against verl's own vanilla loss: the vanilla per-token maths as a
token loss gives ``compute_policy_loss_vanilla``'s loss and gradient under every aggregation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core.rules import LossTransform
from verl_tokensel.verl_glue.policy_loss import rule_token_loss, transform_policy_loss

from helpers.actor_configs import actor_config, micro_batch, padded


def vanilla_token_losses(old_log_prob, log_prob, advantages, response_mask, *, clip_low, clip_high, clip_ratio_c):
    """verl 0.9.1's ``compute_policy_loss_vanilla`` per token, written out."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    dual = torch.min(-advantages * clip_ratio_c, clipped)
    return torch.where(advantages < 0, dual, clipped), {"actor/ppo_kl": 0.0}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_token_loss_is_aggregated_as_verls_own(agg, weighted):
    cfg = actor_config(None, loss_agg_mode=agg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    mo, data, lp = micro_batch(2, batch=8, resp_len=20, noise=0.5)
    ppo_loss(cfg, mo, data)  # fills the config's global batch info, as the engine's call does
    old, adv, mask = data["old_log_probs"], data["advantages"], data["response_mask"]
    weights = torch.rand(adv.shape, generator=torch.Generator().manual_seed(3)) if weighted else None
    losses = {}
    for name, fn in (("verl", get_policy_loss_fn("vanilla")),
                     ("rule", transform_policy_loss(LossTransform(token_loss=vanilla_token_losses)))):
        log_prob = padded(mo["log_probs"], data)
        loss, _ = fn(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                     config=cfg, rollout_is_weights=weights)
        (grad,) = torch.autograd.grad(loss, lp)
        losses[name] = (loss.detach(), grad)
    torch.testing.assert_close(losses["rule"][0], losses["verl"][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(losses["rule"][1], losses["verl"][1], rtol=1e-6, atol=1e-9)


def test_a_transform_has_one_loss_mechanism():
    """A rule changes the policy loss one way only: its own per-token ``token_loss``, aggregated by the glue (no
    policy loss named by string from the glue)."""
    assert not {"policy_loss", "policy_loss_args"} & {f.name for f in dataclasses.fields(LossTransform)}
    assert transform_policy_loss(LossTransform()) is None  # neither: verl's configured loss_mode runs
    assert transform_policy_loss(LossTransform(token_loss=vanilla_token_losses)).func is rule_token_loss
