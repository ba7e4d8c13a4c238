"""Register your own token score and preset, then select with it from the command line.

A score is a function of :class:`verl_tokensel.core.scores.ScoreInputs` returning a
``(batch, response_len)`` tensor; a preset names a score plus the selection rule. Both registries
refuse to overwrite an existing name.

The registration must run in every process that builds the actor config (driver, Ray TaskRunner,
actor workers). Either install it as a ``verl.plugins`` entry point of your own package, or list
the module in ``VERL_USE_EXTERNAL_MODULES`` and forward that variable to the workers::

    export VERL_USE_EXTERNAL_MODULES=examples.custom_score
    python -m verl_tokensel.main_ppo actor_rollout_ref.actor.token_selector=low_confidence \\
        +ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=examples.custom_score ...
"""

from __future__ import annotations

import torch

from verl_tokensel.core.config import PRESETS, Selection, register_preset
from verl_tokensel.core.scores import SCORE_REGISTRY, ScoreInputs, register_score

if "low_confidence" not in SCORE_REGISTRY:

    @register_score("low_confidence", needs_entropy=False, needs_omega=False,
                    help="1 - p(a_t): tokens the policy sampled with low probability")
    def low_confidence(inp: ScoreInputs) -> torch.Tensor:
        return -torch.expm1(inp.log_prob.detach().float())


if "low_confidence" not in PRESETS:
    register_preset(
        "low_confidence",
        Selection(score="low_confidence", ratio=0.2, direction="top", scope="micro_batch", normaliser="all"),
    )
