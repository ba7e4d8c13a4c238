"""The token rules KL-Cov, Clip-Cov, Archer, AR, Lopti, entropy shaping and STAPO through verl's REAL Megatron
engine (``TrainingWorker``, ``model_engine=megatron``) on the CPU test bed, fp32, learning rate 0
(:mod:`helpers.megatron_rules`).

- ``kl_cov_global`` / ``clip_cov_global`` (ratio 0.05; Clip-Cov with ``cov_lb=-10``): the pre-pass selects over the
  whole mini-batch, so the loss applies the same tokens of each response whatever the update's micro-batching
  (micro-batches of 2, dynamic batching at 40 tokens; the pre-pass reading the old pass's values or running its
  own forward), and two data-parallel ranks holding half the mini-batch each apply the tokens one rank holding
  all of it applies; the count is ``cov_budget(0.05, N)`` of the
  mini-batch's N valid tokens; the loss is finite;
- ``archer`` (``use_kl_loss=true``, a reference log-prob in the batch, old log-probs off the policy so that both
  clip classes clip): per response, exactly the tokens above its 0.8 entropy quantile get the wide clip; its
  ``tokensel/archer/*`` metrics reach the step's metrics; its loss and the gradients of the LM head and the
  embedding equal FSDP2's on the same weights and batch (the tolerances of test_megatron_vs_fsdp_on_cpu.py);
- part 2 on Archer's batch: ``ar``, ``entropy_adv``, Lopti's first pass and ``ar_lopti``'s second (eta at the batch's
  median probability) and ``stapo`` give FSDP2's loss and gradients; ``stapo`` through the real pre-pass (its
  ``loss_mask`` rewrite) equals the stock loss with the spurious tokens out of the response mask, on both engines.

Cost on 2 cores: the one-process run (a Megatron build, ten updates, an FSDP2 build, one update) 13-27 s in the
default suite; the data-parallel run (two spawned ranks) 23-46 s, marked ``slow``.
"""

from __future__ import annotations

import math

import pytest

import torch

from verl_tokensel.core.rules.covariance import cov_budget
from verl_tokensel_cpu import tiny_model

from helpers import distributed as D
from helpers.megatron_rules import (
    COV_PRESETS,
    DP_SPLITS,
    RATIO,
    REWEIGHT_RUNS,
    SPLITS,
    dp_rank_run,
    one_rank_run,
)
from helpers.megatron_runs import assert_grads_agree

pytestmark = pytest.mark.requires("verl", "megatron", "mbridge")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_megatron_rules") / "qwen2",
                                               **tiny_model.MEGATRON_TINY_CONFIG))


@pytest.fixture(scope="module")
def one(model_dir):
    (out,) = D.run_distributed(one_rank_run, world_size=1, args=(model_dir,), timeout=400)
    print(f"one process, seconds per part: {out['seconds']}")
    return out


@pytest.fixture(scope="module")
def dp2(model_dir):
    return D.run_distributed(dp_rank_run, world_size=2, args=(model_dir,), timeout=400)


def len_sel(picks: dict) -> int:
    return sum(len(p) for p in picks.values())


def _losses_finite(run):
    values = [v for k, vs in run["metrics"].items() if k.endswith("pg_loss") for v in vs]
    return bool(values) and all(math.isfinite(v) for v in values) and math.isfinite(run["loss"])


@pytest.mark.parametrize("preset", list(COV_PRESETS))
def test_cov_rule_picks_the_same_tokens_for_any_micro_batch_split(one, preset):
    runs = {s: one["cov"][(preset, s)] for s in SPLITS}
    assert runs["micro2"]["micro_rows"] != runs["dynamic40"]["micro_rows"], "the splits did not differ"
    # the pre-pass read the old pass's values, or ran its own forward, as each split asked
    assert [runs[s]["metrics"]["tokensel/prepass/reused_old_pass"] for s in SPLITS] == [[float(SPLITS[s][3])]
                                                                                        for s in SPLITS]
    for split, run in runs.items():
        assert len(run["micro_rows"]) > 1, f"{split}: the mini-batch was not split"
        assert len(run["picks"]) == 8
        n_sel = len_sel(run["picks"])
        assert n_sel == cov_budget(RATIO, run["n_valid"]) > 1, (split, n_sel, run["n_valid"])
        group = "kl_cov" if preset == "kl_cov_global" else "clip_cov"
        assert sum(run["metrics"][f"tokensel/{group}/selected_tokens"]) == n_sel
        assert run["metrics"]["tokensel/prepass/selected_tokens"] == [n_sel]  # one mini-batch, one pre-pass
        assert _losses_finite(run), run["metrics"]
    first, *others = (runs[s]["picks"] for s in SPLITS)
    assert all(o == first for o in others)


def test_a_per_micro_batch_pool_moves_with_the_split(one):
    """The contrast: KL-Cov pooled inside each micro-batch in the loss (``scope=micro_batch``, verl's own kl_cov)
    picks other tokens when the engine splits the same mini-batch otherwise."""
    runs = one["per_micro_batch"]
    assert all(run["picks"] and _losses_finite(run) for run in runs.values())
    assert runs["micro2"]["picks"] != runs["dynamic40"]["picks"]


