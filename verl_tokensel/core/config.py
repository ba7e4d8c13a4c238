"""The ``token_selection`` override node and the one resolution of a preset into a rule. No verl import.

Two keys on ``actor_rollout_ref.actor`` drive everything:

- ``token_selector``: a preset name from :data:`~verl_tokensel.core.resolve.presets.PRESETS` (``none``, ``forking``,
  ...), each a rule name and values of its knobs;
- ``token_selection.<knob>``: per-knob overrides; ``null`` (the default) takes the preset's value.

The knobs are one flat namespace: the shared keys of :class:`~verl_tokensel.core.resolve.selection.Selection`, the
ranking (:class:`~verl_tokensel.core.seam.rule.Knobs`) and each registered rule's and shaping's own knobs, whose
dataclass fields (default, help, paper value) are the single source of truth: :class:`TokenSelectionConfig` is
built from them, the YAML in ``verl_tokensel/config``, the README's knob table and ``docs/knobs.md`` are generated
from them (``python scripts/knob_docs.py --write``; a test holds them equal). A knob that the preset's rule does not
read is refused, naming the rules that do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field, replace
from typing import Any, Optional

from verl_tokensel.core.errors import TokenSelectionConfigError, check_bool, config_error, suggest
from verl_tokensel.core.resolve.presets import PRESETS, preset, register_preset, selection_for, selectors
from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY, ActorSettings, Ranking
from verl_tokensel.core.seam.knobs import knob_fields
from verl_tokensel.core.seam.checks import validate
from verl_tokensel.core.resolve.selection import NORMALISERS, Selection

#: keys of the ``token_selection`` node that switch engine behaviour rather than override a preset's rule
ENGINE_SWITCHES = ("auto_enable_entropy", "no_grad_scores", "prepass_reuse")
#: the shared keys a user may override (the rule's name through ``rule``; knobs and shaping knobs by name)
SHARED_KEYS = tuple(f.name for f in dataclasses.fields(Selection) if f.name not in ("rule", "knobs", "shaping_knobs"))


def _engine_switches() -> list[tuple[str, dataclasses.Field]]:
    def switch(default: bool, help: str, paper: str) -> Any:
        return field(default=default, metadata={"help": help, "paper": paper, "group": "engine"})

    return [
        ("auto_enable_entropy", switch(
            True, "Turn on actor.calculate_entropy for the update pass when the score needs entropy; false makes "
            "that an error instead.", "n/a")),
        ("no_grad_scores", switch(
            True, "Compute the update pass's entropy and sum_j p_j^2 without an autograd graph, in "
            "vocabulary-bounded chunks, when nothing needs their gradient (entropy_coeff = 0; FSDP/FSDP2 engines, "
            "no fused kernels); false keeps verl's graph.",
            "n/a (stock verl keeps the graph; TRL computes its selection entropy under no_grad)")),
        ("prepass_reuse", switch(
            True, "score_source=prepass: where the pre-pass would measure the weights verl's old-log-prob pass "
            "measured (the first mini-batch of the first PPO epoch of a step; every mini-batch with one mini-batch "
            "per step), use that pass's log-probs and entropy instead of a second forward; false always runs the "
            "forward, except for a score that reads no policy value (only fields fixed before the update), which "
            "never needs it.", "n/a (the GMTS code always runs its forward)")),
    ]


def knob_sources() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    """Every override knob of the registered rules and shapings and where it is declared: ``name -> [(component,
    field), ...]`` with component ``shared``, ``ranking``, ``rule <name>`` or ``shaping <name>``, in the YAML's
    order. A rule registered later (user code) adds its knobs here when it is registered."""
    out: dict[str, list[tuple[str, dataclasses.Field]]] = {}

    def add(name: str, where: str, f: dataclasses.Field) -> None:
        out.setdefault(name, []).append((where, f))

    rule_help = (f"The token rule the preset's ranking feeds: one of {', '.join(RULE_REGISTRY)} (null: the "
                 "preset's). Its own knobs take their defaults unless the preset is of that rule.")
    add("rule", "shared", field(default=None, metadata={"help": rule_help, "paper": "n/a"}))
    for f in dataclasses.fields(Selection):
        if f.name in SHARED_KEYS:
            add(f.name, "shared", f)
    for f in dataclasses.fields(Ranking):
        add(f.name, "ranking", f)
    for name, rule in RULE_REGISTRY.items():
        for f in knob_fields(rule.Knobs):
            add(f.name, f"rule {name}", f)
    for name, shaping in SHAPING_REGISTRY.items():
        for f in dataclasses.fields(shaping.Knobs):
            add(f.name, f"shaping {name}", f)
    return out


def declared_keys() -> list[tuple[str, Any, dict[str, Any]]]:
    """The keys of the ``token_selection`` node as the YAML declares them: ``(name, default, metadata)`` for every
    knob of :func:`knob_sources` (default None: the preset's value; metadata ``declared`` lists who reads it), then
    the engine switches."""
    out = [(name, None, {"help": where[0][1].metadata["help"], "paper": where[0][1].metadata["paper"],
                         "declared": [w for w, _ in where]}) for name, where in knob_sources().items()]
    out += [(name, f.default, dict(f.metadata)) for name, f in _engine_switches()]
    return out


class TokenSelectionConfig:
    """Per-knob overrides of the preset named by ``actor_rollout_ref.actor.token_selector``, and the engine switches.

    Every knob defaults to ``None`` = "use the preset's value". The keys are open: a rule registered from user code
    brings its own knobs, so a key is checked against the chosen rule's knobs when the config is resolved
    (:func:`apply_overrides`), not here; setting a knob while ``token_selector=none`` is an error (nothing is
    silently ignored). The engine switches are booleans, checked here.
    """

    def __init__(self, **knobs: Any) -> None:
        knobs.pop("_target_", None)
        for name, f in _engine_switches():
            value = knobs.pop(name, f.default)
            check_bool(f"token_selection.{name}", value)
            setattr(self, name, value)
        self._knobs = {k: v for k, v in knobs.items() if v is not None}

    def overrides(self) -> dict[str, Any]:
        """The knobs set by the user (not None), excluding the engine switches, which are not part of a preset."""
        return dict(self._knobs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.__dict__.get("_knobs", {}).get(name)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, TokenSelectionConfig) and vars(self) == vars(other)

    def __repr__(self) -> str:
        items = {**self._knobs, **{n: getattr(self, n) for n in ENGINE_SWITCHES}}
        return "TokenSelectionConfig(" + ", ".join(f"{k}={v!r}" for k, v in items.items()) + ")"


def resolve_selection(
    token_selector: Any,
    overrides: Optional[Any] = None,
    **actor: Any,
) -> Optional[Selection]:
    """The preset named ``token_selector`` with the knobs of ``overrides``, or None for ``none``.

    The one validation pass runs with the actor's settings ``actor`` (:class:`ActorSettings`' fields; defaults:
    verl's). Raises :class:`TokenSelectionConfigError` naming the key.
    """
    overrides = overrides if overrides is not None else TokenSelectionConfig()
    if not isinstance(token_selector, str) or token_selector not in selectors():
        using = [p for p, sel in PRESETS.items() if sel is not None and sel.rule == token_selector]
        raise config_error(
            "token_selector", token_selector, ", ".join(selectors()),
            (f"rule {token_selector} runs through its presets ({', '.join(using)}). " if using else "")
            + "A rule or preset of your own registers when its module is imported: list the module in "
            "VERL_USE_EXTERNAL_MODULES (comma-separated, importable from the working directory, e.g. "
            "VERL_USE_EXTERNAL_MODULES=my_rules), as verl does for its own plugins.")
    base = selection_for(token_selector)
    given = overrides.overrides()
    if base is None:
        if given:
            keys = ", ".join(f"token_selection.{k}" for k in given)
            raise TokenSelectionConfigError(
                f"actor_rollout_ref.actor.{keys} set while actor_rollout_ref.actor.token_selector=none; "
                f"these knobs would be ignored. Fix: pick a selector ({', '.join(p for p in PRESETS if p != 'none')}) "
                "or remove the overrides.")
        return None
    sel = apply_overrides(token_selector, base, given)
    validate(sel, ActorSettings(auto_enable_entropy=overrides.auto_enable_entropy, **actor))
    return sel


def _readers(key: str) -> str:
    where = [w for w, _ in knob_sources().get(key, [])]
    presets = [name for name, sel in PRESETS.items() if sel is not None and (
        f"rule {sel.rule}" in where or f"shaping {sel.shaping}" in where)]
    return " and ".join(where) + (f" (presets {', '.join(presets)})" if presets else "")


def apply_overrides(token_selector: str, base: Selection, given: dict[str, Any]) -> Selection:
    """``base`` (the preset ``token_selector``) with the user's knobs ``given``; a knob neither the shared config
    nor the rule nor its shaping reads is refused, naming who reads it (or the rule's knobs, for a key nobody
    reads)."""
    given = dict(given)
    rule = given.pop("rule", base.rule)
    if rule not in RULE_REGISTRY:
        raise config_error("token_selection.rule", rule, ", ".join(RULE_REGISTRY))
    shaping = given.pop("shaping", base.shaping)
    if shaping != "none" and shaping not in SHAPING_REGISTRY:
        raise config_error("token_selection.shaping", shaping, ", ".join(("none", *SHAPING_REGISTRY)))
    knobs_cls = RULE_REGISTRY[rule].Knobs
    rule_keys = {f.name for f in dataclasses.fields(knobs_cls)}
    ranking = {f.name for f in dataclasses.fields(Ranking)} if issubclass(knobs_cls, Ranking) else set()
    knobs = {k: v for k, v in dataclasses.asdict(base.knobs).items() if k in ranking or rule == base.rule}
    shaping_cls = SHAPING_REGISTRY[shaping].Knobs if shaping in SHAPING_REGISTRY else None
    shaping_keys = set() if shaping_cls is None else {f.name for f in dataclasses.fields(shaping_cls)}
    shaped = dataclasses.asdict(base.shaping_knobs) if shaping == base.shaping and base.shaping_knobs else {}
    shared, unread = {}, []
    for key in sorted(given):
        if key in SHARED_KEYS:
            shared[key] = given[key]
        elif key in rule_keys:
            knobs[key] = given[key]
        elif key in shaping_keys:
            shaped[key] = given[key]
        else:
            unread.append(key)
    sel = replace(base, rule=rule, knobs=knobs_cls(**knobs), shaping=shaping,
                  shaping_knobs=None if shaping_cls is None else shaping_cls(**shaped), **shared)
    for key in unread:  # after the rule validated the knobs it reads: their errors come first
        readers = _readers(key)
        own = sorted({*SHARED_KEYS, "rule", *rule_keys, *shaping_keys, *ENGINE_SWITCHES})
        if not readers:
            near = suggest(key, own)
            raise config_error(
                f"token_selection.{key}", given[key], f"a knob of token_selector={token_selector} (rule {rule}"
                f"{'' if shaping == 'none' else ', shaping ' + shaping}): {', '.join(own)}",
                f"no registered rule or shaping has a knob {key}." + (f" Did you mean {near}?" if near else ""))
        raise config_error(
            f"token_selection.{key}", given[key], f"null (with token_selector={token_selector}, rule {rule}, "
            f"shaping {shaping})", f"only {readers} reads it, so it would be ignored. Fix: remove "
            f"token_selection.{key} (a recipe may set it for its own preset: override it with "
            f"token_selection.{key}=null) or pick a preset that reads it.")
    return sel


def override(sel: Selection, **values: Any) -> Selection:
    """``sel`` with flat knobs replaced as ``token_selection.<knob>=value`` would replace them (the shared keys,
    ``rule``, the rule's and the shaping's knobs), validated without the actor's settings; a knob nobody reads is
    refused."""
    out = apply_overrides("<selection>", sel, values)
    validate(out)
    return out


def knob_table_rows() -> list[tuple[str, str, str, str]]:
    """(name, default, paper value, meaning) for every knob, for the docs table: the preset's default
    (``preset``) or the engine switch's; the meaning says which rule or shaping reads a knob of its own."""
    rows = [("token_selector", "none", "forking / gmts", "Preset: " + ", ".join(PRESETS) + ".")]
    for name, default, meta in declared_keys():
        shown = "preset" if default is None else str(default).lower()
        declared = [w for w in meta.get("declared", []) if w not in ("shared", "ranking")]
        prefix = f"{' / '.join(declared)}: " if declared else ""
        rows.append((f"token_selection.{name}", shown, meta["paper"], prefix + meta["help"]))
    return rows


__all__ = ["ENGINE_SWITCHES", "NORMALISERS", "PRESETS", "SHARED_KEYS", "Selection", "TokenSelectionConfig",
           "TokenSelectionConfigError", "apply_overrides", "declared_keys", "knob_sources",
           "knob_table_rows", "override", "preset", "register_preset", "resolve_selection"]
