"""The token rules whose selected tokens get more than a gradient mask: KL-Cov, Clip-Cov (``kl_cov_global``,
``clip_cov_global``) and Archer (``archer``), against verl's own losses and our restatements of the papers' formulas.

- at ``scope=micro_batch`` the two covariance presets equal verl's ``loss_mode=kl_cov`` / ``clip_cov`` bit for bit
  (Clip-Cov: whenever its candidates fit the budget; otherwise given verl's ``torch.randperm`` draw);
- over data-parallel ranks the pooled scopes pick the tokens one process holding the whole pool picks (gloo);
- Archer's loss and gradient equal a hand-written restatement of the released code's per-token loss;
- what a rule cannot serve is refused by the config, naming the keys.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core.ranking.batch import score_batch
from verl_tokensel.core.config import PRESETS, TokenSelectionConfigError, override, resolve_selection
from verl_tokensel.core.rules.covariance import cov_budget, cov_scores
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.rules.clip_cov import candidates as clip_cov_candidates
from verl_tokensel.core.rules.clip_cov import clipped_by_ratio, select_clip_cov
from verl_tokensel.core.rules.kl_cov import select_kl_cov
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss
from verl_tokensel.core.rules.clip_cov import clip_cov_token_losses
from verl_tokensel.verl_glue.policy_loss import PPO_CLIP_PER_TOKEN, rule_token_loss

from helpers.actor_configs import actor_config, micro_batch, padded
from helpers.distributed import run_distributed

IN_LOSS = {"scope": "micro_batch", "score_source": "current"}


def run(loss_fn, cfg, mo, data, lp):
    loss, metrics = loss_fn(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _inputs(data, lp_pad):
    valid = data["response_mask"].bool()
    return valid, data["advantages"], data["old_log_probs"], lp_pad


def select_cov(rule, *, advantages, log_prob, pool, ratio, group=None, verl_means=False, old_log_prob=None, draw=None,
               lb=1.0, ub=5.0):
    """The covariance rules' own selections, by rule name."""
    if rule == "kl_cov":
        return select_kl_cov(advantages, log_prob, pool, ratio, dp_group=group, verl_means=verl_means)
    return select_clip_cov(advantages, log_prob, old_log_prob, pool, ratio, draw, lb=lb, ub=ub, dp_group=group,
                           verl_means=verl_means)


# --------------------------------------------------------------------------------------------
# KL-Cov: scope micro_batch is verl's loss_mode=kl_cov, bit for bit
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [2e-4, 0.05, 0.3])
@pytest.mark.parametrize("coef", [0.1, 1.0])
def test_kl_cov_at_micro_batch_scope_is_verls_kl_cov(ratio, coef):
    stock = actor_config(None, **{"policy_loss.loss_mode": "kl_cov", "policy_loss.kl_cov_ratio": ratio,
                                  "policy_loss.ppo_kl_coef": coef})
    ours = actor_config("kl_cov_global", {**IN_LOSS, "ratio": ratio, "kl_penalty_coef": coef})
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=24, noise=0.3)
        ls, gs, _ = run(ppo_loss, stock, mo, data, lp)
        lo, go, metrics = run(tokensel_ppo_loss, ours, mo, data, lp)
        assert torch.equal(lo, ls), (lo, ls)
        assert torch.equal(go, gs)
        n = int(data["response_mask"].sum())
        assert _stat(metrics, "selected_fraction") == pytest.approx(cov_budget(ratio, n) / n)


def _stat(metrics, key):
    v = metrics["tokensel/" + key]
    return float(v.aggregate()) if hasattr(v, "aggregate") else float(v)


