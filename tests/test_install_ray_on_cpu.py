"""The selecting loss reaches verl's REAL actor workers through REAL Ray, on CPU (no verl object is faked).

One local Ray instance (logical ``num_gpus=1``: the CPU platform's Ray resource is "GPU"; the CPU platform's
env vars reach the workers through the job ``runtime_env``) and one actor worker group built as verl's V1
``PPOTrainer._setup`` builds it: ``ResourcePoolManager`` -> ``RayClassWithInitArgs(ray.remote(
ActorRolloutRefWorker), config=config.actor_rollout_ref, role="actor")`` -> ``create_colocated_worker_cls`` ->
``RayWorkerGroup`` -> ``spawn`` -> ``init_model()`` (FSDP2 engine on a tiny random Qwen2). The config is OUR
Hydra config ``verl_tokensel.config/tokensel_trainer`` with ``token_selector=forking``.

A. Before anything installs our loss, ``update_actor`` (verl's stock ``partial(ppo_loss, ...)``) fails with the
   StockLossGuard error naming ``verl_tokensel.main_ppo``: a selector never silently trains on all tokens.
B. ``install_actor_loss(wg, config)`` (what both tokensel drivers call) -> ``update_actor`` succeeds and logs
   ``tokensel/selected_fraction`` ~ 0.2.
C. v0 driver: the stock loss is put back (guard fires again), then verl's own construction code
   (``load_class_from_fqn(rollout.checkpoint_manager_class)`` as ``RayPPOTrainer`` does) builds
   ``TokenselCheckpointEngineManager`` with the driver config set as ``main_ppo``'s v0 TaskRunner sets it:
   the loss is installed (v0-format batch).
D. V1 driver: ``get_trainer_cls("tokensel_sync")`` is constructed on the composed config (restores
   ``trainer_mode="sync"``, turns ``calculate_entropy`` on for forking, builds verl's sync ReplayBuffer);
   its ``on_init_end`` installs the loss on the real worker group before verl's base ``on_init_end`` runs.
   The base then calls ``checkpoint_manager.update_weights`` (a real ``CheckpointEngineManager``, backend
   naive, as ``_setup`` builds it), which needs a rollout engine in the worker (vLLM): that call is expected
   to fail here (role "actor" has none) and the test checks exactly that error.
"""

from __future__ import annotations

import time

import pytest

from helpers import ray_actor as RA  # selects the CPU platform
from verl_tokensel_cpu import tiny_model

import ray
from omegaconf import open_dict

from verl_tokensel.verl_glue import install
from verl_tokensel.verl_glue.install import (
    install_actor_loss,
    prepare_driver_config,
    register_v1_trainers,
)
from verl_tokensel.verl_glue.v0 import CHECKPOINT_MANAGER_FQN, TokenselCheckpointEngineManager

pytestmark = pytest.mark.requires("verl", "ray", "tensordict", "transformers", "tokenizers")

SELECTOR = "forking"
RATIO = 0.2  # forking preset: top-20% entropy tokens per micro-batch pool (ceil)
N = 8  # one mini-batch of 8 responses -> 2 micro-batches of 4
ACTOR_KW = dict(ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=4, ppo_max_token_len_per_gpu=64)
OVERRIDES = [f"actor_rollout_ref.actor.token_selector={SELECTOR}"]
GUARD_HINT = "verl_tokensel.main_ppo"
TIMEOUT = pytest.mark.timeout(240, method="signal")
TIMINGS: dict[str, float] = {}


def _compose():
    model_dir = tiny_model.build_tiny_model_dir()
    return RA.compose_tokensel_config(model_dir, OVERRIDES, **ACTOR_KW)


@pytest.fixture(scope="module")
def cluster():
    """(driver config, actor worker group) on a NEW local Ray instance; ``ray.shutdown()`` at the end."""
    t0 = time.time()
    config = _compose()
    assert config.actor_rollout_ref.actor.calculate_entropy is False
    prepare_driver_config(config)  # what both tokensel drivers do before building workers
    assert config.actor_rollout_ref.actor.calculate_entropy is True, "forking needs entropy in the update pass"
    TIMINGS["compose"] = time.time() - t0
    with RA.local_ray(config, num_cpus=4, num_gpus=1):
        TIMINGS["ray_init"] = time.time() - t0 - TIMINGS["compose"]
        t1 = time.time()
        wg = RA.build_actor_worker_group(config, role="actor")
        TIMINGS["worker_group_init_model"] = time.time() - t1
        assert wg.world_size == 1
        yield config, wg
    assert not ray.is_initialized()
    print("\ntimings (s):", {k: round(v, 1) for k, v in TIMINGS.items()})


def _update(wg, config, seed: int, fmt: str = "v1") -> dict:
    t0 = time.time()
    out = wg.update_actor(RA.make_driver_batch(config, n=N, seed=seed, fmt=fmt))
    TIMINGS[f"update_actor seed={seed}"] = time.time() - t0
    return RA.metrics_of(out)


def _assert_guard_fires(wg, config, seed: int, fmt: str = "v1") -> None:
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        _update(wg, config, seed=seed, fmt=fmt)
    assert isinstance(err.value.as_instanceof_cause(), RuntimeError), err.value
    msg = str(err.value)
    assert GUARD_HINT in msg and f"token_selector={SELECTOR}" in msg and "stock ppo_loss" in msg, msg


