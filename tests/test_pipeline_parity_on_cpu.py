"""Batch settings stock verl runs, through verl's whole ``main_ppo`` on CPU, with the presets that need the driver or
the pre-pass, and ``none`` (stock verl) as the control on the same settings. 4 prompts x 4 answers, 1 step each:

- ``log_prob_micro_larger``: update mini-batches of 8 responses in micro-batches of 8, and an old-log-prob pass in
  micro-batches of 16 (larger than a mini-batch: valid in verl, which applies it to the whole batch): ``gmts``;
- ``two_epochs``: two PPO epochs over two mini-batches: ``gmts`` (its pre-pass runs at every mini-batch);
- ``dynamic_bsz``: dynamic batch size with token limits smaller than a mini-batch: ``forking_paper`` (driver mask),
  ``gmts``.

Each run must exit 0 and log its selection at the preset's ratio (the pre-pass's or the driver's own metrics).
slow: seven real pipeline runs, ~2 min each on 2 cores (over the CI budget); the engine-level twin of the first case
(``tests/test_prepass_reuse_on_cpu.py``) runs in the default suite. Run: ``python -m pytest
tests/test_pipeline_parity_on_cpu.py -m slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
from verl_tokensel_cpu.launch import run_main_ppo
from helpers.pipeline import prepare_tiny_run, with_overrides

pytestmark = [pytest.mark.requires("verl", "ray", "vllm", "transfer_queue"), pytest.mark.slow]
RUN_TIMEOUT_S = 900
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
SMALL_MINI = [f"{A}.ppo_mini_batch_size=2", f"{A}.ppo_micro_batch_size_per_gpu=8", f"{A}.use_dynamic_bsz=False"]
SETTINGS = {
    "log_prob_micro_larger": [*SMALL_MINI, f"{R}.log_prob_micro_batch_size_per_gpu=16"],
    "two_epochs": [*SMALL_MINI, f"{A}.ppo_epochs=2"],
    "dynamic_bsz": [f"{A}.ppo_mini_batch_size=2", f"{A}.use_dynamic_bsz=True", f"{A}.ppo_max_token_len_per_gpu=160",
                    f"{R}.log_prob_use_dynamic_bsz=True", f"{R}.log_prob_max_token_len_per_gpu=160"],
}
CASES = [("log_prob_micro_larger", "gmts"), ("two_epochs", "gmts"), ("dynamic_bsz", "forking_paper"),
         ("dynamic_bsz", "gmts")]
#: where each preset logs its selection (exact over its scope: the pre-pass over the mini-batch's prompt groups,
#: the driver over the whole batch)
FRACTION = {"gmts": "actor/tokensel/prepass/selected_fraction", "forking_paper": "tokensel/driver_selected_fraction"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("parity_model") / "tiny"))


def _run(model_dir: Path, work: Path, setting: str, preset: str):
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector=preset, use_v1=True, steps=1)
    return run_main_ppo(with_overrides(overrides, SETTINGS[setting]), timeout_s=RUN_TIMEOUT_S,
                        log_path=work / "main_ppo.log")


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_stock_verl_runs_the_setting(setting, model_dir, tmp_path):
    result = _run(model_dir, tmp_path, setting, "none")
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1], result.describe()


@pytest.mark.parametrize("setting,preset", CASES)
def test_the_preset_runs_what_stock_runs(setting, preset, model_dir, tmp_path):
    result = _run(model_dir, tmp_path, setting, preset)
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1], result.describe()
    (step,) = result.steps
    fractions = step[FRACTION[preset]]
    for f in fractions if isinstance(fractions, list) else [fractions]:
        assert 0.2 <= f < 0.3, step  # ceil(0.2 n) of each pool: at the ratio, above it by less than one token a pool
    assert step["actor/pg_loss"] == step["actor/pg_loss"], step
