"""How ``score_source=prepass`` reaches verl's actor workers (no Ray actor started here; see
``test_prepass_ray_on_cpu.py`` for the real thing):

- :func:`tokensel_worker_class` subclasses whatever actor worker class it is given (verl's
  ``ActorRolloutRefWorker``, the separate-async trainer's ``DetachActorWorker``, a Ray actor class, a class
  whose inner ``actor_worker_cls`` is itself custom) and changes only ``actor_worker_cls``;
- the V1 trainers' ``_init_resource_pool_mgr`` (all three tokensel modes, hybrid replicas on and off) and
  the v0 TaskRunner's ``add_actor_rollout_worker`` put that class in ``role_worker_mapping`` exactly when
  the selection uses the pre-pass, after verl's own (or separate-async's) choice;
- Megatron with ``score_source=prepass`` composes and gets the pre-pass workers; group ids from ``uid`` are stable.
"""

from __future__ import annotations


import pytest

from helpers import ray_actor as RA  # selects the CPU platform
from verl_tokensel_cpu import tiny_model

import torch
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.trainer.ppo.utils import Role
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from verl_tokensel.core.ranking.batch import group_ids as stable_group_ids
from verl_tokensel.verl_glue.micro_batch import batch_uids
from verl_tokensel.verl_glue.workers import TokenselTrainingWorker, tokensel_worker_class

pytestmark = pytest.mark.requires("verl")


def batch_group_ids(td):
    """The group ids the pre-pass ranks a mini-batch's ``scope=group`` by."""
    return stable_group_ids(batch_uids(td))


def _compose(selector="gmts", *overrides):
    return RA.compose_tokensel_config(str(tiny_model.build_tiny_model_dir()),
                                      [f"actor_rollout_ref.actor.token_selector={selector}", *overrides])


def _base(remote_cls):
    return getattr(remote_cls, "__ray_actor_class__", remote_cls)


@pytest.mark.parametrize("base", [ActorRolloutRefWorker, DetachActorWorker])
def test_worker_class_only_swaps_the_inner_training_worker(base):
    import ray

    cls = tokensel_worker_class(base)
    assert cls.__bases__ == (base,) and cls.actor_worker_cls is TokenselTrainingWorker
    assert tokensel_worker_class(base) is cls and tokensel_worker_class(cls) is cls
    assert tokensel_worker_class(ray.remote(base)) is cls  # Ray actor classes are unwrapped
    # every RPC (registered method) is the base's own
    for name in ("init_model", "update_actor", "compute_log_prob", "set_loss_fn"):
        assert getattr(cls, name) is getattr(base, name)


def test_worker_class_keeps_a_custom_inner_training_worker():
    class MyTrainingWorker(TrainingWorker):
        pass

    class MyActorWorker(ActorRolloutRefWorker):
        actor_worker_cls = MyTrainingWorker

    inner = tokensel_worker_class(MyActorWorker).actor_worker_cls
    assert issubclass(inner, TokenselTrainingWorker) and issubclass(inner, MyTrainingWorker)


@pytest.mark.parametrize("mode,hybrid,role,base", [
    ("sync", True, Role.ActorRollout, ActorRolloutRefWorker),
    ("colocate_async", True, Role.ActorRollout, ActorRolloutRefWorker),
    ("separate_async", True, Role.ActorRollout, DetachActorWorker),
    ("separate_async", False, Role.Actor, DetachActorWorker),
])
@pytest.mark.parametrize("selector", ["gmts", "forking", "none"])
def test_v1_trainers_swap_the_actor_worker_for_selectors_only(mode, hybrid, role, base, selector):
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from verl_tokensel.verl_glue.install import register_v1_trainers

    register_v1_trainers()
    trainer_cls = TRAINER_REGISTRY[f"tokensel_{mode}"]
    trainer = trainer_cls.__new__(trainer_cls)  # only the resource-pool step of _setup
    trainer.config = _compose(selector)
    trainer._enable_hybrid_replicas = hybrid
    trainer._init_resource_pool_mgr()
    cls = _base(trainer.role_worker_mapping[role])
    if selector != "none":  # the pre-pass (gmts) and the no-graph entropy (every selector) live in the worker
        assert cls is tokensel_worker_class(base) and cls.__bases__ == (base,)
    else:  # stock: verl's (or separate-async's) class, untouched
        assert cls is base


