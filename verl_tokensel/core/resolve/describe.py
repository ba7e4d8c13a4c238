"""What ``verl-tokensel rules`` prints: the registered rules, shapings and presets, and what one preset does. Pure
torch, no verl import.

Everything comes from the fields the components carry: a rule's or shaping's ``about`` (source, formula,
deviations; :func:`~verl_tokensel.core.seam.rule.register_rule`), its knobs (default, help, paper value;
:func:`~verl_tokensel.core.seam.rule.knob`) and the presets (:data:`~verl_tokensel.core.resolve.presets.PRESETS`). The
generated docs page ``docs/knobs.md`` (``scripts/knob_docs.py``) renders the same fields with the helpers here, so a
rule registered from user code is described the way a built-in one is.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Optional

from verl_tokensel.core.errors import suggest
from verl_tokensel.core.resolve.presets import PRESETS, selection_for, selectors
from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY, Ranking
from verl_tokensel.core.seam.knobs import knob_fields
from verl_tokensel.core.seam.rule import About
from verl_tokensel.core.resolve.selection import Selection

WIDTH = 116
#: the shared keys of a resolved preset, in the YAML's order
SHARED_FIELDS = tuple(f for f in dataclasses.fields(Selection) if f.name not in ("rule", "knobs", "shaping_knobs"))


def show(value: Any) -> str:
    """A knob value as the YAML and the command line write it (null, true / false, 2e-4)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def component(kind: str, name: str) -> Any:
    """The registered rule (``kind="rule"``) or shaping (``"shaping"``) ``name``."""
    return (RULE_REGISTRY if kind == "rule" else SHAPING_REGISTRY)[name]


def about(kind: str, name: str) -> About:
    """Its source, formula and deviations (an empty :class:`About` for a component registered without them)."""
    return getattr(component(kind, name), "about", None) or About()


def summary(kind: str, name: str) -> str:
    """One line: the formula, else the first line of the component's docstring."""
    formula = about(kind, name).formula
    if formula:
        return formula
    doc = (type(component(kind, name)).__doc__ or "").strip()
    return doc.splitlines()[0] if doc else "(no formula given)"


def own_fields(kind: str, name: str) -> list[dataclasses.Field]:
    """The component's own knobs: a rule's beyond the ranking (:class:`Ranking`), every field of a shaping's."""
    knobs_cls = component(kind, name).Knobs
    if kind == "rule":
        return knob_fields(knobs_cls)
    return list(dataclasses.fields(knobs_cls)) if dataclasses.is_dataclass(knobs_cls) else []


def presets_using(kind: str, name: str) -> list[str]:
    """The presets whose rule (or shaping) is ``name``."""
    attr = "rule" if kind == "rule" else "shaping"
    return [p for p, sel in PRESETS.items() if sel is not None and getattr(sel, attr) == name]


def preset_values(preset: str, kind: str, name: str) -> dict[str, Any]:
    """The own knobs of ``name`` that the preset sets to other than their defaults."""
    sel = selection_for(preset)
    knobs = sel.knobs if kind == "rule" else sel.shaping_knobs
    return {f.name: getattr(knobs, f.name) for f in own_fields(kind, name)
            if knobs is not None and getattr(knobs, f.name) != f.default}


def preset_line(name: str) -> str:
    """One line of a preset: its rule (and shaping), ranking (or none: every token) and where it pools."""
    sel = selection_for(name)
    if sel is None:
        return "stock verl: no rule, the loss and gradient verl's"
    k = sel.knobs
    rule = sel.rule + ("" if sel.shaping == "none" else f" + shaping {sel.shaping}")
    ranking = (f"score {k.score}, ratio {show(k.ratio)} ({k.budget}), {k.direction}" if isinstance(k, Ranking)
               else f"every token{'' if sel.score == 'all' else ', its own score ' + sel.score}")
    return f"rule {rule}; {ranking}; scope {sel.scope}, score_source {sel.score_source}, normaliser {sel.normaliser}"


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False) or [first]


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; the last column wrapped under itself."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        head = indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  "
        out += _wrap(row[-1], head, " " * len(head))
    return out


