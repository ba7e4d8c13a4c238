"""The toolbox rules that reweight or drop tokens instead of ranking a budget: AR, Lopti (and the two together),
entropy advantage shaping and STAPO, against restatements of the papers' formulas (hand-written here, then verl's
stock loss on the restated inputs).

- ``ar``: stock ``ppo_loss`` with ``A * (alpha * exp(old_log_prob) + 1 - alpha)``, bit for bit;
- ``entropy_adv``: stock ``ppo_loss`` with ``A + min(alpha * H, |A| / kappa)``, H the update pass's entropy;
- ``lopti``: each pass is stock ``ppo_loss`` with the other pass's advantages zeroed (every token still in the
  denominator); the KL term of the other pass's tokens is zero with the full denominator; a batch without the pass
  number fails loudly; ``ar_lopti`` multiplies the two;
- ``stapo``: the spurious tokens are the candidates under ``torch.quantile`` of the candidates' entropies (distinct
  values), two gloo ranks pick what one process picks, and with the kept tokens as the loss mask and their count
  as the denominator the loss is stock ``ppo_loss`` over the kept tokens;
- shaping comes before a score that reads the advantage; the knobs a rule does not read, and the combinations it
  cannot serve, are refused naming the key.
"""

from __future__ import annotations

import copy

import pytest
import torch

from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core.ranking.batch import score_batch
from verl_tokensel.core.config import PRESETS, TokenSelectionConfigError, override, preset, resolve_selection
from verl_tokensel.core.fields import UPDATE_PASS
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.rules import RULE_REGISTRY
from verl_tokensel.core.rules.stapo import quantile_below_count, spurious_tokens
from verl_tokensel.verl_glue import loss as loss_mod
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded
from helpers.distributed import run_distributed


