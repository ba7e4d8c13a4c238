"""The selecting loss ``tokensel_ppo_loss`` against verl's stock ``ppo_loss`` (CPU).

Micro-batches come from ``tests/helpers/loss_inputs.py`` (verl's no-padding layout, as the engines hand it to
the loss). Actor configs are verl's own ``ppo_trainer`` Hydra tree, composed with
``initialize_config_module("verl.trainer.config")``, converted by verl's ``omega_conf_to_dataclass``:
stock ``FSDPActorConfig`` for the reference, ``TokenselFSDPActorConfig`` (``_target_`` swapped, plus
``token_selector`` / ``token_selection``) for ours.
"""

from __future__ import annotations

import math
import pickle
from functools import partial

import pytest
import torch

from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

import verl_tokensel.verl_glue.loss as loss_mod
from verl_tokensel.core.config import PRESETS
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY
from verl_tokensel.verl_glue.actor_config import StockLossGuard, TokenselFSDPActorConfig
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded
from helpers.loss_inputs import make_micro_batch

# the presets whose mask gates the policy gradient (the other actions: tests/test_rules_on_cpu.py)
# the presets whose rule is a ranked gradient mask (the reweighting rules, the phases and STAPO's unbudgeted mask are
# tested in tests/test_reweight_rules_on_cpu.py)
SELECTING_PRESETS = [p for p in PRESETS if p != "none" and PRESETS[p].rule == "gradient_mask"
                     and SCORE_REGISTRY[PRESETS[p].score].ranks and PRESETS[p].shaping == "none"]
# The in-loss twin of a preset whose scores are measured before the update (score_source prepass or
# rollout): same score, ratio, direction and normaliser, ranked inside the micro-batch. The loss maths
# under test is the same; how a precomputed mask is applied is tested at the end of this file.
IN_LOSS = {"score_source": "current", "scope": "micro_batch"}


def in_loss(preset, selection=None):
    extra = dict(selection or {})
    if PRESETS[preset].score_source != "current":
        extra = {**IN_LOSS, **extra}
    return extra
SCORES = ["entropy", "gmts", "grad_norm", "random"]


def run(loss_fn, cfg, mo, data, lp):
    loss, metrics = loss_fn(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def vanilla_token_grad(cfg, mo, data) -> torch.Tensor:
    """d/dlog_prob of verl's vanilla token losses, per token (token-sum): minus omega."""
    lp = padded(mo["log_probs"], data).detach().requires_grad_(True)
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=data["old_log_probs"], log_prob=lp, advantages=data["advantages"],
        response_mask=data["response_mask"].bool(), loss_agg_mode="token-sum", config=cfg)
    (g,) = torch.autograd.grad(loss, lp)
    return g


def vanilla_token_loss(cfg, lp, old, adv) -> torch.Tensor:
    """Hand-written PPO/DAPO dual-clip token loss (independent of verl's code)."""
    r = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    low, high, c = cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c
    l = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - low, 1 + high))  # noqa: E741
    return torch.where(adv < 0, torch.minimum(l, -adv * c), l)


@pytest.fixture
def masks(monkeypatch):
    """Records every mask the selecting loss computes (in its rule step)."""
    import verl_tokensel.core.seam.rule as rule_mod

    seen = []
    orig = rule_mod.select_tokens

    def spy(*args, **kwargs):
        m = orig(*args, **kwargs)
        seen.append(m.clone())
        return m

    monkeypatch.setattr(rule_mod, "select_tokens", spy)
    return seen


def _metric(metrics, key):
    m = metrics[key]
    return float(m.aggregate()) if hasattr(m, "aggregate") else float(m)


# --------------------------------------------------------------------------------------------
# bit-identity with stock verl
# --------------------------------------------------------------------------------------------
_STOCK_SETTINGS = [
    {},
    {"use_kl_loss": True, "entropy_coeff": 0.013},
    {"use_kl_loss": True, "kl_loss_type": "k1", "entropy_coeff": -0.002, "loss_agg_mode": "seq-mean-token-mean"},
    {"loss_agg_mode": "token-sum", "clip_ratio_high": 0.28, "clip_ratio_c": 10.0},
]


