"""The one error type of a bad token-selection key and the checks every config uses to raise it. No import.

Every message names the key under ``actor_rollout_ref.actor``, the value, the valid values and, where it helps,
the fix: cause -> reason -> fix.
"""

from __future__ import annotations

import math
from typing import Any, Optional


class TokenSelectionConfigError(ValueError):
    """A token-selection key has an invalid value. The message names the key and the valid values."""


def config_error(key: str, value: Any, valid: str, fix: str = "") -> TokenSelectionConfigError:
    msg = f"actor_rollout_ref.actor.{key}={value!r} is invalid; valid values: {valid}."
    if fix:
        msg += f" {fix}"
    return TokenSelectionConfigError(msg)


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise config_error(key, value, ", ".join(choices))


def check_number(key: str, value: Any, low: Optional[float], high: Optional[float], valid: str,
                 open_high: bool = False, open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if open_low else value >= low))
    ok = ok and (high is None or (value < high if open_high else value <= high))
    if not ok:
        raise config_error(key, value, valid)


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise config_error(key, value, "true, false")


__all__ = ["TokenSelectionConfigError", "check_bool", "check_choice", "check_number", "config_error"]
