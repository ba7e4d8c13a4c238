"""Where ``score_source=rollout`` enters verl's drivers (no Ray, no worker).

- V1: every ``tokensel_<mode>`` trainer resolves ``_update_actor`` and ``_compute_old_log_prob`` to the
  mixin's (before verl's, separate-async's own ``_compute_old_log_prob`` included); the old-log-prob pass
  gets ``calculate_sum_pi_squared`` only for a score that reads sum p^2 and only for that pass; with
  another score source ``_update_actor`` hands verl the batch untouched.
- v0: ``python -m verl_tokensel.main_ppo``'s TaskRunner builds ``RayPPOTrainer`` as our subclass, whose
  ``_compute_old_log_prob`` keeps a copy of the entropy that verl's ``fit`` pops.
"""

from __future__ import annotations


import pytest

import torch
from hydra import compose, initialize_config_module
from transfer_queue import KVBatchMeta

from verl_tokensel.verl_glue import install
from verl_tokensel.verl_glue import v0 as glue_v0

pytestmark = pytest.mark.requires("verl")

SEL = "actor_rollout_ref.actor.token_selector"
KNOB = "actor_rollout_ref.actor.token_selection."


def _compose(*overrides):
    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose("tokensel_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                                      *overrides])


@pytest.mark.parametrize("mode", install.BASE_TRAINER_MODES)
def test_v1_trainers_route_through_the_mixin(mode):
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    install.register_v1_trainers()
    cls = TRAINER_REGISTRY[install.TRAINER_MODE_PREFIX + mode]
    assert cls._update_actor is install._TokenselTrainerMixin._update_actor
    assert cls._compute_old_log_prob is install._TokenselTrainerMixin._compute_old_log_prob


class _FakeV1Base:
    """Stands in for verl's PPOTrainer: records what each pass is asked for."""

    def _compute_old_log_prob(self, batch, metrics):
        self.seen_old = dict(batch.extra_info)
        return KVBatchMeta(keys=batch.keys, tags=batch.tags, partition_id=batch.partition_id,
                           extra_info=dict(batch.extra_info))

    def _update_actor(self, batch, metrics):
        self.seen_update = batch
        return batch


def _trainer(config):
    cls = type("T", (install._TokenselTrainerMixin, _FakeV1Base), {})
    t = cls.__new__(cls)
    t.config = config
    return t


@pytest.mark.parametrize("score,asks", [("grad_norm", True), ("entropy", False), ("gmts", False)])
def test_v1_old_pass_asks_for_sum_p2_only_when_read(score, asks):
    t = _trainer(_compose(f"{SEL}=forking_paper", f"{KNOB}score={score}"))
    batch = KVBatchMeta(keys=["a"], tags=[{}], partition_id="train", extra_info={"temperature": 1.0})
    out = t._compute_old_log_prob(batch, {})
    assert t.seen_old.get("calculate_sum_pi_squared", False) is asks
    assert "calculate_sum_pi_squared" not in batch.extra_info and "calculate_sum_pi_squared" not in out.extra_info
    assert batch.extra_info["temperature"] == 1.0


@pytest.mark.parametrize("selector", ["none", "forking", "gmts"])
def test_v1_update_untouched_without_rollout_source(selector):
    t = _trainer(_compose(f"{SEL}={selector}"))
    assert t.tokensel_driver is None
    batch = KVBatchMeta(keys=["a"], tags=[{}], partition_id="train", fields=["x"])
    assert t._update_actor(batch, {}) is batch and batch.fields == ["x"]
    t._compute_old_log_prob(batch, {})
    assert "calculate_sum_pi_squared" not in t.seen_old


class _Stop(Exception):
    pass


def test_v0_task_runner_builds_our_trainer():
    """Ray ships the TaskRunner class and verl's base by value: the base run() reads a private copy of its
    module globals, so only patching that copy (not the module attribute) reaches the trainer it builds."""
    import ray.cloudpickle as cloudpickle
    import verl.trainer.main_ppo_v0 as v0

    from verl_tokensel.verl_glue.v0 import v0_task_runner as _v0_task_runner

    cls = _v0_task_runner().__ray_actor_class__
    shipped = cloudpickle.loads(cloudpickle.dumps(cls))  # what the TaskRunner actor process holds
    base_run = shipped.__mro__[1].run
    assert base_run.__globals__ is not vars(v0)
    assert base_run.__globals__["RayPPOTrainer"] is v0.RayPPOTrainer

    def stop(self, config):  # verl's run() calls it first thing after our patch: end the run there
        raise _Stop

    shipped.add_actor_rollout_worker = stop
    with pytest.raises(_Stop):
        shipped.__new__(shipped).run(_compose(f"{SEL}=forking_paper", "trainer.use_v1=false"))
    assert base_run.__globals__["RayPPOTrainer"] is glue_v0.tokensel_ray_ppo_trainer_class()
    assert v0.RayPPOTrainer is not glue_v0.tokensel_ray_ppo_trainer_class()  # the driver's module is untouched


def test_v0_trainer_keeps_the_entropy_fit_pops(monkeypatch):
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    ent = torch.rand(2, 3)
    monkeypatch.setattr(RayPPOTrainer, "_compute_old_log_prob", lambda self, batch: (
        DataProto.from_dict({"old_log_probs": torch.zeros(2, 3), "entropys": ent.clone()}), 0.0))
    cls = glue_v0.tokensel_ray_ppo_trainer_class()
    t = cls.__new__(cls)
    t.tokensel_driver = object()
    old, _ = t._compute_old_log_prob(None)
    old.batch.pop("entropys")  # what fit() does after logging actor/entropy
    assert torch.equal(old.batch[glue_v0.V0_ENTROPY_FIELD], ent)
