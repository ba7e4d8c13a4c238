"""The custom-score example registers a score and a preset that the config and the loss accept."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

ROOT = Path(__file__).resolve().parents[1]


def test_custom_score_example_selects_low_probability_tokens():
    spec = importlib.util.spec_from_file_location("example_custom_score", ROOT / "examples" / "custom_score.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["example_custom_score"] = mod

    from verl.utils.config import omega_conf_to_dataclass
    from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

    from helpers.loss_inputs import make_micro_batch

    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.token_selector=low_confidence"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.selection.score == "low_confidence"
    seen = {}
    model_output, data, lp = make_micro_batch(batch=4, seed=5)
    loss, metrics = tokensel_ppo_loss(actor, model_output, data, observer=seen.update)
    loss.backward()
    mask, valid, scores = seen["mask"], seen["response_mask"], seen["scores"]
    # the selected tokens are the lowest-probability ones: every kept score >= every dropped score
    assert scores[mask].min() >= scores[valid & ~mask].max()
    assert torch.isfinite(loss)