def describe_rules() -> str:
    """Every registered rule and shaping, one line each (its formula), and every preset with its rule."""
    out = ["Rules (token_selection.rule; a preset names one):"]
    width = max(len(n) for n in (*RULE_REGISTRY, *SHAPING_REGISTRY)) + 2
    for name in RULE_REGISTRY:
        out += _wrap(summary("rule", name), f"  {name.ljust(width)}", " " * (width + 2))
    out += ["", "Shapings (token_selection.shaping; run before the rule):"]
    for name in SHAPING_REGISTRY:
        out += _wrap(summary("shaping", name), f"  {name.ljust(width)}", " " * (width + 2))
    out += ["", "Presets and rules (actor_rollout_ref.actor.token_selector; a rule without a preset of its name "
            "runs with its knobs' defaults):"]
    width = max(len(n) for n in selectors()) + 2
    for name in selectors():
        out += _wrap(preset_line(name), f"  {name.ljust(width)}", " " * (width + 2))
    out += [""] + _wrap("verl-tokensel rules <preset or rule>: its rule, every knob's value, default and paper "
                        "value, the formula, the source and the deviations.", "", "")
    return "\n".join(out) + "\n"


def _about_lines(kind: str, name: str) -> list[str]:
    a = about(kind, name)
    out = _wrap(a.source or "(not given)", "  source      ", " " * 14)
    out += _wrap(summary(kind, name), "  formula     ", " " * 14)
    if a.deviations:
        out += _wrap(a.deviations[0], "  deviations  - ", " " * 16)
        for d in a.deviations[1:]:
            out += _wrap(d, " " * 14 + "- ", " " * 16)
    else:
        out.append("  deviations  none given")
    return out


def _knob_rows(fields: list[dataclasses.Field], knobs: Any) -> list[tuple[str, ...]]:
    return [(f.name, show(getattr(knobs, f.name)), show(f.default), f.metadata.get("paper", "")) for f in fields]


def describe_preset(name: str) -> str:
    """What the preset ``name`` does: its rule and shaping, the shared keys, every knob of its rule (and shaping)
    with its value, default and paper value, and the rule's formula, source and deviations. Raises ``KeyError``
    (naming the valid presets) for an unknown name; a registered rule without a preset of its name is described
    with its knobs' defaults."""
    if name not in selectors():
        raise KeyError(unknown_preset(name))
    sel: Optional[Selection] = selection_for(name)
    if sel is None:
        return "\n".join(_wrap(f"token_selector={name}: stock verl, no token rule; the loss and gradient are verl's, "
                               "bit for bit. Setting a token_selection knob with it is an error.", "", "  ")) + "\n"
    shaping = "no shaping" if sel.shaping == "none" else f"shaping {sel.shaping}"
    out = [f"token_selector={name}: rule {sel.rule}, {shaping}",
           "  (set any value with actor_rollout_ref.actor.token_selection.<knob>=...)", ""]
    head = ("knob", "value", "default", "paper value")
    out.append("Shared keys (every rule):")
    out += _table([head] + [(f.name, show(getattr(sel, f.name)), show(f.default), f.metadata.get("paper", ""))
                            for f in SHARED_FIELDS])
    out += ["", f"Rule {sel.rule}:"] + _about_lines("rule", sel.rule)
    ranks = isinstance(sel.knobs, Ranking)
    out += ["", f"  {'Ranking and own knobs' if ranks else 'Knobs'} of rule {sel.rule}"
                f"{'' if ranks else ' (it ranks nothing: every valid token, but for what it says)'}:"]
    fields = (list(dataclasses.fields(Ranking)) if ranks else []) + own_fields("rule", sel.rule)
    out += _table([head] + _knob_rows(fields, sel.knobs), indent="    ")
    if sel.shaping != "none":
        out += ["", f"Shaping {sel.shaping} (before the rule):"] + _about_lines("shaping", sel.shaping)
        out += ["", f"  Knobs of shaping {sel.shaping}:"]
        out += _table([head] + _knob_rows(own_fields("shaping", sel.shaping), sel.shaping_knobs), indent="    ")
    return "\n".join(out) + "\n"


def unknown_preset(name: str) -> str:
    """The error line for an unknown preset: the valid names, the closest one, and the presets of a rule or shaping
    of that name."""
    msg = f"preset {name!r} is unknown; valid: {', '.join(selectors())}."
    for kind, registry in (("rule", RULE_REGISTRY), ("shaping", SHAPING_REGISTRY)):
        if name in registry:
            using = presets_using(kind, name)
            msg += f" {name} is a {kind}" + (f"; presets of it: {', '.join(using)}." if using else ".")
    near = suggest(name, selectors())
    return msg + (f" Did you mean {near}?" if near else "")


__all__ = ["about", "describe_preset", "describe_rules", "own_fields", "preset_line", "preset_values",
           "presets_using", "show", "summary", "unknown_preset"]
