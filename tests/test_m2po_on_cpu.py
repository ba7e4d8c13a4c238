"""M2PO (``token_selector=m2po_global``) restated: the released masking loop (AReaL's ``_apply_m2po_masking`` and
``_get_m2po_loss_mask`` of ``areal/trainer/ppo/actor.py``: sort ``(old_logp - prox_logp)^2`` of the loss-mask tokens
descending, mask the first ``k``, ``k`` the first index whose suffix mean is under the threshold, else all but one),
written out here over one process holding the whole mini-batch, against the preset's mask (through the real
pre-pass, which runs no forward for it) and its loss and gradient through the selecting loss (1e-6), on batches
where tokens are masked; two gloo ranks pick exactly the tokens one process picks; what cannot be served is
refused, naming the key."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from verl.utils import tensordict_utils as tu

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.batch import score_batch
from verl_tokensel.core.config import PRESETS, TokenSelectionConfigError, override
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.rules.m2po import kept_count, m2po_kept_tokens
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss
from verl_tokensel.verl_glue.prepass import PREPASS_METRIC_PREFIX, prepass_select

from helpers.actor_configs import actor_config, micro_batch, padded
from helpers.distributed import run_distributed

TAU = 0.04
EPS = 0.2


# --------------------------------------------------------------------------------------------
# the released loop, written out (one process, the whole mini-batch as AReaL's loss_fn would see it)
# --------------------------------------------------------------------------------------------
def released_m2po_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """The loss mask after M2PO: old_logp the behaviour (rollout) policy, prox_logp the recomputed proximal one. A
    stable sort fixes the order of ties (the release's torch.sort is unstable; ties are masked earliest first)."""
    m2 = (old_logp - prox_logp) ** 2
    flat = loss_mask.reshape(-1).bool()
    selected = m2.reshape(-1)[flat]
    if selected.numel() == 0:
        return loss_mask.bool()
    sorted_m2, order = torch.sort(selected, descending=True, stable=True)
    n = sorted_m2.numel()
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(suffix_mean < m2_threshold)[0]
    num_to_mask = int(below[0]) if below.numel() > 0 else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool)
    keep_sorted[:num_to_mask] = False
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order] = keep_sorted
    out = torch.zeros_like(flat)
    out[flat] = keep
    return out.view_as(loss_mask)


def released_ppo_loss(log_prob, prox_logp, advantages, loss_mask, eps_clip):
    """AReaL's ppo_actor_loss_fn, token level, no dual clip and no rejection sampling: masked sum over the kept
    tokens divided by their count."""
    ratio = torch.where(loss_mask, torch.exp(log_prob - prox_logp), 0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg = torch.max(-advantages * ratio, -advantages * clipped)
    return torch.where(loss_mask, pg, 0).sum() / loss_mask.count_nonzero()


def _with_rollout(data, seed, outliers=0.08, spread=0.1):
    """The rollout engine's log-probs: old_log_probs plus a small mismatch and a few large ones (stale tokens)."""
    g = torch.Generator().manual_seed(500 + seed)
    old = data["old_log_probs"]
    noise = torch.randn(old.shape, generator=g) * spread
    big = (torch.rand(old.shape, generator=g) < outliers) * torch.randn(old.shape, generator=g) * 1.5
    out = copy.copy(data)
    out[fields.ROLLOUT_LOG_PROBS] = (old + noise + big) * data["response_mask"].to(old.dtype)
    return out


def _worker():
    """What the pre-pass reads of a worker when it needs no forward: the engine's data-parallel group (none here)."""
    return SimpleNamespace(engine=SimpleNamespace(get_data_parallel_group=lambda: None))


def _cfg(**selection):
    return actor_config("m2po_global", selection or None, clip_ratio=EPS, clip_ratio_low=EPS, clip_ratio_high=EPS,
                        clip_ratio_c=1e6)


def _run(cfg, mo, data, lp):
    loss, metrics = tokensel_ppo_loss(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_m2po_global_is_the_released_mask_and_loss(seed):
    cfg = _cfg()
    mo, data, lp = micro_batch(seed, batch=8, resp_len=24, noise=0.3)
    data = _with_rollout(data, seed)
    valid = data["response_mask"].bool()
    want_mask = released_m2po_mask(data[fields.ROLLOUT_LOG_PROBS], data["old_log_probs"], valid, TAU)
    n_masked = int((valid & ~want_mask).sum())
    assert 3 <= n_masked < int(valid.sum()) // 2, "the batch must have masked tokens"
    # the real pre-pass over the mini-batch (one rank): no forward (the stub worker has no engine to run one)
    metrics = prepass_select(_worker(), data, cfg)
    assert metrics[PREPASS_METRIC_PREFIX + "reused_old_pass"] == 1.0
    assert torch.equal(data[fields.MASK].bool(), want_mask)
    assert torch.equal(data["loss_mask"].bool(), want_mask)
    assert metrics[PREPASS_METRIC_PREFIX + "selected_tokens"] == float(want_mask.sum())
    tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()))  # the engine counts loss_mask
    loss, grad, loss_metrics = _run(cfg, mo, data, lp)
    lp_pad = padded(lp, data)
    want = released_ppo_loss(lp_pad, data["old_log_probs"], data["advantages"], want_mask, EPS)
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    g = padded(grad, data)
    assert torch.equal(g[valid & ~want_mask], torch.zeros_like(g[valid & ~want_mask]))
    assert float(loss_metrics["tokensel/m2po/masked_tokens"]) == n_masked
    m2 = (data[fields.ROLLOUT_LOG_PROBS] - data["old_log_probs"]) ** 2
    assert float(m2[want_mask].mean()) < TAU <= float(m2[valid].mean())
    assert float(loss_metrics["tokensel/m2po/kept_m2_mean"]) == pytest.approx(float(m2[want_mask].mean()), rel=1e-5)