def test_kl_cov_penalises_exactly_the_top_covariance_tokens():
    """Restatement: cov = (A - mean A)(log pi - mean log pi) over the valid tokens; the top max(1, int(r N)) get
    coef * |log r| on the unclipped -A r (hand-written here from the paper's Eq., not verl's code)."""
    ratio, coef = 0.1, 0.5
    ours = actor_config("kl_cov_global", {**IN_LOSS, "ratio": ratio, "kl_penalty_coef": coef})
    mo, data, lp = micro_batch(4, batch=6, resp_len=20, noise=0.3)
    _, grad, _ = run(tokensel_ppo_loss, ours, mo, data, lp)
    valid = data["response_mask"].bool()
    adv, old = data["advantages"], data["old_log_probs"]
    x = padded(mo["log_probs"], data).detach().double()
    a, lpv = adv.double()[valid], x[valid]
    cov = (a - a.mean()) * (lpv - lpv.mean())
    k = max(1, int(valid.sum().item() * ratio))
    top = torch.zeros_like(cov, dtype=torch.bool)
    top[torch.topk(cov, k).indices] = True
    chosen = torch.zeros_like(valid)
    chosen[valid] = top
    # d/dlp of the token loss -A r + c |lp - old| (token-mean over all valid tokens)
    r = torch.exp(x - old.double())
    g = -adv.double() * r + torch.where(chosen, coef * torch.sign(x - old.double()), 0.0)
    expect = torch.where(valid, g / valid.sum(), 0.0)
    torch.testing.assert_close(padded(grad, data).double(), expect, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------------------------
# Clip-Cov: scope micro_batch is verl's loss_mode=clip_cov
# --------------------------------------------------------------------------------------------
def test_clip_cov_at_micro_batch_scope_is_verls_clip_cov_when_the_candidates_fit():
    """ratio 1: every candidate is detached whatever the draw, so verl's randperm and our keyed draw agree."""
    knob = {"policy_loss.loss_mode": "clip_cov", "policy_loss.clip_cov_ratio": 1.0, "policy_loss.clip_cov_lb": 0.0,
            "policy_loss.clip_cov_ub": 0.5}
    stock = actor_config(None, **knob)
    ours = actor_config("clip_cov_global", {**IN_LOSS, "ratio": 1.0, "cov_lb": 0.0, "cov_ub": 0.5})
    zeroed = 0
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=24, noise=0.3)
        ls, gs, sm = run(ppo_loss, stock, mo, data, lp)
        lo, go, om = run(tokensel_ppo_loss, ours, mo, data, lp)
        assert torch.equal(lo, ls) and torch.equal(go, gs)
        assert om["actor/pg_clipfrac"].aggregate() == sm["actor/pg_clipfrac"].aggregate()
        zeroed += _stat(om, "selected_tokens")
    assert zeroed > 0  # the bounds above make candidates


def test_clip_cov_loss_given_verls_draw_is_verls_clip_cov():
    """More candidates than the budget: verl draws with torch.randperm; handed the same tokens, our loss is
    verl's bit for bit, and our own keyed draw picks the same number of tokens out of the same candidates."""
    ratio, lb, ub = 0.05, 0.0, 0.5
    knob = {"policy_loss.loss_mode": "clip_cov", "policy_loss.clip_cov_ratio": ratio, "policy_loss.clip_cov_lb": lb,
            "policy_loss.clip_cov_ub": ub}
    stock = actor_config(None, **knob)
    ours = actor_config("clip_cov_global", {**IN_LOSS, "ratio": ratio, "cov_lb": lb, "cov_ub": ub})
    mo, data, lp = micro_batch(7, batch=10, resp_len=30, noise=0.3)
    valid = data["response_mask"].bool()
    adv, old = data["advantages"], data["old_log_probs"]
    x = padded(mo["log_probs"], data).detach()
    cand = clip_cov_candidates(cov_scores(adv, x, valid, means="masked"),
                               clipped_by_ratio(x, old, adv, 0.2, 0.2), valid, lb, ub)
    k = cov_budget(ratio, int(valid.sum()))
    assert int(cand.sum()) > k
    torch.manual_seed(11)
    idx = torch.nonzero(cand)[torch.randperm(int(cand.sum()))[:k]]  # verl's draw, replayed
    verl_zeroed = torch.zeros_like(valid)
    verl_zeroed[idx[:, 0], idx[:, 1]] = True
    torch.manual_seed(11)
    ls, gs, _ = run(ppo_loss, stock, mo, data, lp)
    lpp = padded(mo["log_probs"], data)
    ref = stock  # the same clip bounds and global batch info as verl's call
    lo, _ = rule_token_loss(old, lpp, adv, valid, stock.loss_agg_mode, ref,
                            token_loss=partial(clip_cov_token_losses, loss_weight=(~verl_zeroed).float()))
    # verl's ppo_loss adds nothing else here (no entropy, no KL): the policy loss is the loss
    (go,) = torch.autograd.grad(lo, lp)
    assert torch.equal(lo.detach(), ls) and torch.equal(go, gs)
    _, _, metrics = run(tokensel_ppo_loss, ours, mo, data, lp)
    assert _stat(metrics, "selected_tokens") == k


