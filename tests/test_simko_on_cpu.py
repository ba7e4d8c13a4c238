"""SimKO (``token_selector=simko``) against its released computation (``tests/helpers/released_rules.py``:
``compute_policy_loss_simko`` and the top-K forward of CLR-Lab/SimKO, written out) through the selecting loss, on
micro-batches built from logits: the gradient to the logits to 1e-6 (it differs from PPO's: the correct hot tokens
spread theirs over the current top-K), the loss value to 1e-6 (PPO's, but for the 1e-8 in each carrier); correctness
read from the advantage's sign; a response of one token, an empty micro-batch and bf16 logits give defined values.
"""

from __future__ import annotations

import pytest
import torch

from verl.workers.utils.losses import ppo_loss

from helpers.actor_configs import actor_config
from helpers.released_rules import simko_forward, simko_loss
from helpers.vocab_batch import vocab_batch
from verl_tokensel.core.rules.simko import OLD_TOP, TOP
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

CLIP = 0.2


def _stats(k):
    knobs = type("K", (), {"simko_k": k})()
    return OLD_TOP.resolve(knobs), TOP.resolve(knobs)


def _cfg(k=3, mix=0.01, quantile=0.8, neg=1.1):
    return actor_config("simko", {"simko_k": k, "simko_mix": mix, "simko_quantile": quantile, "simko_neg_scale": neg},
                        clip_ratio_low=CLIP, clip_ratio_high=CLIP, clip_ratio=CLIP)


def _released(b, k, mix, quantile, neg):
    log_prob, entropy, is_argmax, top = simko_forward(b.current, b.tokens, k, 1.0)
    with torch.no_grad():
        _, _, _, old_top = simko_forward(b.old, b.tokens, k, 1.0)
    adv = b.data["advantages"]
    correct = adv.sum(-1) > 0  # what the preset reads; the release: token_level_scores.sum(-1) == 1
    return simko_loss(log_prob, b.data["old_log_probs"], top, old_top, entropy, is_argmax, adv,
                      b.response_mask.float(), correct, c=mix, neg_scale=neg, quantile=quantile, clip_ratio=CLIP)


@pytest.mark.parametrize("k,mix,quantile,neg", [(3, 0.01, 0.8, 1.1), (2, 0.3, 0.5, 1.5), (5, 0.5, 0.6, 2.0)])
def test_simko_is_the_released_loss_and_gradient(k, mix, quantile, neg):
    cfg = _cfg(k, mix, quantile, neg)
    mixed = boosted = 0.0
    for seed in range(3):
        b = vocab_batch(seed, _stats(k), scale=1.0, noise=0.3, boost=5.0)
        want = _released(b, k, mix, quantile, neg)
        (want_grad,) = torch.autograd.grad(want, b.logits)
        loss, metrics = tokensel_ppo_loss(cfg, b.model_output, b.data)
        (grad,) = torch.autograd.grad(loss, b.logits)
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)
        mixed += float(metrics["tokensel/simko/mixed_share"])
        boosted += float(metrics["tokensel/simko/boosted_share"])
    assert mixed > 0 and boosted > 0, "the batches must have correct hot tokens and boosted wrong ones"


def test_the_gradient_differs_from_ppo_while_the_value_does_not():
    b = vocab_batch(3, _stats(3), scale=1.5, noise=0.3, boost=3.0)
    loss, _ = tokensel_ppo_loss(_cfg(3, 0.3, 0.5, 1.0), b.model_output, b.data)
    (grad,) = torch.autograd.grad(loss, b.logits)
    stock = actor_config(None, clip_ratio_low=CLIP, clip_ratio_high=CLIP, clip_ratio=CLIP, clip_ratio_c=1e9)
    b2 = vocab_batch(3, _stats(3), scale=1.5, noise=0.3, boost=3.0)
    stock_loss, _ = ppo_loss(stock, b2.model_output, b2.data)
    (stock_grad,) = torch.autograd.grad(stock_loss, b2.logits)
    torch.testing.assert_close(loss.detach(), stock_loss.detach(), rtol=1e-6, atol=1e-6)
    assert (grad - stock_grad).abs().max() > 1e-4, "the top-K carry part of the gradient"


def test_one_token_responses_an_empty_micro_batch_and_bf16_are_defined():
    cfg = _cfg()
    b = vocab_batch(6, _stats(3), resp_len=2, scale=1.5, boost=3.0)  # responses of one or two tokens
    loss, _ = tokensel_ppo_loss(cfg, b.model_output, b.data)
    assert torch.isfinite(loss) and torch.isfinite(torch.autograd.grad(loss, b.logits)[0]).all()
    torch.testing.assert_close(loss.detach(), _released(b, 3, 0.01, 0.8, 1.1).detach(), rtol=1e-6, atol=1e-7)
    empty = vocab_batch(7, _stats(3), scale=1.5)
    empty.data["response_mask"] = torch.zeros_like(empty.data["response_mask"])
    loss, _ = tokensel_ppo_loss(cfg, empty.model_output, empty.data)
    assert float(loss) == 0.0, "the release gives NaN here (a masked mean without eps)"
    half = vocab_batch(8, _stats(3), scale=1.5, boost=3.0)
    for key, value in list(half.model_output.items()):
        half.model_output[key] = torch.nested.nested_tensor_from_jagged(value.values().to(torch.bfloat16),
                                                                        value.offsets())
    loss, _ = tokensel_ppo_loss(cfg, half.model_output, half.data)
    assert torch.isfinite(loss) and torch.isfinite(torch.autograd.grad(loss, half.logits)[0]).all()