def test_m2po_with_the_papers_denominator_keeps_every_token_in_it():
    """normaliser=all (the paper's 1 / sum |o_i|): same mask, the masked tokens' gradient 0, the denominator all."""
    cfg = _cfg(normaliser="all")
    mo, data, lp = micro_batch(4, batch=8, resp_len=24, noise=0.3)
    data = _with_rollout(data, 4)
    valid = data["response_mask"].bool()
    want_mask = released_m2po_mask(data[fields.ROLLOUT_LOG_PROBS], data["old_log_probs"], valid, TAU)
    assert int((valid & ~want_mask).sum()) >= 3
    before = data["loss_mask"].clone() if "loss_mask" in data.keys() else None
    prepass_select(_worker(), data, cfg)
    assert torch.equal(data[fields.MASK].bool(), want_mask)
    if before is not None:  # the loss mask (verl's denominator) keeps every valid token
        assert torch.equal(data["loss_mask"], before)
    _, grad, _ = _run(cfg, mo, data, lp)
    lp_pad = padded(lp, data)
    ratio = torch.exp(lp_pad - data["old_log_probs"])
    adv = data["advantages"]
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - EPS, 1 + EPS))
    (want_grad,) = torch.autograd.grad(torch.where(want_mask, pg, 0).sum() / valid.sum(), lp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------------------------
# the selection itself: the released loop on many pools, ties and edge cases included
# --------------------------------------------------------------------------------------------
def _pool(seed, rows=12, length=30, levels=None, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 3, length + 1, (rows,), generator=g)
    valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    prox = -torch.rand(rows, length, generator=g) * 4
    delta = torch.randn(rows, length, generator=g) * 0.1 * scale
    delta = delta + (torch.rand(rows, length, generator=g) < 0.05) * torch.randn(rows, length, generator=g)
    if levels is not None:  # few distinct values: ties at the boundary
        delta = torch.round(delta * levels) / levels
    return valid, prox + delta, prox


CASES = [dict(seed=s) for s in range(4)] + [dict(seed=7, levels=4), dict(seed=8, levels=10), dict(seed=9, scale=6.0),
                                            dict(seed=10, scale=0.1)]
THRESHOLDS = [TAU, 0.004, 0.4, 1e-6]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_the_kept_tokens_are_the_released_loops(case):
    valid, behav, prox = _pool(**case)
    m2 = (behav - prox) ** 2
    for tau in THRESHOLDS:
        want = released_m2po_mask(behav, prox, valid, tau)
        got = m2po_kept_tokens(m2, valid, tau)
        assert torch.equal(got, want), (case, tau)
        kept, n = kept_count(m2[valid], tau)
        assert kept == int(want.sum()) and n == int(valid.sum())
    # the rule step over a score batch: the same mask
    sel = override(PRESETS["m2po_global"], m2po_threshold=TAU)
    sb = score_batch("m2po", {"response_mask": valid, "old_log_probs": prox, "rollout_log_probs": behav})
    out = apply_rule(sel, sb)
    assert torch.equal(out.mask, released_m2po_mask(behav, prox, valid, TAU))
    assert out.stats["m2po/masked_tokens"] == int((valid & ~out.mask).sum())


def test_edge_pools():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert not m2po_kept_tokens(torch.ones(2, 3), empty, TAU).any()
    assert kept_count(torch.zeros(0), TAU) == (0, 0)
    valid = torch.ones(2, 3, dtype=torch.bool)
    # every value over the threshold: all but one masked, the last of the tied minima kept (stable order)
    same = torch.full((2, 3), 0.5)
    want = torch.zeros(2, 3, dtype=torch.bool)
    want[1, 2] = True
    assert torch.equal(m2po_kept_tokens(same, valid, TAU), want)
    assert torch.equal(released_m2po_mask(same.sqrt(), torch.zeros(2, 3), valid, TAU), want)
    # an infinite second moment (a -inf rollout log-prob) is masked first; nothing else needs to go
    m2 = torch.full((2, 3), 0.01)
    m2[0, 1] = float("inf")
    assert torch.equal(m2po_kept_tokens(m2, valid, TAU), valid & ~(m2 == float("inf")))
    # under the threshold already: nothing masked
    assert torch.equal(m2po_kept_tokens(torch.full((2, 3), 0.01), valid, TAU), valid)


# --------------------------------------------------------------------------------------------
# over two data-parallel ranks: the tokens one process holding the whole mini-batch picks
# --------------------------------------------------------------------------------------------
def _m2po_rank(rank, world):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # run_distributed set the rank, world and address
    out = []
    for case in CASES:
        valid, behav, prox = _pool(**case)
        rows = valid.shape[0] // world
        sl = slice(rank * rows, (rank + 1) * rows)
        m2 = (behav[sl] - prox[sl]) ** 2
        out.append([m2po_kept_tokens(m2, valid[sl], tau, dp_group=dist.group.WORLD) for tau in THRESHOLDS])
    return out


def test_two_ranks_pick_the_tokens_of_one_process():
    per_rank = run_distributed(_m2po_rank, world_size=2, timeout=240)
    for i, case in enumerate(CASES):
        valid, behav, prox = _pool(**case)
        for j, tau in enumerate(THRESHOLDS):
            whole = m2po_kept_tokens((behav - prox) ** 2, valid, tau)
            assert torch.equal(torch.cat([r[i][j] for r in per_rank]), whole), (case, tau)
            assert torch.equal(whole, released_m2po_mask(behav, prox, valid, tau)), (case, tau)


# --------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, -0.04, float("nan"), float("inf"), True])
def test_a_bad_threshold_is_refused_naming_the_key(value):
    with pytest.raises(TokenSelectionConfigError,
                       match=r"token_selection\.m2po_threshold=.* is invalid; valid values: a number > 0"):
        override(PRESETS["m2po_global"], m2po_threshold=value)


def test_a_bad_threshold_is_refused_where_the_actor_config_is_built():
    with pytest.raises(Exception, match=r"token_selection\.m2po_threshold=-1.0 is invalid; valid values: a number > 0"):
        actor_config("m2po_global", {"m2po_threshold": -1.0}, fresh=True)


@pytest.mark.parametrize("knobs,key", [
    ({"scope": "micro_batch"}, "token_selection.scope"),
    ({"score_source": "current", "normaliser": "all"}, "token_selection.score_source"),
    ({"normaliser": "selected"}, "token_selection.normaliser"),
    ({"score": "entropy"}, "token_selection.score"),
    ({"ratio": 0.5}, "token_selection.ratio"),
])
def test_what_the_rule_cannot_serve_is_refused_naming_the_key(knobs, key):
    with pytest.raises(TokenSelectionConfigError, match=key.replace(".", r"\.") + ".*"):
        override(PRESETS["m2po_global"], **knobs)


def _compose(overrides=()):
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose("tokensel_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                                      "actor_rollout_ref.actor.token_selector=m2po_global",
                                                      *overrides])