@pytest.mark.slow  # 23-46 s on 2 cores (two spawned ranks, a Megatron build each); CI's time is spent
@pytest.mark.parametrize("split", DP_SPLITS)
@pytest.mark.parametrize("preset", list(COV_PRESETS))
def test_cov_rule_over_two_data_parallel_ranks_picks_the_tokens_of_one(one, dp2, preset, split):
    whole = one["cov"][(preset, "micro2")]
    parts = [r["cov"][(preset, split)] for r in dp2]
    assert all(len(p["picks"]) == 4 for p in parts), "each rank holds half the mini-batch"
    assert not set(parts[0]["picks"]) & set(parts[1]["picks"])
    union = {**parts[0]["picks"], **parts[1]["picks"]}
    assert sum(p["n_valid"] for p in parts) == whole["n_valid"]
    assert union == whole["picks"]
    assert all(_losses_finite(p) for p in parts)
    # the pre-pass's count is over both ranks (all-reduced), the same on each
    assert [p["metrics"]["tokensel/prepass/selected_tokens"] for p in parts] == [[len_sel(union)]] * 2
    # each rank selected its share of the pooled budget, not a budget of its own
    assert len_sel(union) == cov_budget(RATIO, whole["n_valid"])


def test_archer_splits_each_response_at_its_entropy_quantile(one):
    run = one["archer"]["megatron"]
    assert len(run["masks"]) == 8
    for row, mask in run["masks"].items():
        h = run["entropy"][row]
        assert torch.equal(mask, h > torch.quantile(h, 0.8)), row
    assert sum(int(m.sum()) for m in run["masks"].values()) > 0
    m = run["metrics"]
    for key in ("selected_tokens", "selected_share", "clipfrac_selected", "clipfrac_unselected"):
        assert m.get(f"tokensel/archer/{key}"), (key, sorted(k for k in m if k.startswith("tokensel/")))
    # the off-policy old log-probs make both classes clip: the per-token bounds are exercised
    assert max(m["tokensel/archer/clipfrac_selected"]) > 0 and max(m["tokensel/archer/clipfrac_unselected"]) > 0
    assert m.get("kl_loss") and all(math.isfinite(v) for v in m["kl_loss"])
    assert _losses_finite(run)


def test_archer_loss_and_gradient_agree_with_fsdp(one):
    """Tolerances of test_megatron_vs_fsdp_on_cpu.py: loss rel 1e-5, gradients rtol 1e-4 / atol 1e-6."""
    m, f = one["archer"]["megatron"], one["archer"]["fsdp"]
    assert m["masks"].keys() == f["masks"].keys()
    assert all(torch.equal(m["masks"][r], f["masks"][r]) for r in m["masks"])
    assert m["loss"] == pytest.approx(f["loss"], rel=1e-5)
    assert_grads_agree(m["grads"], f["grads"], "archer")


# --------------------------------------------------------------------------------------------
# part 2: AR, entropy shaping, Lopti's passes and STAPO on the Archer batch (off-policy old log-probs, KL off)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(REWEIGHT_RUNS) + ["stock_over_kept"])
def test_reweighting_rules_agree_with_fsdp(one, name):
    """Each rule through Megatron gives FSDP2's loss and gradients on the same weights and batch (the tolerances
    of test_megatron_vs_fsdp_on_cpu.py), with its own metrics in the step's."""
    m, f = one["reweight"]["megatron"][name], one["reweight"]["fsdp"][name]
    assert _losses_finite(m) and _losses_finite(f)
    assert m["loss"] == pytest.approx(f["loss"], rel=1e-5)
    assert_grads_agree(m["grads"], f["grads"], name)
    group = {"ar": "ar/mean_weight", "entropy_adv": "entropy_adv/mean_shift", "lopti_1": "lopti/low_share",
             "lopti_2": "lopti/active_share", "stapo": "stapo/spurious_tokens",
             "ce_gppo": "ce_gppo/high_clipped_share", "aspo": "aspo/selected_share", "ktae": "ktae/bonus_abs_max",
             "gtpo": "gtpo/mean_shift", "fipo": "fipo/influence_weight_mean",
             "m2po_global": "m2po/masked_tokens"}.get(name)
    if group is not None:
        assert f"tokensel/{group}" in m["metrics"], sorted(k for k in m["metrics"] if k.startswith("tokensel/"))


def test_stapo_is_the_stock_loss_over_its_kept_tokens_on_both_engines(one):
    """The pre-pass made the kept tokens the mini-batch's loss_mask, so verl's engine divides by their count: STAPO's
    loss and gradients equal the stock loss on the same batch with the spurious tokens taken out of the response
    mask (the spurious tokens exist: some answers' tokens were dropped)."""
    for engine in ("megatron", "fsdp"):
        runs = one["reweight"][engine]
        stapo, stock = runs["stapo"], runs["stock_over_kept"]
        assert sum(int((~m).sum()) for m in stapo["masks"].values()) > 0, "no spurious token in the batch"
        assert stapo["loss"] == pytest.approx(stock["loss"], rel=1e-6)
        assert stapo["grads"].keys() == stock["grads"].keys()
        for name, g in stapo["grads"].items():
            assert g.abs().max() > 0
            torch.testing.assert_close(g, stock["grads"][name], rtol=1e-5, atol=1e-8)


def test_the_two_lopti_passes_differ_and_each_reports_its_share(one):
    runs = one["reweight"]["megatron"]
    low = runs["lopti_1"]["metrics"]["tokensel/lopti/low_share"]
    assert all(0.2 < v < 0.8 for v in low), low  # eta at the batch's median: both passes have tokens
    assert runs["lopti_1"]["loss"] != pytest.approx(runs["lopti_2"]["loss"])
