"""Every verl policy loss (``policy_loss.loss_mode``) under the selecting loss: one meaning under every normaliser.

The meaning (docs/loss-modes.md): verl's loss computes its own sequence- and batch-level quantities over every valid
token, as stock verl; the selection decides only which tokens carry the gradient and, under ``normaliser`` selected /
kept, which per-token losses enter the token-mean and what it divides by. The reference is written here from verl's
own function: stock loss on every valid token with the log-prob gated off the selection; for ``all`` its value, for
``selected`` / ``kept`` the per-token losses verl's function hands to ``agg_loss`` (recorded) summed over the
selected tokens and divided by the normaliser's denominator. Loss and gradient to 1e-6, the same tokens under the
three normalisers (``forking`` ranks them, ``forking_paper`` and ``stapo`` receive them as the measured field).

Also: every loss at ratio 1.0 (``normaliser=all``) is stock verl bit for bit; the losses with no token-mean refuse
``selected`` / ``kept`` before Ray, naming the key; GSPO with a selection is TRL's GSPO-token with its entropy mask
(``importance_sampling_level="sequence_token"``, ``top_entropy_quantile``; huggingface/trl
``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``), restated below. Tensors only: ~20 s on 2 cores.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import verl.trainer.ppo.core_algos as core_algos
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core import fields
from verl_tokensel.core.config import TokenSelectionConfigError
from verl_tokensel.core.seam.loss_modes import LOSS_MODES, loss_mode
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded

#: verl 0.9.1's registered policy losses
VERL_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
               "cispo", "bypass_mode")
#: the settings a loss needs to run or to act on a small batch: DRO's required beta (verl: "must be a positive value
#: when using DRO"); bypass mode's REINFORCE with sequence-level IS (verl's RolloutCorrectionConfig.bypass_pg_is) and
#: its PPO-clip (bypass_ppo_clip); the covariance losses at a ratio that picks tokens in 100
LOSS_SETTINGS = {
    "dro": {"policy_loss.dro_beta": 0.1},
    "bypass_mode": {"policy_loss.rollout_correction": {"loss_type": "reinforce", "rollout_is": "sequence",
                                                       "rollout_is_threshold": 2.0, "bypass_mode": True}},
    "bypass_mode_ppo_clip": {"policy_loss.rollout_correction": {"loss_type": "ppo_clip", "rollout_is": None,
                                                                "bypass_mode": True}},
    "kl_cov": {"policy_loss.kl_cov_ratio": 0.1},
    "clip_cov": {"policy_loss.clip_cov_ratio": 0.1, "policy_loss.clip_cov_lb": -10.0},
}
CASES = [*VERL_LOSSES, "bypass_mode_ppo_clip"]
NORMALISERS = {"all": "forking_paper", "selected": "forking", "kept": "stapo"}


def settings(case: str) -> dict:
    return {"policy_loss.loss_mode": case.split("_ppo_clip")[0], **LOSS_SETTINGS.get(case, {})}


def serves(case: str, normaliser: str) -> bool:
    return normaliser in loss_mode(settings(case)["policy_loss.loss_mode"]).normalisers


def run(cfg, mo, data, lp, seed=0):
    torch.manual_seed(seed)  # clip_cov's draw
    loss, metrics = tokensel_ppo_loss(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), padded(grad, data), metrics


def the_batch(seed: int):
    """A micro-batch of 2 ranks' mini-batch (its batch_num_tokens and responses over both), forking's mask on it."""
    mo, data, lp = micro_batch(seed, batch=8, resp_len=20, noise=0.3, dp_size=2, batch_num_tokens=300)
    tu.assign_non_tensor(data, global_batch_size=20)
    seen = []
    partial(tokensel_ppo_loss, observer=seen.append)(actor_config("forking"), mo, data)
    return mo, data, lp, seen[-1]["mask"]


def with_measured(data, mask, kept_tokens=None):
    """``data`` carrying ``mask`` as the measured selection (what the driver / the pre-pass write); for ``kept``
    the pre-pass's batch_num_tokens, the kept tokens over the ranks."""
    out = data.clone()
    out[fields.MASK] = mask.to(out["response_mask"].dtype)
    out[fields.SCORE] = torch.zeros_like(mask, dtype=torch.float32)
    if kept_tokens is not None:
        tu.assign_non_tensor(out, batch_num_tokens=kept_tokens)
    return out