def _ids(settings):
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "default"


@pytest.mark.parametrize("settings", _STOCK_SETTINGS, ids=_ids)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_selector_none_is_stock_bitwise(settings, dp_size):
    stock = actor_config(None, **settings)
    ours = actor_config("none", **settings)
    assert ours.selection is None
    for seed in range(3):
        mo, data, lp = micro_batch(seed, with_ref=True, with_sum_pi_squared=True, dp_size=dp_size)
        ls, gs, ms = run(ppo_loss, stock, mo, data, lp)
        lo, go, mo_ = run(tokensel_ppo_loss, ours, mo, data, lp)
        assert torch.equal(lo, ls) and torch.equal(go, gs)
        assert gs.abs().sum() > 0
        assert set(mo_) == set(ms)  # no tokensel/* metrics when off


@pytest.mark.parametrize("settings", _STOCK_SETTINGS, ids=_ids)
@pytest.mark.parametrize("score", SCORES)
def test_ratio_one_normaliser_all_is_stock_bitwise(score, settings, masks):
    stock = actor_config(None, **settings)
    ours = actor_config("gmts", in_loss("gmts", {"score": score, "ratio": 1.0, "normaliser": "all"}), **settings)
    assert ours.selection.score == score
    for seed in range(3):
        mo, data, lp = micro_batch(seed, with_ref=True, with_sum_pi_squared=(seed % 2 == 0), dp_size=1 + seed % 2)
        ls, gs, _ = run(ppo_loss, stock, mo, data, lp)
        lo, go, metrics = run(tokensel_ppo_loss, ours, mo, data, lp)
        assert torch.equal(lo, ls), (lo, ls)
        assert torch.equal(go, gs)
        assert torch.equal(masks[-1], data["response_mask"].bool())
        assert _metric(metrics, "tokensel/selected_fraction") == 1.0


@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_verls_clip_cov_and_kl_cov_compose_with_a_selector(loss_mode, masks):
    """verl's Clip-Cov / KL-Cov are policy losses, not token selectors: the selecting loss calls them as it calls
    any registered ``loss_mode``. At ratio 1.0 with ``normaliser=all`` the result is verl's own, bit for bit
    (their random token choice seeded alike); at 0.2 their token choice acts and no unselected token gets
    gradient."""
    knob = {"policy_loss.loss_mode": loss_mode}
    stock = actor_config(None, **knob)
    assert stock.policy_loss.loss_mode == loss_mode
    full = actor_config("forking", {"ratio": 1.0, "normaliser": "all"}, **knob)
    part = actor_config("forking", {"normaliser": "all"}, **knob)
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=12, resp_len=24, noise=0.05)
        torch.manual_seed(seed)
        ls, gs, _ = run(ppo_loss, stock, mo, data, lp)
        torch.manual_seed(seed)
        lo, go, _ = run(tokensel_ppo_loss, full, mo, data, lp)
        assert torch.equal(lo, ls) and torch.equal(go, gs)
        torch.manual_seed(seed)
        _, gp, _ = run(tokensel_ppo_loss, part, mo, data, lp)
        mask, valid = masks[-1], data["response_mask"].bool()
        g = padded(gp, data)
        assert torch.all(g[valid & ~mask] == 0) and g[mask].abs().sum() > 0


# --------------------------------------------------------------------------------------------
# every preset: gradient only on the selected tokens, exactly ceil(rho * N) of them
# --------------------------------------------------------------------------------------------
def _expected_mask(preset, cfg, mo, data):
    """Independent top-k of the preset's score (scores built here from entropy and autograd omega)."""
    sel = cfg.selection
    valid = data["response_mask"].bool()
    omega = -vanilla_token_grad(cfg, mo, data)
    ent = padded(mo["entropy"], data)
    if sel.score == "entropy":
        score = ent
    elif sel.score == "gmts":
        score = ent * omega.abs()
    elif sel.score == "grad_norm":
        p = padded(mo["log_probs"], data).detach().double().exp()
        S = padded(mo["sum_pi_squared"], data).double()
        # ||e_a - p||^2 = (1 - p_a)^2 + sum_{j != a} p_j^2, the latter within [0, (1 - p_a)^2]
        rest = torch.minimum((S - p * p).clamp(min=0), (1 - p) ** 2)
        score = omega.abs() * torch.sqrt((1 - p) ** 2 + rest)
    else:
        return None
    key = score.double()[valid]
    key = -key if sel.knobs.direction == "top" else key
    k = math.ceil(sel.ratio * int(valid.sum()) - 1e-9)
    chosen = torch.zeros_like(key, dtype=torch.bool)
    chosen[torch.sort(key, stable=True).indices[:k]] = True
    out = torch.zeros_like(valid)
    out[valid] = chosen
    return out


