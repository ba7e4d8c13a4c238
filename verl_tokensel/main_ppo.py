"""``python -m verl_tokensel.main_ppo``: verl's PPO entry point with the token-selection config.

A thin wrapper over verl's own ``run_ppo``: same Hydra CLI (``--cfg job`` prints the composed
config), config ``tokensel_trainer`` (or ``--config-name=tokensel_megatron_trainer``), and both
drivers: ``trainer.use_v1=true`` runs verl's TaskRunnerV1 with the ``tokensel_sync`` trainer;
``trainer.use_v1=false`` runs verl's v0 TaskRunner with the checkpoint-engine manager that
installs the selecting loss (see :mod:`verl_tokensel.verl_glue.install`) and verl's ``RayPPOTrainer``
subclassed for ``score_source=rollout`` (see :mod:`verl_tokensel.verl_glue.rollout_source`).

CPU: ``trainer.device=cpu`` runs the whole pipeline (Ray, vLLM-CPU rollout, FSDP2 update) on CPU;
it fills every CPU setting and refuses conflicting ones (:mod:`verl_tokensel.verl_glue.cpu_pipeline`).
Unattended runs: :func:`verl_tokensel.launch.run_main_ppo` (outer timeout, metrics).

Example::

    python -m verl_tokensel.main_ppo actor_rollout_ref.actor.token_selector=gmts \\
        data.train_files=$DATA/train.parquet actor_rollout_ref.model.path=$MODEL ...
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a known-broken stack gets one line naming the fix, before verl's imports crash on it
    from verl_tokensel.stack import exit_if_broken

    exit_if_broken(cpu_rollout="trainer.device=cpu" in sys.argv[1:])

import hydra  # noqa: E402
import ray  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

from verl_tokensel.verl_glue.cpu_pipeline import apply_cpu_pipeline, wants_cpu  # noqa: E402
from verl_tokensel.verl_glue.install import (  # noqa: E402
    CHECKPOINT_MANAGER_FQN,
    TokenselCheckpointEngineManager,
    prepare_driver_config,
    register_v1_trainers,
    validate_driver_config,
)
from verl_tokensel.verl_glue.rollout_source import tokensel_ray_ppo_trainer_class  # noqa: E402


def _v0_task_runner():
    from verl.trainer.main_ppo_v0 import TaskRunner

    base = getattr(TaskRunner, "__ray_actor_class__", TaskRunner)

    class TokenselTaskRunner(base):
        """verl's v0 TaskRunner; routes the checkpoint-engine manager through ours and, for
        score_source=prepass, builds the actor workers with the pre-pass (verl_glue.prepass)."""

        def add_actor_rollout_worker(self, config):
            from verl_tokensel.verl_glue.prepass import (
                selection_uses_prepass,
                tokensel_worker_class,
                use_prepass_workers,
            )

            actor_rollout_cls, group_cls = super().add_actor_rollout_worker(config)
            if not selection_uses_prepass(config):
                return actor_rollout_cls, group_cls
            use_prepass_workers(self.role_worker_mapping)
            return tokensel_worker_class(actor_rollout_cls), group_cls

        def run(self, config):
            current = config.actor_rollout_ref.rollout.get("checkpoint_manager_class")
            if current and current != CHECKPOINT_MANAGER_FQN:
                raise ValueError(
                    f"actor_rollout_ref.rollout.checkpoint_manager_class={current!r} is set, but the v0 driver "
                    f"needs {CHECKPOINT_MANAGER_FQN} to install the selecting loss. Fix: unset it or use "
                    "trainer.use_v1=true."
                )
            with open_dict(config):
                config.actor_rollout_ref.rollout.checkpoint_manager_class = CHECKPOINT_MANAGER_FQN
            prepare_driver_config(config)
            TokenselCheckpointEngineManager.driver_config = config
            # score_source=rollout selects on the driver before each actor update, in our RayPPOTrainer
            # subclass. verl's run() builds the trainer by the global name RayPPOTrainer. Ray ships this class
            # and its base by value (verl's module attribute TaskRunner is the Ray actor wrapper, not the
            # class), so that run() reads a private copy of its globals: patch the dict of the function
            # that actually runs, in this TaskRunner process (the module attribute would not reach it).
            super().run.__func__.__globals__["RayPPOTrainer"] = tokensel_ray_ppo_trainer_class()
            return super().run(config)

    return ray.remote(TokenselTaskRunner)


def run(config: DictConfig) -> None:
    """Validate on the driver, then hand over to verl's ``run_ppo``."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    if wants_cpu(config):  # the one CPU switch, trainer.device=cpu: fill CPU settings before Ray starts
        apply_cpu_pipeline(config)
    register_v1_trainers()
    validate_driver_config(config)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.trainer.use_v1:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        run_ppo(config, task_runner_class=_v0_task_runner())


@hydra.main(config_path="config", config_name="tokensel_trainer", version_base=None)
def main(config: DictConfig) -> None:
    run(config)


if __name__ == "__main__":
    main()
