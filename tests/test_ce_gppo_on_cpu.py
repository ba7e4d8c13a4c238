"""CE-GPPO (``token_selector=ce_gppo``) restated: the released code's per-token loss (``compute_gppo_loss_general_beta``
of Kwai-Klear/CE-GPPO's ``core_algos.py``), written out here with boolean-index assignment as the release writes it,
against the preset's loss and gradient through the selecting loss (1e-6), on micro-batches where tokens are clipped
on both sides; with beta1 = beta2 = 0 it is verl's vanilla loss without the clipped tokens' gradient."""

from __future__ import annotations

import pytest
import torch

from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core.rules.ce_gppo import clipped_classes
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded

EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 3.0


def released_gppo_loss(old_log_prob, log_prob, advantages, response_mask, eps_low, eps_high, clip_ratio_c, beta1,
                       beta2):
    """The released loss, per token (its aggregation is verl's token-mean, applied by the caller)."""
    ratio = torch.exp(log_prob - old_log_prob)
    ratio_detached = ratio.detach()
    low_mask = (ratio < (1 - eps_low)) & (advantages < 0)
    high_mask = (ratio > (1 + eps_high)) & (advantages > 0)
    other_mask = ~(low_mask | high_mask)
    losses = torch.zeros_like(advantages)
    losses[low_mask] = -beta1 * (1 - eps_low) / ratio_detached[low_mask] * ratio[low_mask] * advantages[low_mask]
    losses[high_mask] = -beta2 * (1 + eps_high) / ratio_detached[high_mask] * ratio[high_mask] * advantages[high_mask]
    losses[other_mask] = -ratio[other_mask] * advantages[other_mask]
    dual = torch.min(-advantages * clip_ratio_c, losses)
    return torch.where(advantages < 0, dual, losses)


def _run(loss_fn, cfg, mo, data, lp):
    loss, metrics = loss_fn(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _cfg(beta1, beta2, **actor):
    return actor_config("ce_gppo", {"ce_gppo_beta1": beta1, "ce_gppo_beta2": beta2}, clip_ratio_low=EPS_LOW,
                        clip_ratio_high=EPS_HIGH, clip_ratio_c=CLIP_C, **actor)


@pytest.mark.parametrize("beta1,beta2", [(0.75, 1.0), (0.5, 1.0), (0.25, 2.0)])
def test_ce_gppo_is_the_released_loss(beta1, beta2):
    cfg = _cfg(beta1, beta2)
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20, noise=0.5)  # far off-policy: both clips act
        lp_pad = padded(mo["log_probs"], data)
        mask = data["response_mask"].bool()
        low, high = clipped_classes(lp_pad, data["old_log_probs"], data["advantages"], EPS_LOW, EPS_HIGH)
        assert (low & mask).sum() >= 3 and (high & mask).sum() >= 3, "the batch must have clipped tokens"
        loss, grad, metrics = _run(tokensel_ppo_loss, cfg, mo, data, lp)
        per_token = released_gppo_loss(data["old_log_probs"], lp_pad, data["advantages"], mask, EPS_LOW, EPS_HIGH,
                                       CLIP_C, beta1, beta2)
        want = (per_token * mask).sum() / mask.sum()  # verl's token-mean over the micro-batch (dp 1, one micro-batch)
        (want_grad,) = torch.autograd.grad(want, lp)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
        # the clipped tokens keep a gradient (PPO would give them none)
        g_pad = padded(grad, data)
        assert (g_pad[high & mask].abs() > 0).all() and (g_pad[low & mask].abs() > 0).all()
        share = float((high & mask).sum()) / float(mask.sum())
        assert float(metrics["tokensel/ce_gppo/high_clipped_share"]) == pytest.approx(share, rel=1e-6)


def test_ce_gppo_with_zero_betas_is_verls_loss_on_the_unclipped_gradient():
    """beta1 = beta2 = 0: the clipped tokens get no gradient, as in PPO; the loss differs from verl's only by the
    clipped tokens' values (0 here, the clipped constant there), so the gradients agree."""
    ours, stock = _cfg(0.0, 0.0), actor_config(None, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
                                               clip_ratio_c=CLIP_C)
    mo, data, lp = micro_batch(1, batch=8, resp_len=20, noise=0.5)
    _, grad, _ = _run(tokensel_ppo_loss, ours, mo, data, lp)
    _, stock_grad, _ = _run(ppo_loss, stock, mo, data, lp)
    torch.testing.assert_close(grad, stock_grad, rtol=1e-6, atol=1e-9)


def test_ce_gppo_refuses_a_negative_beta_and_another_loss_mode():
    """Refused where the actor config is built (on the driver, before Ray), naming the key (Hydra wraps the error)."""
    with pytest.raises(Exception, match="token_selection.ce_gppo_beta1=-0.1 is invalid; valid values: a number >= 0"):
        _cfg(-0.1, 1.0, fresh=True)
    with pytest.raises(Exception, match="policy_loss.loss_mode"):
        actor_config("ce_gppo", None, fresh=True, **{"policy_loss.loss_mode": "gspo"})