@pytest.mark.parametrize("preset", SELECTING_PRESETS)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_preset_gradient_only_on_selected_tokens(preset, dp_size, masks):
    cfg = actor_config(preset, in_loss(preset))
    sel = cfg.selection
    assert (sel.score, sel.ratio, sel.knobs.direction, sel.normaliser) == (
        PRESETS[preset].score, PRESETS[preset].ratio, PRESETS[preset].knobs.direction,
        PRESETS[preset].normaliser)
    for seed in range(4):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20, with_sum_pi_squared=True, dp_size=dp_size,
                                   batch_num_tokens=None if seed % 2 else 1000)
        n_before = len(masks)
        loss, grad, metrics = run(tokensel_ppo_loss, cfg, mo, data, lp)
        assert len(masks) == n_before + 1
        mask = masks[-1]
        valid = data["response_mask"].bool()
        n_valid = int(valid.sum())
        k = math.ceil(round(sel.ratio * n_valid, 9))
        assert int(mask.sum()) == k and not (mask & ~valid).any()

        g = padded(grad, data)
        omega = -vanilla_token_grad(cfg, mo, data)
        nonzero_omega = omega != 0
        assert nonzero_omega[valid].float().mean() > 0.5  # the batch is mostly unclipped ...
        assert (~nonzero_omega & valid).any()  # ... with some clipped tokens
        # exactly zero on unselected valid tokens, non-zero exactly on selected tokens with omega != 0
        assert torch.equal(g[valid & ~mask], torch.zeros_like(g[valid & ~mask]))
        assert torch.equal((g != 0) & valid, mask & nonzero_omega)
        assert int(((g != 0) & valid).sum()) == int((mask & nonzero_omega).sum())
        if sel.score in ("gmts", "grad_norm"):
            # |omega|-weighted scores rank clipped tokens (score 0) last: all k carry gradient
            assert int(((g != 0) & valid).sum()) == k
        # the gradient on a selected token has the sign of -omega (loss decreases along omega)
        assert (torch.sign(g[mask & nonzero_omega]) == -torch.sign(omega[mask & nonzero_omega])).all()

        assert _metric(metrics, "tokensel/selected_fraction") == pytest.approx(k / n_valid, abs=1e-12)
        assert _metric(metrics, "tokensel/selected_tokens") == k
        assert _metric(metrics, "tokensel/valid_tokens") == n_valid

        expected = _expected_mask(preset, cfg, mo, data)
        if expected is not None:
            assert torch.equal(mask, expected), preset


def test_random_preset_is_seeded_and_order_free(masks):
    cfg = actor_config("random")
    mo, data, lp = micro_batch(3, batch=8, resp_len=20)
    run(tokensel_ppo_loss, cfg, mo, data, lp)
    run(tokensel_ppo_loss, cfg, mo, data, lp)
    assert torch.equal(masks[0], masks[1])  # rerun: same draw
    run(tokensel_ppo_loss, actor_config("random", {"seed": 5}), mo, data, lp)
    assert not torch.equal(masks[0], masks[2])  # another seed: another draw
    assert int(masks[2].sum()) == int(masks[0].sum())