# --------------------------------------------------------------------------------------------
# the pooled scopes: the same tokens over W ranks as in one process holding the whole pool
# --------------------------------------------------------------------------------------------
def _pool_data(seed=3, rows=16, length=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 3, length + 1, (rows,), generator=g)
    valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(rows, 1, generator=g).expand(rows, length).contiguous()  # GRPO: one value per response
    lp = -torch.rand(rows, length, generator=g).pow(3) * 6
    old = lp + 0.3 * torch.randn(rows, length, generator=g)
    draw = torch.rand(rows, length, generator=g)
    return valid, adv, lp, old, draw


POOLED_CASES = [("kl_cov", 0.02), ("kl_cov", 0.2), ("clip_cov", 0.02)]


def _select_rank(rank, world):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # run_distributed set the rank, world and address
    assert dist.get_world_size() == world
    valid, adv, lp, old, draw = _pool_data()
    rows = valid.shape[0] // world
    sl = slice(rank * rows, (rank + 1) * rows)
    return [select_cov(rule, advantages=adv[sl], log_prob=lp[sl], pool=valid[sl], ratio=ratio,
                       group=dist.group.WORLD, old_log_prob=old[sl], draw=draw[sl], lb=-0.5, ub=0.5)[0]
            for rule, ratio in POOLED_CASES]


def test_pooled_scope_over_two_ranks_picks_the_tokens_of_one_process():
    """Two gloo ranks (one spawn for every case: process start-up is most of the cost)."""
    valid, adv, lp, old, draw = _pool_data()
    per_rank = run_distributed(_select_rank, world_size=2, timeout=240)
    for i, (rule, ratio) in enumerate(POOLED_CASES):
        whole, _ = select_cov(rule, advantages=adv, log_prob=lp, pool=valid, ratio=ratio, old_log_prob=old,
                              draw=draw, lb=-0.5, ub=0.5)
        assert torch.equal(torch.cat([r[i] for r in per_rank]), whole), (rule, ratio)
        assert int(whole.sum()) > 0
        if rule == "kl_cov":
            assert int(whole.sum()) == cov_budget(ratio, int(valid.sum()))


def test_mini_batch_selection_does_not_move_with_the_micro_batch_split():
    """The rule step on a rank's whole mini-batch (what the pre-pass runs) and the mask each micro-batch then reads
    back: the micro-batch size cannot change which tokens are penalised (verl issue: per-micro-batch pools)."""
    valid, adv, lp, old, _ = _pool_data(seed=5)
    sel = PRESETS["kl_cov_global"]
    sel = override(sel, ratio=0.05)
    tensors = {"response_mask": valid, "advantages": adv, "old_log_probs": old, "log_probs": lp}
    whole = apply_rule(sel, score_batch(sel.score, tensors), stats=False)
    assert int(whole.mask.sum()) == cov_budget(0.05, int(valid.sum()))
    for size in (1, 4, 8):  # each micro-batch reads its rows of the measured mask: the union is the whole mask
        pieces = []
        for start in range(0, valid.shape[0], size):
            part = {k: v[start:start + size] for k, v in tensors.items()}
            measured = (whole.mask[start:start + size], whole.scores[start:start + size])
            pieces.append(apply_rule(sel, score_batch(sel.score, part), measured=measured, stats=False))
        assert torch.equal(torch.cat([p.mask for p in pieces]), whole.mask)
        penalty = [p.transform.token_loss.keywords["penalty"] for p in pieces]
        assert torch.equal(torch.cat(penalty), whole.transform.token_loss.keywords["penalty"])
    # while verl's per-micro-batch pool picks other tokens at each size
    per_mb = {size: torch.cat([select_cov("kl_cov", advantages=adv[s:s + size], log_prob=lp[s:s + size],
                                          pool=valid[s:s + size], ratio=0.05, verl_means=True)[0]
                               for s in range(0, valid.shape[0], size)]) for size in (2, 8)}
    assert not torch.equal(per_mb[2], per_mb[8])


