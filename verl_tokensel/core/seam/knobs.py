"""A rule's knobs: :func:`knob` (a field with its help text, default, paper value and valid range), the base
:class:`Knobs` (a rule that keeps every valid token) and :class:`Ranking` (the knobs of a rule that ranks). Pure torch,
no verl import; rule authors import them from :mod:`verl_tokensel.rules`."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_tokensel.core.errors import check_bool, check_choice, config_error
from verl_tokensel.core.ranking.scopes import DIRECTIONS, POOLS, invalid_rule_arg
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY

# How many tokens a ranking selects: count = ceil(ratio * N) of the scope's pool; quantile = those strictly above
# the (1 - ratio) quantile of their response (scope sequence) or micro-batch, linear interpolation (Archer's
# per-response 0.8 entropy quantile)
BUDGETS = ("count", "quantile")

def knob(default: Any, help: str, paper: str, *, ge: Optional[float] = None, gt: Optional[float] = None,
         le: Optional[float] = None, lt: Optional[float] = None, choices: Optional[tuple] = None) -> Any:
    """A rule knob: its default, its help text and the paper's value (read by the YAML, the docs and ``verl-tokensel
    rules``; one source for each knob's meaning), and optionally its valid range (``ge``/``gt``/``le``/``lt``: a
    finite number in it) or its ``choices``, which :class:`Knobs` checks itself, naming the key."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta = {"help": help, "paper": paper, "bounds": bounds, "choices": choices}
    return field(default=default, metadata=meta)


#: a knob bound's comparison: value ``op`` bound
_COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _valid_range(bounds: dict[str, float]) -> str:
    """``a number >= 0``, ``a number in (0, 1]``: the valid values a knob's bounds name."""
    low = [(k, v) for k, v in bounds.items() if k in ("ge", "gt")]
    high = [(k, v) for k, v in bounds.items() if k in ("le", "lt")]
    if low and high:
        (lk, lv), (hk, hv) = low[0], high[0]
        return f"a number in {'[' if lk == 'ge' else '('}{lv:g}, {hv:g}{']' if hk == 'le' else ')'}"
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return "a number " + " and ".join(f"{words[k]} {v:g}" for k, v in bounds.items())


def check_knob_fields(knobs: Any) -> None:
    """Each :func:`knob` field of ``knobs`` in its range (``ge``/``lt``/...), among its ``choices``, a bool where
    declared one; errors name ``token_selection.<field>``."""
    for f in dataclasses.fields(knobs):
        value, bounds, choices = getattr(knobs, f.name), f.metadata.get("bounds"), f.metadata.get("choices")
        if f.type in ("bool", bool):
            check_bool(f"token_selection.{f.name}", value)
        if choices:
            check_choice(f"token_selection.{f.name}", value, tuple(choices))
        if bounds and not (value is None and f.default is None):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or not all(_COMPARE[k](value, v) for k, v in bounds.items()):
                raise config_error(f"token_selection.{f.name}", value,
                                   ("null or " if f.default is None else "") + _valid_range(bounds))


@dataclass(frozen=True)
class Knobs:
    """The base of every rule's knobs: a rule's own knobs are fields of a frozen subclass, each a :func:`knob`,
    checked when the knobs are built (their ``ge``/``lt``/``choices``). A rule whose knobs are plain :class:`Knobs`
    keeps every valid token; one that ranks tokens extends :class:`Ranking`."""

    def __post_init__(self) -> None:
        check_knob_fields(self)


@dataclass(frozen=True)
class Ranking(Knobs):
    """The knobs of a rule that ranks: which registered score it ranks over the scope's pool, and how many tokens it
    keeps (a score that ranks nothing, ``all``, keeps every token)."""

    score: str = knob("entropy", "Per-token ranking score of a rule that ranks: a registered score (verl-tokensel "
                      "view lists them).", "entropy (80/20); gmts (GMTS)")
    ratio: float = knob(0.2, "Fraction of the scope's valid tokens a ranking rule selects, in (0, 1]; exactly "
                        "ceil(ratio*N) tokens (the covariance rules' own scores: max(1, int(ratio*N)), verl's).",
                        "0.2 (80/20 and GMTS); 2e-4 (verl's KL-Cov / Clip-Cov)")
    direction: str = knob("top", "Keep the highest (top) or lowest (bottom) scores.",
                          "top; bottom for the 80/20 negative control")
    pool: str = knob("valid", f"Tokens of the scope the budget is a fraction of: {' or '.join(POOLS)}. valid = "
                     "every valid response token; nonzero = only tokens whose score is not exactly 0 (the released "
                     "GMTS code, whose padding filter also drops clipped tokens and zero-advantage groups).",
                     "valid (80/20; GMTS paper: a fraction of the responses' tokens); nonzero (GMTS code)")
    budget: str = knob("count", f"How many tokens the rule selects: one of {', '.join(BUDGETS)}. count = "
                       "ceil(ratio*N) of the scope's pool; quantile = the tokens strictly above the (1 - ratio) "
                       "quantile of their response (scope sequence) or micro-batch, linear interpolation.",
                       "count; quantile (Archer: per-response 0.8 quantile)")

    def __post_init__(self) -> None:
        check_choice("token_selection.score", self.score, tuple(SCORE_REGISTRY))
        bad = invalid_rule_arg(self.ratio, self.direction, "micro_batch", self.pool)
        if bad is not None and bad[0] == "ratio":
            raise config_error("token_selection.ratio", self.ratio, bad[2])
        check_choice("token_selection.direction", self.direction, DIRECTIONS)
        check_choice("token_selection.pool", self.pool, POOLS)
        check_choice("token_selection.budget", self.budget, BUDGETS)
        check_knob_fields(self)


def knob_fields(knobs_cls: type) -> list[dataclasses.Field]:
    """A knobs class's own fields (those :class:`Ranking` does not declare)."""
    shared = {f.name for f in dataclasses.fields(Ranking)} if issubclass(knobs_cls, Ranking) else set()
    return [f for f in dataclasses.fields(knobs_cls) if f.name not in shared]


__all__ = ["BUDGETS", "Knobs", "Ranking", "check_knob_fields", "knob", "knob_fields"]
