"""The papers' DAPO/GRPO recipes as Hydra primary configs, shipped in the wheel: each a few dozen lines over
shared parts (``base/``: the engines and the setups' hyperparameters; ``cluster/``: each model's cluster).

Launch one with ``python -m verl_tokensel.main_ppo --config-path=pkg://verl_tokensel.recipes
--config-name=<recipe> actor_rollout_ref.actor.token_selector=<preset>``, or with the launch scripts
``recipes/run.sh`` / ``recipes/submit_ray_job.sh`` of the repository (recipes/README.md).
"""