def run(loss_fn, cfg, mo, data, lp):
    loss, metrics = loss_fn(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _stat(metrics, key):
    v = metrics["tokensel/" + key]
    return float(v.aggregate()) if hasattr(v, "aggregate") else float(v)


def _with(data, **fields):
    out = copy.copy(data)
    for k, v in fields.items():
        out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# AR and entropy shaping: stock ppo_loss on the restated advantages
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.3, 0.1])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ar_is_stock_loss_on_reweighted_advantages(alpha, agg):
    ours = actor_config("ar", {"ar_alpha": alpha}, loss_agg_mode=agg, clip_ratio_c=3.0)
    stock = actor_config(None, loss_agg_mode=agg, clip_ratio_c=3.0)
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20, noise=0.3)
        restated = data["advantages"] * (alpha * torch.exp(data["old_log_probs"]) + 1 - alpha)
        ls, gs, _ = run(ppo_loss, stock, mo, _with(data, advantages=restated), lp)
        lo, go, metrics = run(tokensel_ppo_loss, ours, mo, data, lp)
        torch.testing.assert_close(lo, ls, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(go, gs, rtol=1e-6, atol=1e-9)
        valid = data["response_mask"].bool()
        w = (alpha * torch.exp(data["old_log_probs"]) + 1 - alpha)[valid]
        assert _stat(metrics, "ar/mean_weight") == pytest.approx(float(w.mean()), rel=1e-5)
        assert _stat(metrics, "selected_fraction") == 1.0  # nothing ranked: every token keeps its gradient


@pytest.mark.parametrize("alpha,kappa", [(0.4, 2.0), (0.1, 3.0)])
def test_entropy_adv_is_stock_loss_on_shifted_advantages(alpha, kappa):
    ours = actor_config("entropy_adv", {"entropy_alpha": alpha, "entropy_kappa": kappa}, calculate_entropy=True)
    stock = actor_config(None, calculate_entropy=True)
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20, noise=0.3)
        h = padded(mo["entropy"], data)
        a = data["advantages"]
        restated = a + torch.minimum(alpha * h, a.abs() / kappa)
        restated = torch.where(data["response_mask"].bool(), restated, a)
        ls, gs, _ = run(ppo_loss, stock, mo, _with(data, advantages=restated), lp)
        lo, go, metrics = run(tokensel_ppo_loss, ours, mo, data, lp)
        torch.testing.assert_close(lo, ls, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(go, gs, rtol=1e-6, atol=1e-9)
        valid = data["response_mask"].bool()
        shift = torch.minimum(alpha * h, a.abs() / kappa)[valid]
        assert _stat(metrics, "entropy_adv/mean_shift") == pytest.approx(float(shift.mean()), rel=1e-5)
        # the shift never flips an advantage's sign (kappa > 1)
        assert (torch.sign(restated[valid]) * torch.sign(a[valid]) >= 0).all()


def test_entropy_adv_turns_the_update_entropy_on():
    from verl_tokensel.core.config import TokenSelectionConfig

    assert actor_config("entropy_adv").needs_entropy  # the driver turns calculate_entropy on for the update pass
    with pytest.raises(TokenSelectionConfigError, match="calculate_entropy"):
        resolve_selection("entropy_adv", TokenSelectionConfig(auto_enable_entropy=False))


# --------------------------------------------------------------------------------------------
# Lopti: two passes, the other pass's advantages zeroed, every token in the denominator
# --------------------------------------------------------------------------------------------
def _phase(data, phase):
    out = copy.copy(data)
    tu.assign_non_tensor(out, **{UPDATE_PASS: phase})
    return out


@pytest.mark.parametrize("preset", ["lopti", "ar_lopti"])
def test_each_lopti_pass_is_stock_loss_with_the_other_tokens_advantages_zeroed(preset):
    eta, alpha = 0.5, 0.3
    ours = actor_config(preset)
    stock = actor_config(None)
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=20, noise=0.3)
        p_old = torch.exp(data["old_log_probs"])
        low = p_old < eta
        a = data["advantages"]
        if preset == "ar_lopti":
            a = a * (alpha * p_old + 1 - alpha)
        valid = data["response_mask"].bool()
        assert (low & valid).any() and (~low & valid).any()
        for phase, active in ((1, low), (2, ~low)):
            ls, gs, _ = run(ppo_loss, stock, mo, _with(data, advantages=torch.where(active, a, 0.0)), lp)
            lo, go, metrics = run(tokensel_ppo_loss, ours, mo, _phase(data, phase), lp)
            torch.testing.assert_close(lo, ls, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(go, gs, rtol=1e-6, atol=1e-9)
            gp = padded(go, data)
            assert torch.equal(gp[valid & ~active], torch.zeros_like(gp[valid & ~active]))
            share = float((low & valid).sum()) / float(valid.sum())
            assert _stat(metrics, "lopti/low_share") == pytest.approx(share)
            assert _stat(metrics, "lopti/active_share") == pytest.approx(share if phase == 1 else 1 - share)


def test_lopti_kl_term_counts_each_token_in_one_pass_with_the_full_denominator():
    coef = 0.01
    ours = actor_config("lopti", use_kl_loss=True, kl_loss_coef=coef, kl_loss_type="low_var_kl")
    mo, data, lp = micro_batch(2, batch=8, resp_len=20, noise=0.3, with_ref=True)
    low = torch.exp(data["old_log_probs"]) < 0.5
    valid = data["response_mask"].bool()
    x = padded(mo["log_probs"], data).detach()
    from verl.trainer.ppo.core_algos import kl_penalty

    kld = kl_penalty(logprob=x, ref_logprob=data["ref_log_prob"], kl_penalty="low_var_kl")
    total = 0.0
    for phase, active in ((1, low), (2, ~low)):
        _, _, metrics = run(tokensel_ppo_loss, ours, mo, _phase(data, phase), lp)
        kl = metrics["kl_loss"]
        kl = float(kl.aggregate()) if hasattr(kl, "aggregate") else float(kl)
        expected = float((kld * active * valid).sum()) / float(data["batch_num_tokens"])
        assert kl == pytest.approx(expected, rel=1e-5, abs=1e-9)
        total += kl
    assert total == pytest.approx(float((kld * valid).sum()) / float(data["batch_num_tokens"]), rel=1e-5)


def test_a_lopti_batch_without_its_pass_number_fails_loudly():
    mo, data, _ = micro_batch(0)
    with pytest.raises(RuntimeError, match=UPDATE_PASS):
        tokensel_ppo_loss(actor_config("lopti"), mo, data)


def test_lopti_metrics_merge_as_the_released_code():
    merged = RULE_REGISTRY["lopti"].merge_passes([
        {"actor/pg_loss": 1.0, "actor/lr": 0.1, "x": [1, 2]}, {"actor/pg_loss": 3.0, "actor/lr": 0.1, "x": [3]}])
    assert merged["actor/pg_loss"] == 2.0 and merged["actor/lr"] == pytest.approx(0.1) and merged["x"] == [1, 2, 3]
    assert merged["tokensel/lopti/phase1/actor/pg_loss"] == 1.0
    assert merged["tokensel/lopti/phase2/actor/pg_loss"] == 3.0


# --------------------------------------------------------------------------------------------
# STAPO
# --------------------------------------------------------------------------------------------
def _stapo_data(seed=5, rows=16, length=48):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 3, length + 1, (rows,), generator=g)
    valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(rows, 1, generator=g).expand(rows, length).contiguous()
    lp = -torch.rand(rows, length, generator=g) * 9  # many tokens under pi = 0.05
    ent = torch.rand(rows, length, generator=g) * 3
    return valid, adv, lp, ent