def _assert_selecting_loss_ran(metrics: dict) -> None:
    frac = RA.metric_values(metrics, "tokensel/selected_fraction")
    assert frac and all(RATIO <= f < 0.35 for f in frac), frac
    selected = sum(RA.metric_values(metrics, "tokensel/selected_tokens"))
    valid = sum(RA.metric_values(metrics, "tokensel/valid_tokens"))
    assert 0 < selected < valid, (selected, valid)
    loss = RA.metric_values(metrics, "loss")
    assert loss and all(abs(v) < 1e6 for v in loss), loss  # finite
    assert "actor/pg_loss" in metrics


@TIMEOUT
def test_a_stock_loss_refuses_to_train_with_a_selector(cluster):
    config, wg = cluster
    _assert_guard_fires(wg, config, seed=0)


@TIMEOUT
def test_b_install_actor_loss_over_ray(cluster):
    config, wg = cluster
    install_actor_loss(wg, config)
    _assert_selecting_loss_ran(_update(wg, config, seed=1))


@TIMEOUT
def test_c_v0_checkpoint_manager_installs_the_loss(cluster, monkeypatch):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    config, wg = cluster
    wg.set_loss_fn(RA.stock_actor_loss(config))  # what init_model binds
    _assert_guard_fires(wg, config, seed=2, fmt="v0")

    # without the trainer config the manager refuses (before touching the workers)
    monkeypatch.setattr(TokenselCheckpointEngineManager, "driver_config", None)
    ce_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    with pytest.raises(RuntimeError, match="verl_tokensel.main_ppo"):
        TokenselCheckpointEngineManager(config=ce_config, actor_wg=wg, replicas=[])
    _assert_guard_fires(wg, config, seed=3, fmt="v0")

    # main_ppo's v0 TaskRunner.run: route the manager class, set the driver config
    with open_dict(config):
        config.actor_rollout_ref.rollout.checkpoint_manager_class = CHECKPOINT_MANAGER_FQN
    monkeypatch.setattr(TokenselCheckpointEngineManager, "driver_config", config)
    # RayPPOTrainer.init_workers (verl/trainer/ppo/ray_trainer.py), replicas from an LLMServerManager -> none here
    manager_cls = load_class_from_fqn(config.actor_rollout_ref.rollout.checkpoint_manager_class,
                                      "CheckpointEngineManager")
    assert manager_cls is TokenselCheckpointEngineManager
    manager = manager_cls(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
        actor_wg=wg,
        replicas=[],
    )
    manager.sleep_replicas()  # what RayPPOTrainer does next (no replicas: a no-op)
    _assert_selecting_loss_ran(_update(wg, config, seed=4, fmt="v0"))


@TIMEOUT
def test_d_v1_tokensel_sync_trainer_installs_the_loss(cluster):
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.config import omega_conf_to_dataclass

    _, wg = cluster
    register_v1_trainers()  # main_ppo.run does it on the V1 path; the verl.plugins entry point does too
    trainer_cls = get_trainer_cls("tokensel_sync")
    assert issubclass(trainer_cls, PPOTrainerSync) and trainer_cls.__module__ == install.__name__

    config = _compose()  # fresh: as the driver hands it to the trainer
    assert config.trainer.v1.trainer_mode == "tokensel_sync"
    assert config.actor_rollout_ref.actor.calculate_entropy is False
    trainer = trainer_cls(config)
    assert trainer.config.trainer.v1.trainer_mode == "sync"
    assert trainer.trainer_mode == "sync"  # what verl branches on
    assert type(trainer.replay_buffer) is ReplayBuffer and not isinstance(trainer.replay_buffer, ReplayBufferAsync)
    assert trainer.config.actor_rollout_ref.actor.calculate_entropy is True

    # PPOTrainer._setup steps 6 and 10, with the worker group built above and no rollout replicas
    wg.set_loss_fn(RA.stock_actor_loss(trainer.config))
    _assert_guard_fires(wg, trainer.config, seed=5)
    trainer.actor_rollout_wg = wg
    ce_config = omega_conf_to_dataclass(trainer.config.actor_rollout_ref.rollout.checkpoint_engine)
    ce_config.backend = "naive"
    trainer.checkpoint_manager = CheckpointEngineManager(config=ce_config, actor_wg=wg, replicas=[])
    trainer.global_steps = 0  # _load_checkpoint sets it

    # Our on_init_end installs the loss, then verl's PPOTrainerSync.on_init_end syncs weights to the rollout
    # engine, which an "actor"-only worker does not have (a rollout would need vLLM): that base call fails
    # inside the worker's update_weights, after our install.
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        trainer.on_init_end()
    # ActorRolloutRefWorker.update_weights (mode naive): `self.rollout.resume(...)` with self.rollout None
    assert isinstance(err.value.as_instanceof_cause(), AttributeError), err.value
    assert "in update_weights" in str(err.value) and GUARD_HINT not in str(err.value), err.value
    _assert_selecting_loss_ran(_update(wg, trainer.config, seed=6))
