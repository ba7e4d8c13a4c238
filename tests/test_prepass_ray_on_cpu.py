"""``score_source=prepass`` through REAL Ray: the worker class our trainers put in ``role_worker_mapping``.

One local Ray instance, one actor worker group built as verl's V1 ``PPOTrainer._setup`` builds it, but
with ``tokensel_worker_class(ActorRolloutRefWorker)`` (what the tokensel trainers map the actor role to
when the selection uses the pre-pass). Ray ships that class to the worker process; its ``init_model``
(verl's own) builds the actor's ``TrainingWorker`` from ``actor_worker_cls``, which installs the pre-pass.
After ``install_actor_loss`` (what the drivers call), one ``update_actor`` with ``token_selector=gmts``
(group scope) reports the pre-pass's realised fraction: every prompt group keeps ceil(0.2 n_g) tokens.
"""

from __future__ import annotations


import pytest

from helpers import ray_actor as RA  # selects the CPU platform
from verl_tokensel_cpu import tiny_model

pytestmark = pytest.mark.requires("verl", "ray", "tensordict", "transformers", "tokenizers")

N = 8
GROUP_SIZE = 4


@pytest.mark.timeout(300, method="signal")
def test_update_actor_runs_the_prepass_in_the_ray_worker():
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_tokensel.core.ranking.select import budget
    from verl_tokensel.verl_glue.install import install_actor_loss, prepare_driver_config
    from verl_tokensel.verl_glue.workers import tokensel_worker_class

    config = RA.compose_tokensel_config(str(tiny_model.build_tiny_model_dir()),
                                        ["actor_rollout_ref.actor.token_selector=gmts"],
                                        ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=2,
                                        ppo_max_token_len_per_gpu=64)
    prepare_driver_config(config)
    assert config.actor_rollout_ref.actor.calculate_entropy is False  # the pre-pass measures entropy itself
    with RA.local_ray(config, num_cpus=4, num_gpus=1):
        wg = RA.build_actor_worker_group(config, role="actor",
                                         worker_cls=tokensel_worker_class(ActorRolloutRefWorker))
        install_actor_loss(wg, config)
        batch = RA.make_driver_batch(config, n=N, seed=1, group_size=GROUP_SIZE, resp_len=(3, 9))
        n_valid = [int(r.numel()) for r in batch["response_mask"].unbind(0)]
        metrics = RA.metrics_of(wg.update_actor(batch))
    selected = RA.metric_values(metrics, "tokensel/prepass/selected_tokens")
    assert RA.metric_values(metrics, "tokensel/prepass/valid_tokens") == [float(sum(n_valid))]
    expected = sum(budget(0.2, sum(n_valid[g:g + GROUP_SIZE])) for g in range(0, N, GROUP_SIZE))
    assert selected == [float(expected)]
    assert RA.metric_values(metrics, "tokensel/prepass/groups") == [float(N // GROUP_SIZE)]
    assert "actor/pg_loss" in metrics