# --------------------------------------------------------------------------------------------
# Archer: per-token clip bounds and KL weight, against a restatement of the released code's loss
# --------------------------------------------------------------------------------------------
def test_ppo_clip_per_token_without_bounds_is_verls_vanilla():
    stock = actor_config(None, clip_ratio_high=0.28, clip_ratio_c=10.0)
    via_registry = actor_config(None, clip_ratio_high=0.28, clip_ratio_c=10.0,
                                **{"policy_loss.loss_mode": PPO_CLIP_PER_TOKEN})
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=8, resp_len=24, noise=0.4)
        ls, gs, sm = run(ppo_loss, stock, mo, data, lp)
        lo, go, om = run(ppo_loss, via_registry, mo, data, lp)
        assert torch.equal(lo, ls) and torch.equal(go, gs)
        assert {k: getattr(v, "aggregate", lambda v=v: v)() for k, v in om.items()} == \
            {k: getattr(v, "aggregate", lambda v=v: v)() for k, v in sm.items()}


# --------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,actor,key", [
    ("kl_cov_global", {"loss_mode": "kl_cov"}, "policy_loss.loss_mode"),
    ("clip_cov_global", {"loss_mode": "gspo"}, "policy_loss.loss_mode"),
    ("archer", {"use_kl_loss": False}, "use_kl_loss"),
])
def test_a_rule_the_actor_cannot_serve_is_refused_naming_the_key(preset, actor, key):
    with pytest.raises(TokenSelectionConfigError, match=key.replace(".", r"\.") + ".*Fix:"):
        resolve_selection(preset, **actor)


@pytest.mark.parametrize("knobs,key", [
    ({"scope": "group"}, "token_selection.scope"),
    ({"normaliser": "selected", "score_source": "current", "scope": "micro_batch"}, "token_selection.normaliser"),
    ({"cov_lb": 5.0, "cov_ub": 1.0}, "token_selection.cov_ub"),
    ({"action": "nope"}, "token_selection.action"),
    ({"budget": "quantile"}, "token_selection.budget"),
])
def test_invalid_rule_knobs_name_the_key(knobs, key):
    with pytest.raises(TokenSelectionConfigError, match=key.replace(".", r"\.")):
        override(PRESETS["clip_cov_global"], **knobs)


