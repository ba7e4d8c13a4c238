"""The deprecated v0 driver (``trainer.use_v1=false``, verl's ``RayPPOTrainer``): all of its glue, fenced here.

v0 has no trainer registry and no ``on_init_end`` hook, so three hooks on seams verl exposes (no verl file edited),
used only by ``python -m verl_tokensel.main_ppo`` with ``trainer.use_v1=false``:

1. the loss: :class:`TokenselCheckpointEngineManager`, built by ``RayPPOTrainer.init_workers`` from
   ``actor_rollout_ref.rollout.checkpoint_manager_class`` right after the actor workers exist, calls ``set_loss_fn``;
2. the driver's selection (``score_source=rollout``): a ``RayPPOTrainer`` subclass
   (:func:`tokensel_ray_ppo_trainer_class`) keeps the old-policy entropy ``fit`` pops and adds the mask and scores
   to the ``DataProto`` in ``_update_actor`` (:func:`select_v0`), and for a rule with several update passes calls
   the update once per pass (:mod:`~verl_tokensel.core.resolve.update_passes`);
3. building that subclass: :func:`v0_task_runner` rebinds the global ``RayPPOTrainer`` in the globals of the
   TaskRunner's ``run`` inside the TaskRunner process (verl's module is untouched), and swaps in the pre-pass actor
   worker class for ``score_source=prepass``.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import ray
from omegaconf import DictConfig, open_dict

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.batch import row_keys
from verl_tokensel.verl_glue.install import (
    V0_CHECKPOINT_MANAGER,
    check_v0_checkpoint_manager,
    install_actor_loss,
    prepare_driver_config,
)
from verl_tokensel.verl_glue.rollout_source import DriverSelector, column_as_list

# the old-policy entropy kept past fit()'s pop of "entropys" (removed again before the update)
V0_ENTROPY_FIELD = "tokensel_old_entropy"


# ----------------------------------------------------------------------------- hook 1: the loss
def _checkpoint_manager_base():
    from verl.checkpoint_engine import CheckpointEngineManager

    return CheckpointEngineManager


class TokenselCheckpointEngineManager(_checkpoint_manager_base()):
    """verl's ``CheckpointEngineManager`` that first installs the selecting actor loss (v0 driver).

    ``driver_config`` is set by :func:`v0_task_runner`'s ``run`` in the TaskRunner process before verl's
    ``RayPPOTrainer`` builds this manager.
    """

    driver_config: DictConfig | None = None

    def __init__(self, config, actor_wg, replicas):
        super().__init__(config=config, actor_wg=actor_wg, replicas=replicas)
        if self.driver_config is None:
            raise RuntimeError(
                "TokenselCheckpointEngineManager was built without the trainer config; launch with "
                "`python -m verl_tokensel.main_ppo`, which sets it."
            )
        install_actor_loss(actor_wg, self.driver_config)


CHECKPOINT_MANAGER_FQN = V0_CHECKPOINT_MANAGER  # spelt in install.py, whose driver check names it


# ----------------------------------------------------------------------------- hook 2: the driver's selection
def select_v0(driver: DriverSelector, batch, metrics: Optional[dict] = None) -> dict[str, float]:
    """Add the padded mask and scores to a v0 update ``DataProto`` (in place); returns the metrics."""
    t0 = time.time()
    td = batch.batch
    padded = {k: td[k] for k in fields.DRIVER_INPUTS if k != fields.ENTROPY and k in td.keys()}
    if V0_ENTROPY_FIELD in td.keys():
        padded[fields.ENTROPY] = td.pop(V0_ENTROPY_FIELD)
    width = padded[fields.RESPONSE_MASK].shape[1]
    keys = row_keys(td["input_ids"], td["attention_mask"]) if driver.sel.needs_row_keys else None
    external = {}
    if "ref_entropy" in driver.sel.needs_external:
        resp_attn = td["attention_mask"][:, -width:].bool()
        prompt_attn = td["attention_mask"][:, : td["prompts"].shape[1]].bool()
        prompts = [td["prompts"][i][prompt_attn[i]] for i in range(len(batch))]
        responses = [td["responses"][i][resp_attn[i]] for i in range(len(batch))]
        external = driver.external_fields(prompts, responses, width)
    if driver.needs_responses:
        rewards = td[fields.TOKEN_LEVEL_REWARDS] if fields.TOKEN_LEVEL_REWARDS in td.keys() else None
        external.update(driver.response_fields(td[fields.RESPONSES][:, -width:], rewards, padded[fields.RESPONSE_MASK]))
    uids = (column_as_list(batch.non_tensor_batch[fields.UID]) if fields.UID in batch.non_tensor_batch
            else list(range(len(batch))))
    result = driver.select_rows(padded, uids, keys, None, external)
    td[fields.MASK] = result.mask
    td[fields.SCORE] = result.scores
    out = dict(result.metrics)
    out["timing_s/tokensel_driver_select"] = time.time() - t0
    if metrics is not None:
        metrics.update(out)
    return out


@functools.cache
def tokensel_ray_ppo_trainer_class():
    """verl's v0 ``RayPPOTrainer`` with the driver-side selection before each actor update."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    class TokenselRayPPOTrainer(RayPPOTrainer):
        """verl's ``RayPPOTrainer``; with ``score_source=rollout`` the driver selects before ``update_actor``."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.tokensel_driver = DriverSelector.from_config(self.config, trainer=self)
            from verl_tokensel.verl_glue.actor_config import actor_selection

            self.tokensel_selection = actor_selection(self.config)  # once: the steps never resolve it again

        def _compute_old_log_prob(self, batch):
            old_log_prob, mfu = super()._compute_old_log_prob(batch)
            if self.tokensel_driver is not None:
                # fit() pops "entropys" right after logging actor/entropy; keep a copy that follows the rows
                old_log_prob.batch[V0_ENTROPY_FIELD] = old_log_prob.batch["entropys"].clone()
            return old_log_prob, mfu

        def _update_actor(self, batch):
            from verl_tokensel.core.fields import UPDATE_PASS
            from verl_tokensel.core.resolve.update_passes import run_update_passes, several_passes

            metrics = select_v0(self.tokensel_driver, batch) if self.tokensel_driver is not None else {}
            sel = self.tokensel_selection
            if not several_passes(sel):
                output = super()._update_actor(batch)
            else:  # the rule's update passes: whole actor updates, the pass number reaching the loss
                outputs = []

                def update(n: int) -> dict:
                    batch.meta_info[UPDATE_PASS] = n
                    outputs.append(super(TokenselRayPPOTrainer, self)._update_actor(batch))
                    return outputs[-1].meta_info["metrics"]

                try:
                    merged = run_update_passes(sel, update)
                finally:
                    batch.meta_info.pop(UPDATE_PASS, None)
                output = outputs[-1]
                output.meta_info["metrics"] = merged
            output.meta_info["metrics"].update(metrics)
            return output

    return TokenselRayPPOTrainer


# ----------------------------------------------------------------------------- hook 3: the TaskRunner
def v0_task_runner():
    """verl's v0 ``TaskRunner`` as a Ray actor class, with hooks 1-3 wired in (see the module docstring)."""
    from verl.trainer.main_ppo_v0 import TaskRunner

    base = getattr(TaskRunner, "__ray_actor_class__", TaskRunner)

    class TokenselTaskRunner(base):
        """verl's v0 TaskRunner; routes the checkpoint-engine manager through ours and, with a selector on,
        builds the actor workers with the selection's worker-side steps (verl_glue.workers)."""

        def add_actor_rollout_worker(self, config):
            from verl_tokensel.verl_glue.workers import (
                selection_uses_tokensel_workers,
                tokensel_worker_class,
                use_tokensel_workers,
            )

            actor_rollout_cls, group_cls = super().add_actor_rollout_worker(config)
            if not selection_uses_tokensel_workers(config):
                return actor_rollout_cls, group_cls
            use_tokensel_workers(self.role_worker_mapping)
            return tokensel_worker_class(actor_rollout_cls), group_cls

        def run(self, config):
            check_v0_checkpoint_manager(config)  # the driver checked it too (validate_driver_config)
            with open_dict(config):
                config.actor_rollout_ref.rollout.checkpoint_manager_class = CHECKPOINT_MANAGER_FQN
            prepare_driver_config(config)
            TokenselCheckpointEngineManager.driver_config = config  # hook 1
            # hook 3: the globals dict of the run() that actually executes in this process (see the docstring)
            super().run.__func__.__globals__["RayPPOTrainer"] = tokensel_ray_ppo_trainer_class()
            return super().run(config)

    return ray.remote(TokenselTaskRunner)


__all__ = [
    "CHECKPOINT_MANAGER_FQN",
    "TokenselCheckpointEngineManager",
    "V0_ENTROPY_FIELD",
    "select_v0",
    "tokensel_ray_ppo_trainer_class",
    "v0_task_runner",
]