@pytest.mark.parametrize("mask_kl_loss", [False, True])
def test_kl_and_entropy_terms_follow_their_mask_knobs(mask_kl_loss, masks):
    cfg = actor_config("gmts", in_loss("gmts", {"mask_kl_loss": mask_kl_loss}), use_kl_loss=True, kl_loss_coef=0.1,
                       entropy_coeff=0.01)
    mo, data, lp = micro_batch(2, batch=8, resp_len=20, with_ref=True)
    _, grad, metrics = run(tokensel_ppo_loss, cfg, mo, data, lp)
    mask, valid = masks[-1], data["response_mask"].bool()
    g = padded(grad, data)
    if mask_kl_loss:
        assert torch.equal(g[valid & ~mask], torch.zeros_like(g[valid & ~mask]))
    else:
        # unselected tokens still get the KL gradient: coef * d low_var_kl / dlogp / N = coef*(1 - ref/pi)/N
        lp_pad = padded(mo["log_probs"], data).detach()
        expected = 0.1 * -torch.expm1(data["ref_log_prob"] - lp_pad) / int(valid.sum())
        torch.testing.assert_close(g[valid & ~mask], expected[valid & ~mask], rtol=1e-5, atol=1e-8)
    assert "kl_loss" in metrics and "actor/entropy_loss" in metrics


# --------------------------------------------------------------------------------------------
# normalisers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp_size,bnt_factor,rows_factor", [(1, 1, 1), (2, 2, 3), (2, 3.5, 1.5), (4, 1.7, 5)])
def test_normaliser_selected_hand_value(dp_size, bnt_factor, rows_factor, masks):
    cfg = actor_config("forking")  # entropy top 20%, normaliser=selected, token-mean
    assert cfg.selection.normaliser == "selected" and cfg.loss_agg_mode == "token-mean"
    for seed in range(3):
        mo, data, lp = make_and_set_bnt(seed, dp_size, bnt_factor)
        rows = int(data["response_mask"].shape[0])
        global_rows = int(round(rows * dp_size * rows_factor))  # the mini-batch's responses over all ranks
        tu.assign_non_tensor(data, global_batch_size=global_rows)
        loss, grad, _ = run(tokensel_ppo_loss, cfg, mo, data, lp)
        mask = masks[-1]
        n_sel = int(mask.sum())
        lp_pad = padded(lp, data)  # differentiable
        tok = vanilla_token_loss(cfg, lp_pad, data["old_log_probs"], data["advantages"])
        # the released 80/20 code: the micro-batch's mean over selected tokens, weighted by its share of the
        # mini-batch's responses (rows / global responses), times dp_size (the engines average over ranks);
        # batch_num_tokens (the token count) plays no part
        expected = tok[mask].sum() / n_sel * rows / global_rows * dp_size
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
        (g_expected,) = torch.autograd.grad(expected, lp)
        torch.testing.assert_close(grad, g_expected, rtol=1e-5, atol=1e-8)


def make_and_set_bnt(seed, dp_size, bnt_factor):
    mo, data, lp = micro_batch(seed, batch=8, resp_len=20, dp_size=dp_size)
    n_valid = int(data["response_mask"].sum())
    tu.assign_non_tensor(data, batch_num_tokens=int(round(n_valid * bnt_factor)))
    return mo, data, lp


def test_normaliser_all_keeps_stock_forward_value(masks):
    stock = actor_config(None)
    for preset in ("gmts", "grad_norm"):
        cfg = actor_config(preset, in_loss(preset))
        assert cfg.selection.normaliser == "all"
        mo, data, lp = micro_batch(1, batch=8, resp_len=20, dp_size=2, batch_num_tokens=777)
        ls, gs, _ = run(ppo_loss, stock, mo, data, lp)
        lo, go, metrics = run(tokensel_ppo_loss, cfg, mo, data, lp)
        assert torch.equal(lo, ls)  # forward = full-token surrogate, stock denominator
        mask = masks[-1]
        # on the selected tokens the gradient is stock's, bit for bit
        assert torch.equal(padded(go, data)[mask], padded(gs, data)[mask])
        assert _metric(metrics, "actor/pg_loss") == pytest.approx(float(ls))


