"""ASPO (``token_selector=aspo``) restated: the released ``compute_policy_loss_archer`` of wizard-III/Archer2.0 and its
call in ``dp_actor.py`` (the per-response 0.8 entropy quantile with ``torch.nanquantile``; the mask it names
``high_entropy_mask`` holds the low-entropy tokens), written out here, against the preset's loss and gradient through
the selecting loss (1e-6), on micro-batches where both signs' clips and both dual clips act."""

from __future__ import annotations

import pytest
import torch

from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded

LOW, HIGH, C = 0.2, 0.4, 3.0  # the released call's bounds (low / high entropy) and dual-clip constant


def released_aspo_loss(old_log_prob, log_prob, advantages, response_mask, entropy, quantile=0.8):
    masked_entropy = torch.where(response_mask.bool(), entropy.detach(), torch.nan)
    q80 = torch.nanquantile(masked_entropy, q=quantile, dim=-1, keepdim=True)
    high_entropy_mask = (masked_entropy <= q80) & response_mask.bool()  # the release's name: the LOW-entropy tokens
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    negative_clip_ratio = torch.where(high_entropy_mask, torch.clamp(ratio, min=1 - LOW, max=None),
                                      torch.clamp(ratio, min=1 - HIGH, max=None))
    positive_clip_ratio = torch.where(high_entropy_mask, torch.clamp(ratio, min=None, max=1 + LOW),
                                      torch.clamp(ratio, min=None, max=1 + HIGH))
    negative_pg_losses_clip = -advantages * negative_clip_ratio
    positive_pg_losses_clip = -advantages * (positive_clip_ratio / positive_clip_ratio.detach()) / \
        positive_clip_ratio.detach()
    negative_dual_clip_ratio = torch.clamp(negative_clip_ratio, min=None, max=C)
    negative_clipped_mask = torch.gt(negative_clip_ratio, negative_dual_clip_ratio)
    negative_pg_losses = torch.where(negative_clipped_mask, -advantages * negative_dual_clip_ratio.detach() * log_prob,
                                     negative_pg_losses_clip)
    positive_dual_clip_ratio = torch.clamp(1 / positive_clip_ratio, min=None, max=C)
    positive_clipped_mask = torch.gt(1 / positive_clip_ratio, positive_dual_clip_ratio)
    positive_pg_losses = torch.where(positive_clipped_mask, -advantages * positive_dual_clip_ratio.detach() * log_prob,
                                     positive_pg_losses_clip)
    losses = torch.where(advantages < 0, negative_pg_losses, positive_pg_losses)
    return losses, negative_clipped_mask, positive_clipped_mask


def _cfg(**actor):
    return actor_config("aspo", None, clip_ratio_low=LOW, clip_ratio_high=LOW, clip_ratio_c=C,
                        calculate_entropy=True, **actor)


@pytest.mark.parametrize("seed", range(3))
def test_aspo_is_the_released_loss(seed):
    cfg = _cfg()
    mo, data, lp = micro_batch(seed, batch=8, resp_len=24, noise=1.5)  # far off-policy: every branch acts
    lp_pad, h = padded(mo["log_probs"], data), padded(mo["entropy"], data)
    mask = data["response_mask"].bool()
    loss, metrics = tokensel_ppo_loss(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    per_token, neg_dual, pos_dual = released_aspo_loss(data["old_log_probs"], lp_pad, data["advantages"], mask, h)
    adv = data["advantages"]
    assert (neg_dual & mask & (adv < 0)).any() and (pos_dual & mask & (adv > 0)).any(), "both dual clips must act"
    want = (per_token * mask).sum() / mask.sum()  # verl's token-mean (dp 1, one micro-batch)
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    assert float(metrics["tokensel/aspo/selected_share"]) == pytest.approx(0.2, abs=0.1)


def test_aspo_refuses_a_bound_outside_its_range():
    with pytest.raises(Exception, match="token_selection.aspo_clip_ratio_low=1.2 is invalid"):
        actor_config("aspo", {"aspo_clip_ratio_low": 1.2}, fresh=True, calculate_entropy=True)