def reference(case: str, mo, data, mask, normaliser, seed=0):
    """verl's own function on every valid token, the log-prob gated off ``mask``, then the normaliser: ``all`` keeps
    its value; ``selected`` / ``kept`` sum the per-token losses it aggregates over ``mask`` and divide by their
    denominator (selected: n_sel x the mini-batch's responses / the micro-batch's; kept: batch_num_tokens), x dp."""
    mode = settings(case)["policy_loss.loss_mode"]
    cfg = actor_config(None, **settings(case))
    info = {k: tu.get_non_tensor_data(data=data, key=k, default=None)
            for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
    cfg.global_batch_info.clear()  # what verl's ppo_loss writes there before it calls the policy loss
    cfg.global_batch_info.update(info, loss_scale_factor=cfg.loss_scale_factor)
    lp = mo["log_probs"]
    lp_pad = padded(lp, data)
    valid = data["response_mask"].bool()
    gated = torch.where(mask, lp_pad, lp_pad.detach())
    recorded = []
    real = core_algos.agg_loss

    def record(loss_mat, loss_mask, *args, **kwargs):
        recorded.append((loss_mat, loss_mask))
        return real(loss_mat, loss_mask, *args, **kwargs)

    core_algos.agg_loss = record
    try:
        torch.manual_seed(seed)
        value, _ = get_policy_loss_fn(mode)(old_log_prob=data["old_log_probs"], log_prob=gated,
                                            advantages=data["advantages"], response_mask=valid,
                                            loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=None)
    finally:
        core_algos.agg_loss = real
    if normaliser != "all":
        loss_mat, loss_mask = recorded[-1]
        rows = int(valid.shape[0])
        denominator = (int(mask.sum()) * info["global_batch_size"] / rows if normaliser == "selected"
                       else info["batch_num_tokens"])
        value = (loss_mat * loss_mask * mask).sum() / denominator * info["dp_size"]
    (grad,) = torch.autograd.grad(value, lp)
    return value.detach(), padded(grad, data)


def test_the_table_covers_every_loss_verl_registers():
    assert set(VERL_LOSSES) <= set(POLICY_LOSS_REGISTRY)
    assert set(POLICY_LOSS_REGISTRY) - {"tokensel_ppo_clip"} == set(VERL_LOSSES), "verl registers a new loss"
    assert set(LOSS_MODES) == {*VERL_LOSSES, "tokensel_ppo_clip"}


@pytest.mark.parametrize("case", CASES)
def test_selection_means_the_reference_under_every_normaliser(case):
    """The same tokens under the three normalisers: each is the reference, and their gradients are one gradient
    divided by each normaliser's denominator (one meaning)."""
    for seed in range(2):
        mo, data, lp, mask = the_batch(seed)
        valid = data["response_mask"].bool()
        assert 0 < int(mask.sum()) < int(valid.sum())
        grads = {}
        for normaliser, preset in NORMALISERS.items():
            if not serves(case, normaliser):
                continue
            n_kept = int(mask.sum()) * 2
            d = data if preset == "forking" else with_measured(data, mask, n_kept if normaliser == "kept" else None)
            cfg = actor_config(preset, **settings(case))
            loss, grad, _ = run(cfg, mo, d, lp, seed)
            want_loss, want_grad = reference(case, mo, d, mask, normaliser, seed)
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)
            assert torch.equal(grad[valid & ~mask], torch.zeros_like(grad[valid & ~mask]))
            assert grad[mask].abs().sum() > 0, (case, normaliser)
            denominator = {"all": 300, "selected": int(mask.sum()) * 20 / 8, "kept": n_kept}[normaliser]
            grads[normaliser] = grad * denominator
        for normaliser, g in grads.items():
            if case != "geo_mean":  # a mean over responses: no token denominator to scale by
                torch.testing.assert_close(g, grads["all"], rtol=1e-5, atol=1e-6, msg=f"{case}: {normaliser}")