@pytest.mark.parametrize("selector", ["gmts", "forking", "none"])
def test_v0_task_runner_builds_the_tokensel_worker_for_selectors(selector):
    from verl_tokensel.verl_glue.v0 import v0_task_runner as _v0_task_runner

    runner_cls = _base(_v0_task_runner())
    runner = runner_cls.__new__(runner_cls)
    runner.role_worker_mapping, runner.mapping = {}, {}
    actor_cls, _ = runner.add_actor_rollout_worker(_compose(selector))
    (remote_cls,) = runner.role_worker_mapping.values()
    expected = tokensel_worker_class(ActorRolloutRefWorker) if selector != "none" else ActorRolloutRefWorker
    assert actor_cls is expected and _base(remote_cls) is expected


def test_megatron_takes_the_prepass_on_the_driver():
    """``gmts`` (pre-pass) composes on Megatron and its actor workers are the pre-pass twins, as on FSDP (the
    pre-pass itself through the real Megatron engine: ``test_megatron_engine_on_cpu.py``)."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass

    from verl_tokensel.verl_glue.actor_config import TokenselMcoreActorConfig
    from verl_tokensel.verl_glue.workers import selection_uses_tokensel_workers

    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_megatron_trainer",
                      overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                 "actor_rollout_ref.actor.token_selector=gmts"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor) is TokenselMcoreActorConfig and actor.selection.score_source == "prepass"
    assert selection_uses_tokensel_workers(cfg)
    assert tokensel_worker_class(ActorRolloutRefWorker).actor_worker_cls is TokenselTrainingWorker


def test_group_ids_are_stable_and_shared_by_equal_uids():
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    ids = stable_group_ids(["a", "b", "a", "7d9c-uuid"])
    assert ids.dtype == torch.int64 and ids[0] == ids[2] and len(set(ids.tolist())) == 3
    # the same in every process and run (no salted hash): a fixed value
    assert stable_group_ids(["a"]).item() == int.from_bytes(
        __import__("hashlib").blake2b(b"a", digest_size=8).digest(), "little", signed=True)
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    td["uid"] = NonTensorStack(*[NonTensorData(u) for u in ["p", "q", "p"]])
    assert torch.equal(batch_group_ids(td), stable_group_ids(["p", "q", "p"]))
    with pytest.raises(RuntimeError, match="scope=group needs the 'uid'"):
        batch_group_ids(TensorDict({"x": torch.zeros(3)}, batch_size=[3]))


def test_install_prepass_puts_each_step_once_and_counts_the_weight_versions():
    """The composite install (what every tokensel actor worker runs): each step wraps its methods once, however often
    it is called; with a stock loss every call reaches verl's method; the weight versions rise on each update (a
    failed one too) and checkpoint load, and the old pass is current only after an ``infer_batch`` with the adapter."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_tokensel.verl_glue.prepass import install_prepass
    from verl_tokensel.verl_glue.weight_versions import old_pass_is_current

    calls = []

    class Worker:  # verl's TrainingWorker's methods the steps wrap, with a stock loss
        loss_fn = staticmethod(lambda *a: None)
        engine = None

        def train_batch(self, data):
            calls.append("train_batch")
            if tu.get_non_tensor_data(data=data, key="fail", default=False):
                raise RuntimeError("update failed")
            return None

        def train_mini_batch(self, data):
            calls.append("train_mini_batch")

        def infer_batch(self, data):
            calls.append("infer_batch")

        def load_checkpoint(self, *args):
            calls.append("load_checkpoint")

    worker = Worker()
    install_prepass(worker)
    wrapped = (worker.train_batch, worker.train_mini_batch, worker.infer_batch, worker.load_checkpoint)
    assert install_prepass(worker) is worker
    assert (worker.train_batch, worker.train_mini_batch, worker.infer_batch, worker.load_checkpoint) == wrapped

    data = TensorDict({}, batch_size=[])
    assert not old_pass_is_current(worker)
    worker.infer_batch(data)
    assert old_pass_is_current(worker)
    worker.train_mini_batch(data)
    worker.train_batch(data)
    assert not old_pass_is_current(worker)
    worker.infer_batch(data)
    assert old_pass_is_current(worker)
    failing = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(failing, fail=True)
    with pytest.raises(RuntimeError, match="update failed"):
        worker.train_batch(failing)
    assert not old_pass_is_current(worker)
    worker.infer_batch(data)
    worker.load_checkpoint("path")
    assert not old_pass_is_current(worker)
    no_adapter = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(no_adapter, no_lora_adapter=True)
    worker.infer_batch(no_adapter)  # verl's reference pass on the actor: not the policy's weights
    assert not old_pass_is_current(worker)
    assert calls == ["infer_batch", "train_mini_batch", "train_batch", "infer_batch", "train_batch", "infer_batch",
                     "load_checkpoint", "infer_batch"]
