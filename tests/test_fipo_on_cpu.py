"""FIPO (``token_selector=fipo``) restated: the released code's influence weight and per-token loss (ms-swift's
``GRPOTrainer._compute_fipo_influence`` and the ``fipo`` branch of ``_compute_loss_and_metrics``), written out here
with the release's masked_fill, chunked decay-matrix products and its ``delta`` (verl's ``clip_ratio_c``), against the
preset's loss and gradient through the selecting loss (1e-6), on micro-batches where the weights are clipped, the
safety cap and the ratio filter act; where every token's probability went down, the default one-sided clip leaves
every weight at 1 and FIPO is verl's stock loss."""

from __future__ import annotations

import pytest
import torch

from verl.workers.utils.losses import ppo_loss

from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded

EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 3.0


def released_fipo_influence(log_ratio, coef_1, advantages, completion_mask, delta, gamma, clip_range,
                            clip_high_only, safety_threshold):
    """The released influence weight (``delta``: the ratio above which a token leaves the Future-KL sum)."""
    future_kl_delta = log_ratio.masked_fill(~completion_mask, 0.0)
    if delta is not None:
        future_kl_delta = torch.where(coef_1 > delta, torch.zeros_like(future_kl_delta), future_kl_delta)
    seq_len = future_kl_delta.shape[1]
    future_kl = torch.zeros_like(future_kl_delta)
    positions = torch.arange(seq_len).unsqueeze(1)
    gamma = torch.as_tensor(gamma, dtype=log_ratio.dtype)
    chunk_size = 128
    for chunk_start in range(0, seq_len, chunk_size):
        chunk_end = min(seq_len, chunk_start + chunk_size)
        distance = torch.arange(chunk_start, chunk_end).unsqueeze(0) - positions
        decay_block = torch.pow(gamma, distance.clamp(min=0)) * (distance >= 0).to(log_ratio.dtype)
        future_kl += torch.matmul(future_kl_delta[:, chunk_start:chunk_end], decay_block.t())
    future_kl = future_kl.masked_fill(~completion_mask, 0.0)
    influence_weight = torch.exp(future_kl)
    if clip_range:
        high = 1 + clip_range
        low = 1.0 if clip_high_only else 1 - clip_range
        influence_weight = torch.clamp(influence_weight, min=low, max=high)
    influence_weight = influence_weight.detach()
    safety_mask = torch.ones_like(completion_mask, dtype=torch.bool)
    if safety_threshold is not None:
        safety_mask = ~((advantages < 0) & (coef_1 > safety_threshold))
        influence_weight = torch.where(safety_mask, influence_weight, torch.clamp(influence_weight, min=0.8, max=1.0))
    return influence_weight, future_kl, safety_mask


def released_fipo_loss(old_log_prob, log_prob, advantages, completion_mask, eps_low, eps_high, delta, **fipo):
    """The released per-token loss and its DAPO normalisation (one process: the micro-batch's completion tokens)."""
    log_ratio = log_prob - old_log_prob
    coef_1 = torch.exp(log_ratio)
    fipo_weight, future_kl, safety_mask = released_fipo_influence(log_ratio, coef_1, advantages, completion_mask,
                                                                  delta, **fipo)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss * fipo_weight
    loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
    return loss, fipo_weight, future_kl, safety_mask