@pytest.mark.parametrize("q", [0.75, 0.5, 0.05, 1.0])
def test_stapo_spurious_tokens_are_the_candidates_under_the_entropy_quantile(q):
    valid, adv, lp, ent = _stapo_data()
    tau_p = 0.05
    spurious, cand = spurious_tokens(adv, lp, ent, valid, prob_threshold=tau_p, entropy_quantile=q)
    # restatement: A > 0, pi < tau_p, H < torch.quantile(H of the candidates, q) (all strict)
    restated_cand = valid & (adv > 0) & (torch.exp(lp) < tau_p)
    assert torch.equal(cand, restated_cand) and int(cand.sum()) > 10
    tau_h = torch.quantile(ent[restated_cand], q)
    assert torch.equal(spurious, restated_cand & (ent < tau_h))
    assert int(spurious.sum()) == quantile_below_count(int(cand.sum()), q)


def _stapo_rank(rank, world):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    valid, adv, lp, ent = _stapo_data()
    rows = valid.shape[0] // world
    sl = slice(rank * rows, (rank + 1) * rows)
    return spurious_tokens(adv[sl], lp[sl], ent[sl], valid[sl], prob_threshold=0.05, entropy_quantile=0.75,
                           dp_group=dist.group.WORLD)[0]


def test_stapo_over_two_ranks_picks_the_tokens_of_one_process():
    valid, adv, lp, ent = _stapo_data()
    whole, _ = spurious_tokens(adv, lp, ent, valid, prob_threshold=0.05, entropy_quantile=0.75)
    per_rank = run_distributed(_stapo_rank, world_size=2, timeout=240)
    assert torch.equal(torch.cat(per_rank), whole) and int(whole.sum()) > 0


def test_stapo_rule_keeps_every_token_but_the_spurious_ones():
    valid, adv, lp, ent = _stapo_data()
    sel = PRESETS["stapo"]
    sel = override(sel, stapo_prob=0.05)
    sb = score_batch(sel.score, {"response_mask": valid, "log_probs": lp, "old_log_probs": lp, "advantages": adv,
                                       "entropy": ent})
    out = apply_rule(sel, sb)
    spurious, _ = spurious_tokens(adv, lp, ent, valid, prob_threshold=0.05, entropy_quantile=0.75)
    assert torch.equal(out.mask, valid & ~spurious)
    assert out.stats["stapo/spurious_tokens"] == int(spurious.sum())


