"""``score_source=rollout`` in verl's WHOLE ``main_ppo`` pipeline on CPU (~4 min per run on 2 cores, ~6 GB).

Two GRPO steps on the tiny random Qwen2 through ``python -m verl_tokensel.main_ppo`` (launcher with an
outer timeout), one run per driver:

- V1 (TransferQueue), ``forking_paper``: top 20% old-policy entropy over the whole batch;
- v0 (``trainer.use_v1=false``), ``gmts`` with ``score_source=rollout, scope=group``: this is the run that
  showed the v0 seam must patch the globals of the TaskRunner that Ray ships by value.

Each step must log the driver's ``tokensel/driver_*`` metrics with the exact budget (``batch``:
``ceil(0.2 N)`` of the N response tokens), and the workers' loss must have applied exactly the driver's
selection (``actor/tokensel/selected_tokens`` summed over the step equals the driver's count; the loss
refuses to run without the mask field, so a missing field fails the run).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from verl_tokensel_cpu.launch import run_main_ppo
from helpers.pipeline import prepare_tiny_run
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

pytestmark = pytest.mark.requires("verl", "ray", "vllm", "transfer_queue")

STEPS = 2
KNOB = "actor_rollout_ref.actor.token_selection."
CASES = [
    ("v1-forking_paper", True, "forking_paper", []),
    ("v0-gmts-rollout-group", False, "gmts", [f"{KNOB}score_source=rollout", f"{KNOB}scope=group"]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("e2e_rollout_model") / "tiny"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,use_v1,preset,extra", CASES, ids=[c[0] for c in CASES])
def test_rollout_source_end_to_end(model_dir, tmp_path, name, use_v1, preset, extra):
    overrides = prepare_tiny_run(tmp_path, model_dir=model_dir, token_selector=preset, use_v1=use_v1, steps=STEPS)
    result = run_main_ppo(overrides + extra, timeout_s=800, log_path=tmp_path / "main_ppo.log")
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), result.describe()
    for s in result.steps:
        n_sel, n_valid = s["tokensel/driver_selected_tokens"], s["tokensel/driver_valid_tokens"]
        assert s["tokensel/driver_selected_fraction"] == pytest.approx(n_sel / n_valid)
        if preset == "forking_paper":
            assert n_sel == math.ceil(0.2 * n_valid), s
        else:  # ceil per prompt group: at least the batch budget, at most one extra token per group
            assert math.ceil(0.2 * n_valid) <= n_sel <= math.ceil(0.2 * n_valid) + 4, s
        # one update micro-batch per step here (4 prompts x 4 responses of <= 16 tokens)
        assert s["actor/tokensel/selected_tokens"] == n_sel and s["actor/tokensel/valid_tokens"] == n_valid, s
        assert s["training/rollout_probs_diff_max"] < 1e-4, s