@pytest.mark.parametrize("case", CASES)
def test_ratio_one_is_stock_bitwise(case):
    stock = actor_config(None, **settings(case))
    ours = actor_config("forking", {"ratio": 1.0, "normaliser": "all"}, **settings(case))
    for seed in range(2):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20, noise=0.3, dp_size=2, batch_num_tokens=300)
        torch.manual_seed(seed)
        ls, ms = ppo_loss(stock, mo, data)
        (gs,) = torch.autograd.grad(ls, lp)
        lo, go, mo_ = run(ours, mo, data, lp, seed)
        assert torch.equal(lo, ls.detach()) and torch.equal(go, padded(gs, data)), case
        assert {k for k in mo_ if not k.startswith("tokensel/")} == set(ms)


@pytest.mark.parametrize("mode", ["sapo", "geo_mean"])
@pytest.mark.parametrize("preset", ["forking", "stapo"])
def test_a_loss_without_token_mean_refuses_selected_and_kept(mode, preset):
    with pytest.raises(Exception) as err:  # hydra wraps it: the config is converted by instantiate
        actor_config(preset, fresh=True, **{"policy_loss.loss_mode": mode})
    assert any(isinstance(e, TokenSelectionConfigError) for e in (err.value, err.value.__cause__)), err.value
    msg = str(err.value)
    assert f"actor_rollout_ref.actor.policy_loss.loss_mode='{mode}' is invalid" in msg, msg
    assert "token-mean" in msg and "Fix:" in msg and "normaliser=all" in msg, msg
    assert actor_config("forking_paper", fresh=True, **{"policy_loss.loss_mode": mode}).selection is not None


# --------------------------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer._compute_loss (huggingface/trl, trl/trainer/grpo_trainer.py), restated
# --------------------------------------------------------------------------------------------------------------------
def trl_loss(lp, old, adv, mask, entropy_mask, eps_low, eps_high, level):
    """TRL's per-token loss with its entropy mask (``top_entropy_quantile``), ``loss_type="dapo"`` on one process:
    ``-min(coef_1 A, coef_2 A) * entropy_mask`` summed over the completion tokens, divided by all of them.
    ``level="sequence_token"``: ``coef_1 = exp(lp - sg(lp) + sg(mean_t(lp - old)))`` (GSPO-token);
    ``"sequence"``: ``coef_1 = exp(mean_t(lp - old))``, one per response (GSPO)."""
    log_ratio = lp - old
    seq = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    log_w = lp - lp.detach() + seq.detach() if level == "sequence_token" else seq
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv) * entropy_mask
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def test_gspo_with_a_selection_is_trls_gspo_token_with_its_entropy_mask():
    cfg = actor_config("forking_paper", **{"policy_loss.loss_mode": "gspo"})
    for seed in range(3):
        mo, data, lp, mask = the_batch(seed)
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None)
        valid = data["response_mask"]
        _, grad, _ = run(cfg, mo, with_measured(data, mask), lp)
        args = (padded(lp, data), data["old_log_probs"], data["advantages"], valid, mask.float(),
                cfg.clip_ratio_low, cfg.clip_ratio_high)
        (want,) = torch.autograd.grad(trl_loss(*args, level="sequence_token"), lp)
        torch.testing.assert_close(grad, padded(want, data), rtol=1e-6, atol=1e-7)
        # TRL's GSPO proper (level "sequence") lets the gradient reach the unselected tokens through the sequence
        # mean; verl's gspo is GSPO-token, so here it does not: the one difference, and the docs say so
        (seq,) = torch.autograd.grad(trl_loss(*args, level="sequence"), lp)
        off = valid.bool() & ~mask
        assert padded(seq, data)[off].abs().sum() > 0 and grad[off].abs().sum() == 0