def _run(loss_fn, cfg, mo, data, lp):
    loss, metrics = loss_fn(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _cfg(knobs=None, **actor):
    return actor_config("fipo", knobs, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=CLIP_C, **actor)


CASES = {  # (decay_rate, clip_range, clip_high_only, safety_threshold); resp_len 300 spans three 128-token blocks
    "defaults": (32.0, 0.2, True, 4.0, 20),
    "released_script": (32.0, 0.2, False, 3.0, 20),
    "long_responses": (32.0, 0.2, False, 2.0, 300),
    "short_half_life_no_cap": (4.0, 0.1, False, 0.0, 20),
    "no_clip": (16.0, 0.0, True, 2.0, 20),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fipo_is_the_released_loss(case):
    decay, clip_range, high_only, safety, resp_len = CASES[case]
    knobs = {"fipo_decay_rate": decay, "fipo_clip_range": clip_range, "fipo_clip_high_only": high_only,
             "fipo_safety_threshold": safety}
    cfg = _cfg(knobs)
    fipo = dict(gamma=2 ** (-1 / decay), clip_range=clip_range, clip_high_only=high_only,
                safety_threshold=safety or None)  # the release's None is the knob's 0
    capped_total = filtered_total = 0
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8 if resp_len < 100 else 4, resp_len=resp_len, noise=0.5)
        lp_pad = padded(mo["log_probs"], data)
        mask = data["response_mask"].bool()
        loss, grad, metrics = _run(tokensel_ppo_loss, cfg, mo, data, lp)
        want, weight, future_kl, safety_mask = released_fipo_loss(
            data["old_log_probs"], lp_pad, data["advantages"], mask, EPS_LOW, EPS_HIGH, CLIP_C, **fipo)
        (want_grad,) = torch.autograd.grad(want, lp)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
        # the rule acts: weights differ from 1, and (with a clip) some are clipped, some lie inside the bounds
        w = weight[mask]
        assert ((w - 1).abs() > 1e-3).sum() >= 5, "the weights must not all be 1"
        if clip_range:
            raw = torch.exp(future_kl)[mask]
            assert (raw > 1 + clip_range).sum() >= 3, "some weights must be clipped above"
            if not high_only:
                assert (raw < 1 - clip_range).sum() >= 3, "some weights must be clipped below"
            inside = (w > (1.0 if high_only else 1 - clip_range) + 1e-4) & (w < 1 + clip_range - 1e-4)
            assert inside.sum() >= 3
        ratio = torch.exp(lp_pad - data["old_log_probs"]).detach()
        if safety:  # the tokens whose weight the safety cap changed
            unsafe, _, _ = released_fipo_influence(lp_pad - data["old_log_probs"], ratio, data["advantages"], mask,
                                                   CLIP_C, **{**fipo, "safety_threshold": None})
            capped_total += int(((unsafe - weight).abs() > 1e-6)[mask].sum())
        filtered_total += int(((ratio > CLIP_C) & mask).sum())
        # the release's metrics, under tokensel/fipo/
        n = mask.sum()
        assert float(metrics["tokensel/fipo/influence_weight_mean"]) == pytest.approx(float(w.sum() / n), rel=1e-5)
        assert float(metrics["tokensel/fipo/future_kl_mean"]) == pytest.approx(
            float(future_kl[mask].detach().sum() / n), rel=1e-5, abs=1e-6)
        assert float(metrics["tokensel/fipo/safety_keep_ratio"]) == pytest.approx(
            float(safety_mask[mask].sum() / n), rel=1e-6)
        if clip_range:
            assert float(metrics["tokensel/fipo/high_clipped_share"]) == pytest.approx(
                float((torch.exp(future_kl)[mask] > 1 + clip_range).sum() / n), rel=1e-6)
            low = 1.0 if high_only else 1 - clip_range  # the one-sided clip lifts exp(FutureKL) < 1 to 1
            assert float(metrics["tokensel/fipo/low_clipped_share"]) == pytest.approx(
                float((torch.exp(future_kl)[mask] < low).sum() / n), rel=1e-6)
    assert filtered_total >= 3, "some tokens must leave the Future-KL sum (r > clip_ratio_c)"
    if 0 < safety < 4.0:
        assert capped_total >= 1, "the safety cap must change some weights"


def test_fipo_is_verls_loss_where_every_probability_went_down():
    """log pi <= log pi_old on every token: FutureKL <= 0, so the one-sided clip keeps every weight at 1 (and r <= 1
    stays under the safety threshold): the loss and gradient are verl's, with PPO's lower clip acting."""
    ours, stock = _cfg(), actor_config(None, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=CLIP_C)
    for seed in range(2):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20)
        lp_pad = padded(mo["log_probs"], data).detach()
        rm = data["response_mask"].to(lp_pad.dtype)
        g = torch.Generator().manual_seed(7 + seed)
        data["old_log_probs"] = (lp_pad + torch.randn(lp_pad.shape, generator=g).abs() * 0.4) * rm
        ratio = torch.exp(lp_pad - data["old_log_probs"])
        assert ((ratio < 1 - EPS_LOW) & rm.bool() & (data["advantages"] < 0)).sum() >= 3, "PPO's clip must act"
        loss, grad, metrics = _run(tokensel_ppo_loss, ours, mo, data, lp)
        stock_loss, stock_grad, _ = _run(ppo_loss, stock, mo, data, lp)
        torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, stock_grad, rtol=1e-6, atol=0)
        assert float(metrics["tokensel/fipo/influence_weight_mean"]) == pytest.approx(1.0, abs=1e-7)
        assert float(metrics["tokensel/fipo/future_kl_mean"]) < 0


@pytest.mark.parametrize("knobs,message", [
    ({"fipo_decay_rate": 0.0}, "token_selection.fipo_decay_rate=0.0 is invalid; valid values: a number > 0"),
    ({"fipo_clip_range": -0.1}, "token_selection.fipo_clip_range=-0.1 is invalid; valid values: a number >= 0"),
    ({"fipo_clip_range": 1.0, "fipo_clip_high_only": False},
     r"token_selection.fipo_clip_range=1.0 is invalid; valid values: a number in \[0, 1\) \(with "
     r"fipo_clip_high_only=false\).*Fix:"),
    ({"fipo_safety_threshold": -1.0},
     r"token_selection.fipo_safety_threshold=-1.0 is invalid; valid values: a number >= 0"),
])
def test_fipo_refuses_bad_knobs(knobs, message):
    """Refused where the actor config is built (on the driver, before Ray), naming the key (Hydra wraps the error)."""
    with pytest.raises(Exception, match=message):
        _cfg(knobs, fresh=True)
