"""Lp-Reg (``token_selector=lp_reg``) against its released computation (``tests/helpers/released_rules.py``:
``compute_policy_loss_lp_reg`` and the min-p proxy of CarlanLark/Lp-Reg-dev, written out), through the selecting
loss on micro-batches built from logits, loss and gradient to 1e-6, with the release's per-micro-batch pool
(``scope=micro_batch score_source=current``); the k > 1 gate; a micro-batch without a negative token; a filtered
sampled token; one-token responses. The mini-batch pool over two data-parallel ranks equals one process holding both:
``tests/test_vocab_seam_on_cpu.py`` (one gloo spawn for the vocabulary seam's collectives).
"""

from __future__ import annotations

import pytest
import torch

from helpers.actor_configs import actor_config
from helpers.released_rules import lp_reg_loss, lp_reg_proxy_log_prob
from helpers.vocab_batch import vocab_batch
from verl_tokensel.core.rules.lp_reg import PROXY
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

LOW, HIGH = 1.0, 9.0  # the released scripts' clip
RELEASE_POOL = {"scope": "micro_batch", "score_source": "current"}


def _cfg(kappa=0.3, rho=0.2, beta=1.0, **pool):
    return actor_config("lp_reg", {**(pool or RELEASE_POOL), "lp_reg_kappa": kappa, "lp_reg_rho": rho,
                                   "lp_reg_beta": beta}, clip_ratio_low=LOW, clip_ratio_high=HIGH)


def _stat(kappa):
    return PROXY.resolve(type("K", (), {"lp_reg_kappa": kappa})())


def _released(b, kappa, rho, beta, temperature=1.0):
    proxy = lp_reg_proxy_log_prob(b.old * temperature, b.tokens, kappa, temperature)  # raw old logits
    log_prob = torch.log_softmax(b.current, -1).gather(-1, b.tokens.unsqueeze(-1)).squeeze(-1)
    return lp_reg_loss(log_prob, b.data["old_log_probs"], proxy, b.data["advantages"], b.response_mask.float(),
                       rho=rho, beta=beta, clip_ratio_low=LOW, clip_ratio_high=HIGH)


@pytest.mark.parametrize("kappa,rho,beta", [(0.02, 0.3, 1.0), (0.05, 0.5, 1.0), (0.1, 0.5, 0.5)])
def test_lp_reg_is_the_released_loss(kappa, rho, beta):
    cfg = _cfg(kappa, rho, beta)
    acted = 0
    for seed in range(3):
        b = vocab_batch(seed, (_stat(kappa),), scale=1.0, noise=0.8, boost=4.0)
        want, reg = _released(b, kappa, rho, beta)
        (want_grad,) = torch.autograd.grad(want, b.logits)
        loss, metrics = tokensel_ppo_loss(cfg, b.model_output, b.data)
        (grad,) = torch.autograd.grad(loss, b.logits)
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)
        assert float(metrics["tokensel/lp_reg/regularised_tokens"]) == float(reg.sum())
        acted += int(reg.sum())
    assert acted >= 3, "the batches must have regularised tokens"


def test_the_k_gate_and_a_micro_batch_without_negative_tokens_are_plain_ppo():
    """rho 1% of 64 negative tokens is k = 1: no candidate (the release's gate); all-positive advantages: no
    candidate either. Both equal the release, which is then the clipped PPO loss alone."""
    for rho, negative in ((0.01, 0.5), (0.3, 0.0)):
        cfg = _cfg(0.3, rho)
        b = vocab_batch(4, (_stat(0.3),), noise=0.8, negative_share=negative)
        want, reg = _released(b, 0.3, rho, 1.0)
        assert not reg.any()
        loss, metrics = tokensel_ppo_loss(cfg, b.model_output, b.data)
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
        assert float(metrics["tokensel/lp_reg/regularised_tokens"]) == 0.0
        assert torch.isfinite(torch.autograd.grad(loss, b.logits)[0]).all()


def test_one_token_responses_and_bf16_values_are_defined():
    """Responses of one or two tokens (the release's computation too), and the engine's values in bf16."""
    cfg = _cfg(0.05, 0.5)
    b = vocab_batch(9, (_stat(0.05),), resp_len=2, scale=1.0, noise=0.8, boost=4.0, batch=16)
    loss, _ = tokensel_ppo_loss(cfg, b.model_output, b.data)
    want, _ = _released(b, 0.05, 0.5, 1.0)
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(torch.autograd.grad(loss, b.logits)[0]).all()
    half = vocab_batch(10, (_stat(0.05),), scale=1.0, noise=0.8, boost=4.0)
    for key, value in list(half.model_output.items()):
        half.model_output[key] = torch.nested.nested_tensor_from_jagged(value.values().to(torch.bfloat16),
                                                                        value.offsets())
    loss, _ = tokensel_ppo_loss(cfg, half.model_output, half.data)
    assert torch.isfinite(loss) and torch.isfinite(torch.autograd.grad(loss, half.logits)[0]).all()


def test_a_filtered_sampled_token_is_never_regularised():
    """kappa 0.9 filters almost every sampled token: its proxy is about -1e4, below any log-prob."""
    b = vocab_batch(5, (_stat(0.9),), noise=0.8)
    proxy = b.data["tokensel_vocab_old_min_p_0"]
    from verl.workers.utils.padding import no_padding_2_padding

    proxy = no_padding_2_padding(proxy, b.data)
    filtered = b.response_mask & (proxy < -1000)
    assert filtered.sum() > 10
    loss, metrics = tokensel_ppo_loss(_cfg(0.9, 0.5), b.model_output, b.data)
    want, reg = _released(b, 0.9, 0.5, 1.0)
    assert not (reg & filtered).any()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(loss) and float(metrics["tokensel/lp_reg/filtered_share"]) > 0