@pytest.mark.parametrize("overrides,needle", [
    (["actor_rollout_ref.rollout.calculate_log_probs=false"],
     "actor_rollout_ref.rollout.calculate_log_probs=False is invalid"),
    (["algorithm.rollout_correction.bypass_mode=true"],
     "algorithm.rollout_correction.bypass_mode=True is invalid"),
])
def test_no_behaviour_log_probs_is_refused_on_the_driver(overrides, needle):
    from verl_tokensel.verl_glue.install import validate_driver_config

    with pytest.raises(TokenSelectionConfigError) as exc:
        validate_driver_config(_compose(overrides))
    msg = str(exc.value)
    assert needle in msg and "valid values:" in msg and "Fix:" in msg, msg


def test_the_driver_accepts_the_rollout_log_probs():
    """verl 0.9.1's rollout.yaml computes them by default (calculate_log_probs: True)."""
    from verl_tokensel.verl_glue.install import validate_driver_config

    cfg = _compose()
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    validate_driver_config(cfg)


def test_a_batch_without_rollout_log_probs_fails_loudly():
    """A custom trainer that drops the field: the pre-pass raises, naming the field and the fix, instead of masking
    nothing."""
    cfg = _cfg()
    _, data, _ = micro_batch(0, batch=4, resp_len=10, noise=0.3)
    with pytest.raises(ValueError, match=r"rollout_log_probs.*calculate_log_probs=True"):
        prepass_select(_worker(), data, cfg)