def test_stapo_loss_is_stock_loss_over_the_kept_tokens():
    """With the pre-pass's mask field and loss_mask (the engine's batch_num_tokens then counts the kept tokens),
    the loss is verl's token-mean over the kept tokens only: the spurious tokens have no gradient and no share of
    the denominator."""
    ours = actor_config("stapo")
    stock = actor_config(None)
    mo, data, lp = micro_batch(3, batch=8, resp_len=20, noise=0.3)
    valid = data["response_mask"].bool()
    g = torch.Generator().manual_seed(4)
    kept = valid & (torch.rand(valid.shape, generator=g) > 0.2)
    n_kept = int(kept.sum())
    ours_data = _with(data, **{loss_mod.MASK_FIELD: kept, loss_mod.SCORE_FIELD: torch.rand(valid.shape)})
    tu.assign_non_tensor(ours_data, batch_num_tokens=n_kept)
    stock_data = _with(data, response_mask=kept.to(data["response_mask"].dtype))
    tu.assign_non_tensor(stock_data, batch_num_tokens=n_kept)
    ls, gs, _ = run(ppo_loss, stock, mo, stock_data, lp)
    lo, go, metrics = run(tokensel_ppo_loss, ours, mo, ours_data, lp)
    torch.testing.assert_close(lo, ls, rtol=1e-6, atol=1e-7)
    gp = padded(go, data)
    assert torch.equal(gp[valid & ~kept], torch.zeros_like(gp[valid & ~kept]))
    torch.testing.assert_close(gp[kept], padded(gs, data)[kept], rtol=1e-6, atol=1e-9)
    assert _stat(metrics, "stapo/spurious_tokens") == int((valid & ~kept).sum())


# --------------------------------------------------------------------------------------------
# order and refusals
# --------------------------------------------------------------------------------------------
def test_shaping_comes_before_a_score_that_reads_the_advantage():
    valid, adv, lp, ent = _stapo_data()
    old = lp + 0.1
    base = preset("gradient_mask", score="grad_norm", ratio=0.2, direction="top", scope="micro_batch", normaliser="all")
    shaped = override(base, shaping="ar", ar_alpha=0.9)
    fields = {"response_mask": valid, "log_probs": lp, "old_log_probs": old, "entropy": ent}
    out = apply_rule(shaped, score_batch("grad_norm", {**fields, "advantages": adv}))
    w = 0.9 * torch.exp(old) + 0.1
    expected = apply_rule(base, score_batch("grad_norm", {**fields, "advantages": adv * w}))
    assert torch.equal(out.mask, expected.mask)
    plain = apply_rule(base, score_batch("grad_norm", {**fields, "advantages": adv}))
    assert not torch.equal(out.mask, plain.mask)  # the shaped weights rank differently here


@pytest.mark.parametrize("preset,knobs,key", [
    ("forking", {"ar_alpha": 0.2}, "ar_alpha"),
    ("ar", {"entropy_alpha": 0.2}, "entropy_alpha"),
    ("forking", {"lopti_eta": 0.4}, "lopti_eta"),
    ("gmts", {"stapo_prob": 0.01}, "stapo_prob"),
    ("ar", {"ratio": 0.2}, "ratio"),
    ("stapo", {"scope": "group"}, "scope"),
    ("stapo", {"normaliser": "all"}, "normaliser"),
    ("forking", {"normaliser": "kept"}, "normaliser"),
    ("entropy_adv", {"entropy_kappa": 1.0}, "entropy_kappa"),
    ("lopti", {"lopti_eta": 0.0}, "lopti_eta"),
    ("ar", {"shaping": "bogus"}, "shaping"),
    ("kl_cov_global", {"phases": "lopti"}, "phases"),
])
def test_what_a_rule_cannot_serve_is_refused_naming_the_key(preset, knobs, key):
    from verl_tokensel.core.config import TokenSelectionConfig

    with pytest.raises(TokenSelectionConfigError, match=f"token_selection.{key}"):
        resolve_selection(preset, TokenSelectionConfig(**knobs))


def test_the_rules_combine_with_a_ranked_mask():
    """forking's top-20% entropy mask with AR's weights: the gradient only on the mask, scaled by the weight."""
    ours = actor_config("forking", {"shaping": "ar", "ar_alpha": 0.5})
    plain = actor_config("forking")
    mo, data, lp = micro_batch(1, batch=8, resp_len=20, noise=0.3)
    w = 0.5 * torch.exp(data["old_log_probs"]) + 0.5
    lo, go, _ = run(tokensel_ppo_loss, ours, mo, data, lp)
    lp_, gp_, _ = run(tokensel_ppo_loss, plain, mo, _with(data, advantages=data["advantages"] * w), lp)
    torch.testing.assert_close(lo, lp_, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(go, gp_, rtol=1e-6, atol=1e-9)