def test_new_presets_run_their_rule_in_the_loss():
    """Every action-bearing preset, in its in-loss form, gives a finite loss and gradient on every valid token."""
    for preset in ("kl_cov_global", "clip_cov_global", "archer"):
        extra = dict(use_kl_loss=True, calculate_entropy=True) if preset == "archer" else {}
        cfg = actor_config(preset, IN_LOSS if PRESETS[preset].score_source != "current" else None, **extra)
        mo, data, lp = micro_batch(2, batch=6, resp_len=20, noise=0.3, with_ref=True)
        tu.assign_non_tensor(data, global_batch_size=6)
        loss, grad, _ = run(tokensel_ppo_loss, cfg, mo, data, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert (padded(grad, data)[data["response_mask"].bool()] != 0).float().mean() > 0.5


# --------------------------------------------------------------------------------------------
# through verl's real FSDP2 TrainingWorker: the pre-pass's mini-batch pool, whatever the micro-batches
# --------------------------------------------------------------------------------------------
ENGINE_SPLITS = [  # (ppo_micro_batch_size_per_gpu, use_dynamic_bsz, ppo_max_token_len_per_gpu)
    (2, False, 40), (4, True, 56),
]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """kl_cov_global and clip_cov_global on one mini-batch of 8 responses, split two ways by the engine."""
    from verl_tokensel_cpu import batches as B, tiny_model, worker as H
    from verl_tokensel.verl_glue.loss import SelectingLoss

    model_dir = tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_rules") / "qwen2")
    out = {}
    for micro, dyn, max_tokens in ENGINE_SPLITS:
        actor = H.make_training_worker(model_dir, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=micro,
                                       use_dynamic_bsz=dyn, ppo_max_token_len_per_gpu=max_tokens, lr=0.0,
                                       clip_grad=1e9)
        for preset, knobs in (("kl_cov_global", {"ratio": 0.05}),
                              ("clip_cov_global", {"ratio": 0.05, "cov_lb": -10.0})):
            seen = []
            cfg = H.selecting_actor_config(actor, preset, **knobs)
            batch = B.make_update_batch(actor, n=8, seed=3, resp_len=(4, 12))
            H.compute_old_log_probs(actor, batch)

            def observe(rec, seen=seen):
                rows = [tuple(r.tolist()) for r in rec["data"]["responses"].unbind(0)]
                seen.append((rows, rec["mask"].clone(), rec["response_mask"].clone()))

            result = H.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg, observer=observe),
                                      capture_grads=False, capture_params=False)
            out[(preset, micro, dyn)] = (seen, result)
    return out


@pytest.mark.parametrize("preset", ["kl_cov_global", "clip_cov_global"])
def test_engine_selection_is_the_same_for_any_micro_batch_split(engine_runs, preset):
    chosen = {}
    for micro, dyn, _ in ENGINE_SPLITS:
        seen, result = engine_runs[(preset, micro, dyn)]
        assert len(seen) > 1 or micro == 8  # the mini-batch really was split
        picks, n_valid = {}, 0
        for rows, mask, valid in seen:
            for i, resp in enumerate(rows):
                picks[resp] = tuple(mask[i].nonzero().flatten().tolist())
            n_valid += int(valid.sum())
        assert sum(len(p) for p in picks.values()) == cov_budget(0.05, n_valid)
        losses = [v for k, vs in result.metrics.items() if k.endswith("pg_loss")
                  for v in (vs if isinstance(vs, list) else [vs])]
        assert losses and all(math.isfinite(float(v)) for v in losses)
        chosen[(micro, dyn)] = picks
    first, *others = chosen.values()
    assert all(o == first for o in others), chosen


def test_each_action_reports_its_own_metrics():
    """tokensel/<rule>/... keys, so a side-by-side comparison reads the same names for every run of a rule."""
    cases = {"kl_cov_global": ("kl_cov", {}), "clip_cov_global": ("clip_cov", {}),
             "archer": ("archer", dict(use_kl_loss=True, calculate_entropy=True))}
    for preset, (group, extra) in cases.items():
        knobs = {**IN_LOSS, "ratio": 0.1} if preset != "archer" else {}
        if preset == "clip_cov_global":
            knobs["cov_lb"] = -10.0
        cfg = actor_config(preset, knobs, **extra)
        mo, data, lp = micro_batch(3, batch=6, resp_len=20, noise=0.3, with_ref=True)
        _, _, metrics = run(tokensel_ppo_loss, cfg, mo, data, lp)
        n = int(data["response_mask"].sum())
        assert _stat(metrics, f"{group}/selected_tokens") == _stat(metrics, "selected_tokens") > 0, preset
        assert _stat(metrics, f"{group}/selected_share") == pytest.approx(_stat(metrics, "selected_tokens") / n)
    assert "tokensel/kl_cov/min_selected_cov" in run(
        tokensel_ppo_loss, actor_config("kl_cov_global", {**IN_LOSS, "ratio": 0.1}), *micro_batch(3))[2]
    _, _, metrics = run(tokensel_ppo_loss, actor_config("archer", None, use_kl_loss=True, calculate_entropy=True),
                        *micro_batch(5, batch=6, resp_len=20, noise=0.6, with_ref=True))
    assert {"tokensel/archer/clipfrac_selected", "tokensel/archer/clipfrac_unselected"} <= set(metrics)