# --------------------------------------------------------------------------------------------
# extra padding
# --------------------------------------------------------------------------------------------
def _padded_twin(seed, extra):
    """The same micro-batch as ``micro_batch(seed)`` with ``extra`` more response padding columns."""
    mo0, d0, lp0 = micro_batch(seed, batch=8, resp_len=20, with_sum_pi_squared=True)
    mo1, d1, _ = make_micro_batch(batch=8, resp_len=20, seed=seed, extra_pad=extra, with_sum_pi_squared=True)
    assert torch.equal(d0["input_ids"].values(), d1["input_ids"].values())
    pad = torch.nn.functional.pad
    for k in ("old_log_probs", "advantages"):
        d1[k] = pad(d0[k], (0, extra))
    assert (torch.equal(d1["response_mask"][:, :-extra], d0["response_mask"])
            and not d1["response_mask"][:, -extra:].any())
    offsets = d1["input_ids"].offsets()
    lp1 = lp0.detach().clone().requires_grad_(True)
    mo1 = {
        "log_probs": torch.nested.nested_tensor_from_jagged(lp1, offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(mo0["entropy"].values().clone(), offsets),
        "sum_pi_squared": torch.nested.nested_tensor_from_jagged(mo0["sum_pi_squared"].values().clone(), offsets),
    }
    return (mo0, d0, lp0), (mo1, d1, lp1)


@pytest.mark.parametrize("preset", SELECTING_PRESETS)
def test_extra_padding_changes_nothing(preset, masks):
    cfg = actor_config(preset, in_loss(preset))
    extra = 5
    for seed in range(2):
        (mo0, d0, lp0), (mo1, d1, lp1) = _padded_twin(seed, extra)
        l0, g0, m0 = run(tokensel_ppo_loss, cfg, mo0, d0, lp0)
        l1, g1, m1 = run(tokensel_ppo_loss, cfg, mo1, d1, lp1)
        mask0, mask1 = masks[-2], masks[-1]
        assert mask1.shape[1] == mask0.shape[1] + extra
        assert torch.equal(mask1[:, :-extra], mask0) and not mask1[:, -extra:].any()
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)  # fp32 sums in another order: a few ulps, by CPU
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=0)
        assert torch.equal(g1 != 0, g0 != 0)
        assert _metric(m1, "tokensel/selected_fraction") == _metric(m0, "tokensel/selected_fraction")


# --------------------------------------------------------------------------------------------
# called the way verl's Megatron engine calls it
# --------------------------------------------------------------------------------------------
def megatron_postprocess(loss_function, model_output, data, dp_group=None):
    """``MegatronEngineWithLMHead.postprocess_micro_batch_func`` (verl 0.9.1, transformer_impl.py), the
    training branch without per-token loss: call the loss with keyword arguments and the DP group, then
    ``scaled_loss = loss * data["num_micro_batch"]`` (Megatron's pp schedule divides by the micro-batch
    count again)."""
    loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
    scaled_loss = loss * data["num_micro_batch"]
    return scaled_loss, {"loss": loss.detach().item(), "metrics": metrics}


