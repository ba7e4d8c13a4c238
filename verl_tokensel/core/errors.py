"""The one error type of a bad token-selection key and the checks every config uses to raise it. No import.

Every message names the key under ``actor_rollout_ref.actor``, the value, the valid values, the closest valid
name for a misspelt one ("did you mean gmts?") and, where it helps, the fix: cause -> reason -> fix.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterable, Optional

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def suggest(value: Any, valid: Iterable[str]) -> Optional[str]:
    """The valid name closest to a misspelt ``value`` (``difflib``, similarity >= 0.6), or None: for a value
    that is not a string, is itself valid, or resembles none of them. ``valid``'s entries that are not plain
    names (descriptions such as ``a number in (0, 1]``) are never suggested."""
    if not isinstance(value, str) or not value:
        return None
    names = [v for v in valid if isinstance(v, str) and _NAME.fullmatch(v)]
    if value in names:
        return None
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    if not close:  # a different case only ("GMTS")
        close = [n for n in names if n.lower() == value.lower()][:1]
    return close[0] if close else None


class TokenSelectionConfigError(ValueError):
    """A token-selection key has an invalid value. The message names the key and the valid values."""


def config_error(key: str, value: Any, valid: str, fix: str = "") -> TokenSelectionConfigError:
    msg = f"actor_rollout_ref.actor.{key}={value!r} is invalid"
    near = suggest(value, (v.strip() for v in valid.split(",")))
    msg += f" (did you mean {near}?); valid values: {valid}." if near else f"; valid values: {valid}."
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


__all__ = ["TokenSelectionConfigError", "check_bool", "check_choice", "check_number", "config_error", "suggest"]
