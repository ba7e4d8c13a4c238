"""Every refusal of the verl glue is a config error: a :class:`TokenSelectionConfigError` whose message starts with
the key spelt in full from the config's root, then its value, the valid values and the fix (what
``python -m verl_tokensel.main_ppo`` prints as one line, exit 2, instead of a traceback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_module

from verl_tokensel.core.errors import TokenSelectionConfigError
from verl_tokensel.verl_glue import rollout_source
from verl_tokensel.verl_glue.errors import config_error_at
from verl_tokensel.verl_glue.install import V0_CHECKPOINT_MANAGER, validate_driver_config

SEL = "actor_rollout_ref.actor.token_selector"
KNOB = "actor_rollout_ref.actor.token_selection."
FUSED = "actor_rollout_ref.model.use_fused_kernels"
BYPASS = "algorithm.rollout_correction.bypass_mode"


def _compose(overrides):
    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose("tokensel_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                                      *overrides])


def _driver(*overrides):
    return lambda: validate_driver_config(_compose(overrides))


def _no_driver_fields(monkeypatch):
    monkeypatch.setattr(rollout_source, "DRIVER_EXTERNAL_FIELDS", ())
    return _driver(f"{SEL}=forking_paper", f"{KNOB}score=ref_entropy", f"{KNOB}ref_model_path=/m",
                   f"{KNOB}scope=group")()


def _capture_without_output_layer_call(_):
    from verl_tokensel.verl_glue.hidden import _Capture

    capture = object.__new__(_Capture)  # what the hooks saw: nothing (fused kernels bypass lm_head)
    capture.value, capture.call = None, {}
    capture.take()


def _hidden_passes_with_dynamic_cp(_):
    from verl_tokensel.verl_glue.hidden import hidden_sweeps

    engine = type("Engine", (), {"__module__": "verl.workers.engine.megatron.transformer_impl"})()
    engine.engine_config = SimpleNamespace(dynamic_context_parallel=True)
    hidden_sweeps(SimpleNamespace(engine=engine), None, SimpleNamespace(selection=SimpleNamespace(rule="delta")), None)


def _token_selection_not_a_mapping(_):
    from verl_tokensel.verl_glue.actor_config import _coerce_overrides

    _coerce_overrides(3)


def _unsupported_engine(_):
    from verl_tokensel.verl_glue.actor_config import torchtitan_actor_config

    torchtitan_actor_config()


def _v0_runner_with_another_manager(_):
    from verl_tokensel.verl_glue.v0 import v0_task_runner

    cfg = _compose([f"{SEL}=gmts", "trainer.use_v1=false", "+actor_rollout_ref.rollout.checkpoint_manager_class=m.M"])
    v0_task_runner().__ray_actor_class__.run(None, cfg)


#: (case, the key its error names, what raises it)
REFUSALS = [
    ("trainer_mode", "trainer.v1.trainer_mode", lambda _: _driver(f"{SEL}=forking", "trainer.v1.trainer_mode=sync")()),
    ("fused_hidden_states", FUSED, lambda _: _driver(f"{SEL}=delta", f"{FUSED}=true")()),
    ("fused_prepass_sum_pi_squared", FUSED,
     lambda _: _driver(f"{SEL}=grad_norm", f"{FUSED}=true", f"{KNOB}scope=group", f"{KNOB}score_source=prepass")()),
    ("fused_rollout_sum_pi_squared", FUSED,
     lambda _: _driver(f"{SEL}=forking_paper", f"{KNOB}score=grad_norm", f"{FUSED}=true")()),
    ("calculate_log_probs", "actor_rollout_ref.rollout.calculate_log_probs",
     lambda _: _driver(f"{SEL}=m2po_global", "actor_rollout_ref.rollout.calculate_log_probs=false")()),
    ("bypass_rollout_log_probs", BYPASS, lambda _: _driver(f"{SEL}=m2po_global", f"{BYPASS}=true")()),
    ("bypass_rollout_entropy", BYPASS, lambda _: _driver(f"{SEL}=forking_paper", f"{BYPASS}=true")()),
    ("v0_checkpoint_manager", "actor_rollout_ref.rollout.checkpoint_manager_class",
     lambda _: _driver(f"{SEL}=gmts", "trainer.use_v1=false",
                       "+actor_rollout_ref.rollout.checkpoint_manager_class=m.M")()),
    ("v0_checkpoint_manager_in_the_runner", "actor_rollout_ref.rollout.checkpoint_manager_class",
     _v0_runner_with_another_manager),
    ("driver_cannot_fill_the_field", "actor_rollout_ref.actor.token_selection.score", _no_driver_fields),
    ("worker_fused_hidden_states", FUSED, _capture_without_output_layer_call),
    ("worker_dynamic_context_parallel", "actor_rollout_ref.actor.megatron.dynamic_context_parallel",
     _hidden_passes_with_dynamic_cp),
    ("token_selection_not_a_mapping", "actor_rollout_ref.actor.token_selection", _token_selection_not_a_mapping),
    ("model_engine", "model_engine", _unsupported_engine),
]


@pytest.mark.parametrize("case,key,refuse", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_refusal_is_a_config_error_naming_the_key(case, key, refuse, monkeypatch):
    with pytest.raises(TokenSelectionConfigError) as exc:
        refuse(monkeypatch)
    msg = str(exc.value)
    assert msg.startswith(f"{key}="), msg
    assert "is invalid" in msg and "valid values: " in msg and "Fix: " in msg, msg


def test_the_bypass_refusal_is_one_message_naming_what_the_selection_reads():
    """Both selections that read verl's old-log-prob pass get the one check's message; one that reads neither
    (score random, no entropy) runs in bypass mode."""
    lines = []
    for preset, reads in (("m2po_global", "old_log_probs beside rollout_log_probs"),
                          ("forking_paper", "the old-policy entropy")):
        with pytest.raises(TokenSelectionConfigError) as exc:
            validate_driver_config(_compose([f"{SEL}={preset}", f"{BYPASS}=true"]))
        assert reads in str(exc.value)
        lines.append(str(exc.value).split(" reads from that pass ")[0])
    assert lines[0] == lines[1].replace("forking_paper", "m2po_global")
    validate_driver_config(_compose([f"{SEL}=forking_paper", f"{KNOB}score=random", f"{BYPASS}=true"]))


def test_a_key_outside_the_actor_node_is_named_from_the_root():
    err = config_error_at("trainer.v1.trainer_mode", "tokensel_synk", "tokensel_sync, tokensel_colocate_async")
    assert str(err) == ("trainer.v1.trainer_mode='tokensel_synk' is invalid (did you mean tokensel_sync?); valid "
                        "values: tokensel_sync, tokensel_colocate_async.")
    assert str(config_error_at("actor_rollout_ref.actor.token_selector", "x", "gmts")).startswith(
        "actor_rollout_ref.actor.token_selector='x' is invalid")


def test_the_v0_checkpoint_manager_is_the_v0_drivers_class():
    from verl.utils.import_utils import load_class_from_fqn

    from verl_tokensel.verl_glue.v0 import CHECKPOINT_MANAGER_FQN, TokenselCheckpointEngineManager

    assert CHECKPOINT_MANAGER_FQN == V0_CHECKPOINT_MANAGER
    assert load_class_from_fqn(V0_CHECKPOINT_MANAGER, "CheckpointEngineManager") is TokenselCheckpointEngineManager
    validate_driver_config(_compose([f"{SEL}=gmts", "trainer.use_v1=false",
                                     f"+actor_rollout_ref.rollout.checkpoint_manager_class={V0_CHECKPOINT_MANAGER}"]))