@pytest.mark.parametrize("preset,loss_mode", [("forking", "vanilla"), ("gmts", "vanilla"), ("forking", "gspo")])
@pytest.mark.parametrize("num_micro_batch", [3, 4])
def test_megatron_call_two_tp_ranks(preset, loss_mode, num_micro_batch, masks):
    """The Megatron call agrees with FSDP2's, under verl's vanilla loss and under GSPO (its sequence ratio over every
    valid token, the unselected tokens out of the sum: docs/loss-modes.md)."""
    actor = {"policy_loss.loss_mode": loss_mode}
    # each TP rank has its own config object (its own process), built from verl's megatron tree
    per_rank = []
    for tp_rank in range(2):
        cfg = actor_config(preset, in_loss(preset), megatron=True, fresh=True, **actor)
        loss_function = partial(tokensel_ppo_loss, config=cfg)  # as engine_workers binds ppo_loss
        mo, data, lp = micro_batch(7, batch=8, resp_len=20, dp_size=2, batch_num_tokens=400)
        tu.assign_non_tensor(data, num_micro_batch=num_micro_batch)
        scaled, out = megatron_postprocess(loss_function, mo, data)
        (g_scaled,) = torch.autograd.grad(scaled, lp)
        per_rank.append((scaled.detach(), out, g_scaled, masks[-1]))
    (s0, o0, g0, m0), (s1, o1, g1, m1) = per_rank
    assert torch.equal(m0, m1) and torch.equal(s0, s1) and torch.equal(g0, g1) and o0["loss"] == o1["loss"]
    assert _metric(o0["metrics"], "tokensel/selected_fraction") == _metric(o1["metrics"], "tokensel/selected_fraction")

    # FSDP-style: the engine back-propagates the loss itself; Megatron's loss is num_micro_batch x that
    fsdp_cfg = actor_config(preset, in_loss(preset), **actor)
    assert fsdp_cfg.policy_loss.loss_mode == cfg.policy_loss.loss_mode == loss_mode
    mo, data, lp = micro_batch(7, batch=8, resp_len=20, dp_size=2, batch_num_tokens=400)
    loss, g_fsdp, _ = run(tokensel_ppo_loss, fsdp_cfg, mo, data, lp)
    assert torch.equal(masks[-1], m0)
    assert o0["loss"] == loss.item()
    torch.testing.assert_close(s0, loss * num_micro_batch, rtol=1e-6, atol=0)
    torch.testing.assert_close(g0, g_fsdp * num_micro_batch, rtol=1e-6, atol=0)
    if num_micro_batch == 4:  # a power of two scales exactly
        assert torch.equal(g0, g_fsdp * 4)
    assert (g0 != 0).any()


# --------------------------------------------------------------------------------------------
# the StockLossGuard
# --------------------------------------------------------------------------------------------
def test_stock_loss_refuses_a_selector_config():
    cfg = actor_config("forking", fresh=True)
    assert isinstance(cfg.global_batch_info, StockLossGuard)
    mo, data, lp = micro_batch(0)
    with pytest.raises(RuntimeError, match=r"verl_tokensel\.main_ppo"):
        ppo_loss(cfg, mo, data)
    # the selecting loss works with the same config, and closes the guard behind it
    loss, _, _ = run(tokensel_ppo_loss, cfg, mo, data, lp)
    assert torch.isfinite(loss)
    assert not cfg.global_batch_info.active
    with pytest.raises(RuntimeError, match="token_selector=forking"):
        ppo_loss(cfg, mo, data)


def _clear_then_update(info, values):  # verl PR #7514's way of writing ppo_loss's batch info
    info.clear()
    info.update(values)


def _ior(info, values):
    info |= values


