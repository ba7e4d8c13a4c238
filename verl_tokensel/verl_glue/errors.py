"""A refused value of any key of verl's config, as the one error type of a bad token-selection setting.

:func:`~verl_tokensel.core.errors.config_error` names keys under ``actor_rollout_ref.actor``; the glue also refuses
keys elsewhere (``trainer.v1.trainer_mode``, ``actor_rollout_ref.model.use_fused_kernels``,
``algorithm.rollout_correction.bypass_mode``): :func:`config_error_at` takes the key spelt in full from the
config's root and gives the same message (key, value, valid values, closest valid name, fix) and type, which
``python -m verl_tokensel.main_ppo`` prints as one line.
"""

from __future__ import annotations

from typing import Any

from verl_tokensel.core.errors import TokenSelectionConfigError, config_error

#: where core's config_error places its keys
ACTOR_NODE = "actor_rollout_ref.actor."


def config_error_at(key: str, value: Any, valid: str, fix: str = "") -> TokenSelectionConfigError:
    """``config_error`` for ``key`` spelt from the config's root (``trainer.v1.trainer_mode``)."""
    if key.startswith(ACTOR_NODE):
        return config_error(key[len(ACTOR_NODE):], value, valid, fix)
    return TokenSelectionConfigError(str(config_error(key, value, valid, fix)).removeprefix(ACTOR_NODE))


__all__ = ["ACTOR_NODE", "config_error_at"]