def test_clip_cov_gradient_matches_the_restatement():
    """Restatement from the paper's Clip-Cov: candidates lb < cov < ub among the tokens the PPO clip has not
    clipped; with a budget that holds them all, each gets no gradient; every other token keeps the clipped
    surrogate's (no dual clip), token-mean over all valid tokens. Written here from the formula, in float64."""
    lb, ub = -0.05, 0.05
    ours = actor_config("clip_cov_global", {**IN_LOSS, "ratio": 1.0, "cov_lb": lb, "cov_ub": ub})
    mo, data, lp = micro_batch(9, batch=6, resp_len=20, noise=0.4)
    _, grad, _ = run(tokensel_ppo_loss, ours, mo, data, lp)
    valid = data["response_mask"].bool()
    adv, old = data["advantages"].double(), data["old_log_probs"].double()
    x = padded(mo["log_probs"], data).detach().double()
    n = valid.sum()
    cov = (adv - adv[valid].mean()) * (x - x[valid].mean())
    r = torch.exp(x - old)
    clipped = (-adv * torch.clamp(r, 0.8, 1.2)) > (-adv * r)
    detached = valid & ~clipped & (cov > lb) & (cov < ub)
    assert 0 < int(detached.sum()) < int(valid.sum())
    # d/dlp max(-A r, -A clip(r)): -A r where the unclipped term is the max, 0 where the clip binds
    g = torch.where(clipped, 0.0, -adv * r)
    expect = torch.where(valid & ~detached, g / n, 0.0)
    torch.testing.assert_close(padded(grad, data).double(), expect, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("preset,knob", [("forking", "kl_penalty_coef"), ("kl_cov_global", "cov_lb"),
                                         ("gmts", "selected_kl_weight"), ("clip_cov_global", "kl_penalty_coef")])
def test_a_knob_the_rule_does_not_read_is_refused(preset, knob):
    """e.g. a KL-Cov recipe's kl_penalty_coef with token_selector=forking would be ignored: refused, named."""
    from verl_tokensel.core.config import TokenSelectionConfig

    with pytest.raises(TokenSelectionConfigError, match=rf"token_selection\.{knob}=.*would be ignored"):
        resolve_selection(preset, TokenSelectionConfig(**{knob: 0.5}))
    assert resolve_selection("kl_cov_global", TokenSelectionConfig(kl_penalty_coef=1.0)).knobs.kl_penalty_coef == 1.0


@pytest.mark.parametrize("preset", ["kl_cov_global", "clip_cov_global", "archer", "ar", "lopti", "stapo"])
def test_the_analysis_tools_select_as_the_rule_does(preset):
    """view / analyze / the demo's report rank a preset's tokens with select_preset: for the toolbox presets its
    mask is the rule step's and its budgets are the counts the rule kept (a quantile, verl's count, a draw)."""
    from verl_tokensel.analysis.training_masks import select_preset

    valid, adv, lp, old, _ = _pool_data(seed=8, rows=6, length=12)
    sel = PRESETS[preset]
    knobs = {"ratio": 0.2, "cov_lb": -10.0} if preset == "clip_cov_global" else {"stapo_prob": 0.05} \
        if preset == "stapo" else {} if preset in ("archer", "ar", "lopti") else {"ratio": 0.2}
    sel = override(sel, **knobs)
    tensors = {"response_mask": valid, "advantages": adv, "old_log_probs": old, "log_probs": lp,
               "entropy": -lp * 0.5}
    batch = score_batch(sel.scores, tensors, keys=torch.arange(valid.shape[0]))
    out = select_preset(batch, sel)
    assert torch.equal(out.mask, apply_rule(sel, batch, stats=False, scope=out.scope).mask)
    assert sum(out.budgets) == int(out.mask.sum()) if out.scope == "sequence" else out.budgets[0] == int(out.mask.sum())
    assert int(out.mask.sum()) > 0
