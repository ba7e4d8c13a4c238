"""A shipped DAPO recipe (``dapo_qwen3_*``, ``gmts_*_dapo``) sized for the tiny CPU pipeline (helper, not a test).

:data:`TINY_DAPO_RECIPE_SIZES`: the overrides that turn a recipe's cluster sizes into those of the tiny run of
:mod:`helpers.pipeline` (one node with one logical GPU, 4 prompts x 4 answers of at most 16 tokens, prompts of at
most 32, the overlong buffer the last 4 tokens, no Ulysses, one vLLM worker). Everything else (DAPO's loss, clip,
dynamic sampling, reward manager, dynamic batch size) stays the recipe's. Add the CPU switch, the data, the reward
and the step count, e.g. :func:`helpers.pipeline.prepare_tiny_run`'s overrides after these.
"""

from __future__ import annotations

__all__ = ["TINY_DAPO_RECIPE_SIZES"]

TINY_DAPO_RECIPE_SIZES = [
    "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
    "data.train_batch_size=4", "data.gen_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=16",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "reward.reward_kwargs.max_resp_len=16", "reward.reward_kwargs.overlong_buffer_cfg.len=4",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
]