WRITES = {
    "setitem": lambda info, values: [info.__setitem__(k, v) for k, v in values.items()],
    "update": lambda info, values: info.update(values),
    "update_kwargs": lambda info, values: info.update(**values),
    "clear_then_update": _clear_then_update,
    "setdefault": lambda info, values: [info.setdefault(k, v) for k, v in values.items()],
    "ior": _ior,
    "pop": lambda info, values: info.pop("dp_size", None),
    "popitem": lambda info, values: info.popitem(),
    "delitem": lambda info, values: info.__delitem__(next(iter(info))),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_a_stock_loss_writing_the_batch_info_any_way_is_refused(how):
    """A stock ppo_loss that fills ``global_batch_info`` by any dict method (not only item by item) with a selector
    configured is refused; the selecting loss's own writes pass, and with ``token_selector=none`` every way
    writes."""
    values = {"dp_size": 1, "batch_num_tokens": 10, "global_batch_size": 4}
    cfg = actor_config("forking", fresh=True)
    info = cfg.global_batch_info
    dict.update(info, values)  # what an earlier micro-batch left there
    with pytest.raises(RuntimeError, match=r"token_selector=forking.*verl_tokensel\.main_ppo"):
        WRITES[how](info, values)
    assert dict(info) == values, "a refused write changed the batch info"
    info.active = True  # inside the selecting loss
    try:
        WRITES[how](info, values)
    finally:
        info.active = False
    none = actor_config("none", fresh=True).global_batch_info
    dict.update(none, values)
    WRITES[how](none, values)


def test_stock_loss_accepts_selector_none():
    cfg = actor_config("none", fresh=True)
    stock = actor_config(None)
    mo, data, lp = micro_batch(0)
    ls, gs, _ = run(ppo_loss, stock, mo, data, lp)
    lo, go, _ = run(ppo_loss, cfg, mo, data, lp)
    assert torch.equal(lo, ls) and torch.equal(go, gs)


def test_guard_closes_after_an_error_in_the_selecting_loss():
    cfg = actor_config("forking", fresh=True)
    mo, data, lp = micro_batch(0)
    del mo["entropy"]  # the entropy score then has nothing to rank
    with pytest.raises(ValueError, match="entropy"):
        tokensel_ppo_loss(cfg, mo, data)
    assert not cfg.global_batch_info.active
    with pytest.raises(RuntimeError, match=r"verl_tokensel\.main_ppo"):
        ppo_loss(cfg, micro_batch(0)[0], data)


@pytest.mark.parametrize("selector", ["forking", "none"])
def test_guard_survives_pickling(selector):
    cfg = actor_config(selector, fresh=True)
    dumpers = [pickle]
    try:
        import cloudpickle  # what Ray uses to ship the config to the workers

        dumpers.append(cloudpickle)
    except ImportError:  # pragma: no cover
        pass
    mo, data, lp = micro_batch(0)
    ref_loss, ref_grad, _ = run(tokensel_ppo_loss, cfg, mo, data, lp)
    for dumper in dumpers:
        cfg2 = pickle.loads(dumper.dumps(cfg))
        assert type(cfg2) is TokenselFSDPActorConfig
        assert isinstance(cfg2.global_batch_info, StockLossGuard)
        assert cfg2.selection == cfg.selection
        if selector == "none":
            assert cfg2.global_batch_info.selector is None
            ppo_loss(cfg2, mo, data)  # does not raise
        else:
            assert cfg2.global_batch_info.selector == selector and not cfg2.global_batch_info.active
            with pytest.raises(RuntimeError, match=r"verl_tokensel\.main_ppo"):
                ppo_loss(cfg2, mo, data)
        loss, grad, _ = run(tokensel_ppo_loss, cfg2, mo, data, lp)
        assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


# --------------------------------------------------------------------------------------------
# a mask measured before the update (score_source prepass / rollout) arrives as a per-token field
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", [p for p in SELECTING_PRESETS if PRESETS[p].score_source != "current"])
def test_precomputed_mask_field_is_applied_exactly(preset, masks):
    cfg = actor_config(preset)
    seen = []
    mo, data, lp = micro_batch(4, batch=8, resp_len=20, with_sum_pi_squared=True, dp_size=2,
                               batch_num_tokens=500)
    valid = data["response_mask"].bool()
    g = torch.Generator().manual_seed(9)
    given = (torch.rand(valid.shape, generator=g) < 0.3) | ~valid  # padding marked too: must be ignored
    data[loss_mod.MASK_FIELD] = given
    data[loss_mod.SCORE_FIELD] = torch.rand(valid.shape, generator=g)
    stock_loss, stock_grad, _ = run(ppo_loss, actor_config(None), mo, data, lp)
    loss, grad, metrics = run(partial(tokensel_ppo_loss, observer=seen.append), cfg, mo, data, lp)
    assert not masks  # nothing ranked inside the loss
    mask = seen[-1]["mask"]
    assert torch.equal(mask, given & valid)
    gp, sp = padded(grad, data), padded(stock_grad, data)
    assert torch.equal(gp[valid & ~mask], torch.zeros_like(gp[valid & ~mask]))
    assert torch.equal(gp[mask], sp[mask])  # normaliser all: stock gradient on the selected tokens
    assert torch.equal(loss, stock_loss)
    n_sel, n_valid = int(mask.sum()), int(valid.sum())
    assert _metric(metrics, "tokensel/selected_fraction") == pytest.approx(n_sel / n_valid, abs=1e-12)
    lo = float(data[loss_mod.SCORE_FIELD][mask].min())
    assert _metric(metrics, "tokensel/threshold_min_selected_score") == pytest.approx(lo)


def test_precomputed_source_without_mask_field_fails_loudly():
    cfg = actor_config("forking_paper")
    mo, data, lp = micro_batch(0)
    with pytest.raises(RuntimeError, match=f"score_source=rollout.*'{loss_mod.MASK_FIELD}'"):
        tokensel_ppo_loss(cfg, mo, data)


def test_verl_ppo_loss_source_is_pinned():
    """verl_ppo_loss_body repeats part of verl's ppo_loss: a change there must be looked at here."""
    import hashlib
    import inspect

    from verl.workers.utils import losses

    digest = hashlib.sha256(inspect.getsource(losses.ppo_loss).encode()).hexdigest()
    assert digest == loss_mod.VERL_PPO_LOSS_SHA256, (
        "verl's ppo_loss source changed: re-check loss.py against verl's ppo_loss (verl_ppo_loss_body: global "
        f"batch info, metric aggregation, entropy and KL terms), then set VERL_PPO_LOSS_SHA256 = {digest!r}"
    )


# --------------------------------------------------------------------------------------------
# the rule's loss transform (core.seam.rule.LossTransform): what the loss does with each of its fields
# --------------------------------------------------------------------------------------------
def _with_rule_outputs(monkeypatch, **outputs):
    """The loss's rule step, with ``outputs`` (functions of the micro-batch's padded advantages) set on its
    transform."""
    orig = loss_mod.apply_rule

    def rule(sel, batch, **kwargs):
        selected = orig(sel, batch, **kwargs)
        for name, make in outputs.items():
            setattr(selected.transform, name, make(batch.inputs.advantages))
        return selected

    monkeypatch.setattr(loss_mod, "apply_rule", rule)


def test_advantage_weight_and_shift_act_as_reweighted_advantages(monkeypatch):
    """A' = w * A + s from the rule equals the stock loss on data whose advantages are already w * A + s."""
    cfg = actor_config("forking")
    mo, data, lp = micro_batch(4, batch=6, resp_len=16)
    adv = data["advantages"]  # padded (batch, response_len), as the loss reads it
    w = 0.3 + torch.rand(adv.shape, generator=torch.Generator().manual_seed(1))
    s = 0.05 * torch.ones_like(adv)
    reweighted = data.clone()
    reweighted["advantages"] = adv * w + s
    want_loss, want_grad, _ = run(tokensel_ppo_loss, cfg, mo, reweighted, lp)
    _with_rule_outputs(monkeypatch, advantage_weight=lambda a: w, advantage_shift=lambda a: s)
    got_loss, got_grad, _ = run(tokensel_ppo_loss, cfg, mo, data, lp)
    assert torch.equal(got_loss, want_loss) and torch.equal(got_grad, want_grad)


def test_kl_weight_scales_the_kl_term_per_token(monkeypatch):
    cfg = actor_config("forking", use_kl_loss=True, kl_loss_coef=0.1)
    mo, data, lp = micro_batch(5, batch=6, resp_len=16, with_ref=True)
    base_loss, _, base_metrics = run(tokensel_ppo_loss, cfg, mo, data, lp)
    _with_rule_outputs(monkeypatch, kl_weight=lambda a: torch.zeros_like(a))
    loss, _, metrics = run(tokensel_ppo_loss, cfg, mo, data, lp)
    kl = _metric(base_metrics, "kl_loss")
    assert kl != 0 and _metric(metrics, "kl_loss") == 0
    torch.testing.assert_close(loss, base_loss - 0.1 * torch.tensor(kl, dtype=loss.dtype), rtol=1e-5, atol=1e-7)


def test_every_rule_selection_goes_through_the_rule_step():
    """Only the rule seam turns a ranking into a mask (core/seam/rule.py, whose rules core/step.py's apply_rule
    runs; analysis/stats.top_mask ranks one report column, not a rule)."""
    import ast
    from pathlib import Path

    def calls(path):
        return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "select_tokens"
                   for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))

    package = Path(loss_mod.__file__).resolve().parents[1]
    callers = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                     if p.name != "select.py" and calls(p))
    assert callers == ["analysis/stats.py", "core/seam/rule.py"], callers
