"""The ``token_selection`` override node and the one resolution of a preset into a rule. No verl import.

Two keys on ``actor_rollout_ref.actor`` drive everything:

- ``token_selector``: a preset name from :data:`~verl_tokensel.core.presets.PRESETS` (``none``, ``forking``, ...),
  each a rule name and values of its knobs;
- ``token_selection.<knob>``: per-knob overrides; ``null`` (the default) takes the preset's value.

The knobs are one flat namespace: the shared keys of :class:`~verl_tokensel.core.selection.Selection`, the ranking
(:class:`~verl_tokensel.core.rules.base.Ranking`) and each registered rule's and shaping's own knobs, whose
dataclass fields (default, help, paper value) are the single source of truth: :class:`TokenSelectionConfig` is
built from them, the YAML in ``verl_tokensel/config`` and the README's knob tables are generated from them
(``python -m verl_tokensel.core.knob_docs``; a test holds them equal). A knob that the preset's rule does not read
is refused, naming the rules that do.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import field, make_dataclass, replace
from typing import Any, Optional

from verl_tokensel.core.errors import TokenSelectionConfigError, check_bool, config_error
from verl_tokensel.core.presets import PRESETS, preset, register_preset
from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY, ActorSettings, Ranking
from verl_tokensel.core.rules.base import knob_fields
from verl_tokensel.core.selection import NORMALISERS, Selection

#: knobs of TokenSelectionConfig that switch engine behaviour rather than override a preset's rule
ENGINE_SWITCHES = ("auto_enable_entropy", "no_grad_scores", "prepass_reuse")
#: the shared keys a user may override (the rule's name through ``rule``; knobs and shaping knobs by name)
SHARED_KEYS = tuple(f.name for f in dataclasses.fields(Selection) if f.name not in ("rule", "knobs", "shaping_knobs"))
#: earlier keys that now map onto ``rule`` (each rule's ``legacy`` says what they read for it)
LEGACY_KEYS = ("action", "phases")


def _legacy_rule(key: str, value: str, base: Optional[dict[str, str]] = None) -> Optional[str]:
    """The rule an earlier key's value names (with the other earlier keys as ``base`` reads them): the plain ranking
    rule (no knobs of its own) first, what an earlier key for the gradient mask meant; None if no rule reads so."""
    want = {**(base or {}), key: value}
    found = sorted((name for name, r in RULE_REGISTRY.items() if all(r.legacy.get(k) == v for k, v in want.items())),
                   key=lambda name: RULE_REGISTRY[name].Knobs is not Ranking)
    return found[0] if found else None


def _engine_switches() -> list[tuple[str, type, Any]]:
    def switch(default: bool, help: str, paper: str) -> Any:
        return field(default=default, metadata={"help": help, "paper": paper, "group": "engine"})

    return [
        ("auto_enable_entropy", bool, switch(
            True, "Turn on actor.calculate_entropy for the update pass when the score needs entropy; false makes "
            "that an error instead.", "n/a")),
        ("no_grad_scores", bool, switch(
            True, "Compute the update pass's entropy and sum_j p_j^2 without an autograd graph, in "
            "vocabulary-bounded chunks, when nothing needs their gradient (entropy_coeff = 0; FSDP/FSDP2 engines, "
            "no fused kernels); false keeps verl's graph.",
            "n/a (stock verl keeps the graph; TRL computes its selection entropy under no_grad)")),
        ("prepass_reuse", bool, switch(
            True, "score_source=prepass: where the pre-pass would measure the weights verl's old-log-prob pass "
            "measured (the first mini-batch of the first PPO epoch of a step; every mini-batch with one mini-batch "
            "per step), use that pass's log-probs and entropy instead of a second forward; false always runs the "
            "forward, except for a score that reads no policy value (only fields fixed before the update), which "
            "never needs it.", "n/a (the GMTS code always runs its forward)")),
    ]


def knob_sources() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    """Every override knob and where it is declared: ``name -> [(component, field), ...]`` with component
    ``shared``, ``ranking``, ``rule <name>``, ``shaping <name>`` or ``legacy``, in the YAML's order."""
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
    for key in LEGACY_KEYS:
        values = ", ".join(f"{value} = rule {_legacy_rule(key, value)}"
                           for value in dict.fromkeys(r.legacy[key] for r in RULE_REGISTRY.values()))
        add(key, "legacy", field(default=None, metadata={
            "help": f"Earlier key, mapped onto token_selection.rule ({values}); use token_selection.rule.",
            "paper": "n/a"}))
    return out


def _build_override_class() -> type:
    specs = []
    for name, where in knob_sources().items():
        f = where[0][1]
        meta = {"help": f.metadata["help"], "paper": f.metadata["paper"], "declared": [w for w, _ in where]}
        specs.append((name, Optional[Any], field(default=None, metadata=meta)))
    specs += _engine_switches()

    def __post_init__(self) -> None:
        for name in ENGINE_SWITCHES:
            check_bool(f"token_selection.{name}", getattr(self, name))

    def overrides(self) -> dict[str, Any]:
        """The knobs set by the user (not None), excluding the engine switches, which are not part of a preset."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ENGINE_SWITCHES and getattr(self, f.name) is not None}

    doc = ("Per-knob overrides of the preset named by ``actor_rollout_ref.actor.token_selector``.\n\n"
           "Every knob defaults to ``None`` = \"use the preset's value\"; setting a knob while ``token_selector=none``"
           " is an error (nothing is silently ignored). Built from the shared config, the ranking and every "
           "registered rule's and shaping's knobs (:func:`knob_sources`).")
    return make_dataclass("TokenSelectionConfig", specs, namespace={
        "__post_init__": __post_init__, "overrides": overrides, "__doc__": doc, "__module__": __name__})


TokenSelectionConfig = _build_override_class()


def resolve_selection(
    token_selector: Any,
    overrides: Optional[Any] = None,
    **actor: Any,
) -> Optional[Selection]:
    """The preset named ``token_selector`` with the knobs of ``overrides``, or None for ``none``.

    The rule validates itself (:class:`Selection`); ``actor`` holds the actor settings of
    :func:`check_with_actor` (defaults: verl's). Raises :class:`TokenSelectionConfigError` naming the key.
    """
    overrides = overrides if overrides is not None else TokenSelectionConfig()
    if not isinstance(token_selector, str) or token_selector not in PRESETS:
        raise config_error("token_selector", token_selector, ", ".join(PRESETS))
    base = PRESETS[token_selector]
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
    check_with_actor(sel, auto_enable_entropy=overrides.auto_enable_entropy, **actor)
    return sel


def _rule_of(token_selector: str, base: Selection, given: dict[str, Any]) -> str:
    """The rule after ``rule`` and the earlier keys ``action`` / ``phases`` (popped from ``given``): an earlier
    key that reads as the preset's rule does changes nothing; one that asks for another maps onto the rule whose
    ``legacy`` reads so (and says so)."""
    rule = given.pop("rule", base.rule)
    if rule not in RULE_REGISTRY:
        raise config_error("token_selection.rule", rule, ", ".join(RULE_REGISTRY))
    for key in LEGACY_KEYS:
        if key not in given:
            continue
        value = given.pop(key)
        legacy = dict(RULE_REGISTRY[rule].legacy)
        valid = sorted({r.legacy[key] for r in RULE_REGISTRY.values()})
        if value not in valid:
            raise config_error(f"token_selection.{key}", value, ", ".join(valid),
                               f"token_selection.{key} is an earlier key of token_selection.rule.")
        if legacy[key] == value:
            continue
        found = _legacy_rule(key, value, legacy)
        if found is None:
            raise config_error(f"token_selection.{key}", value, f"{legacy[key]} (with token_selector="
                               f"{token_selector}, rule {rule})", f"no rule reads {key}={value} with {legacy}.")
        warnings.warn(f"actor_rollout_ref.actor.token_selection.{key}={value} is an earlier key: it now reads "
                      f"token_selection.rule={found}. Set that instead.", FutureWarning, stacklevel=3)
        rule = found
    return rule


def _shaping_of(value: Any) -> Any:
    """``token_selection.shaping``'s value, an earlier name mapped onto its shaping (and said so)."""
    for name, shaping in SHAPING_REGISTRY.items():
        if value in shaping.aliases:
            warnings.warn(f"actor_rollout_ref.actor.token_selection.shaping={value} is an earlier name: it now reads "
                          f"shaping={name}. Set that instead.", FutureWarning, stacklevel=4)
            return name
    return value


def _readers(key: str) -> str:
    where = [w for w, _ in knob_sources().get(key, [])]
    presets = [name for name, sel in PRESETS.items() if sel is not None and (
        f"rule {sel.rule}" in where or f"shaping {sel.shaping}" in where)]
    return " and ".join(where) + (f" (presets {', '.join(presets)})" if presets else "")


def apply_overrides(token_selector: str, base: Selection, given: dict[str, Any]) -> Selection:
    """``base`` (the preset ``token_selector``) with the user's knobs ``given``; a knob neither the shared config
    nor the rule nor its shaping reads is refused, naming who reads it."""
    given = dict(given)
    rule = _rule_of(token_selector, base, given)
    shaping = _shaping_of(given.pop("shaping", base.shaping))
    knobs_cls = RULE_REGISTRY[rule].Knobs
    rule_keys = {f.name for f in dataclasses.fields(knobs_cls)}
    ranking = {f.name for f in dataclasses.fields(Ranking)}
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
    if shaping != "none" and shaping not in SHAPING_REGISTRY:
        raise config_error("token_selection.shaping", shaping, ", ".join(("none", *SHAPING_REGISTRY)))
    sel = replace(base, rule=rule, knobs=knobs_cls(**knobs), shaping=shaping,
                  shaping_knobs=None if shaping_cls is None else shaping_cls(**shaped), **shared)
    for key in unread:  # after the rule validated the knobs it reads: their errors come first
        raise config_error(
            f"token_selection.{key}", given[key], f"null (with token_selector={token_selector}, rule {rule}, "
            f"shaping {shaping})", f"only {_readers(key) or 'no registered component'} reads it, so it would be "
            f"ignored. Fix: remove token_selection.{key} (a recipe may set it for its own preset: override it "
            f"with token_selection.{key}=null) or pick a preset that reads it.")
    return sel


def override(sel: Selection, **values: Any) -> Selection:
    """``sel`` with flat knobs replaced as ``token_selection.<knob>=value`` would replace them (the shared keys,
    ``rule``, the rule's and the shaping's knobs); a knob nobody reads is refused."""
    return apply_overrides("<selection>", sel, values)


def check_with_actor(
    sel: Selection,
    *,
    auto_enable_entropy: bool = True,
    loss_agg_mode: str = "token-mean",
    loss_mode: str = "vanilla",
    calculate_entropy: bool = False,
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_type: str = "low_var_kl",
) -> None:
    """The checks of a rule that need the actor's other settings (``actor_rollout_ref.actor.*``): the shared ones,
    then the rule's (:meth:`~verl_tokensel.core.rules.base.Rule.check_with_actor`)."""
    actor = ActorSettings(loss_agg_mode=loss_agg_mode, loss_mode=loss_mode, calculate_entropy=calculate_entropy,
                          entropy_coeff=entropy_coeff, use_kl_loss=use_kl_loss, kl_loss_type=kl_loss_type,
                          auto_enable_entropy=auto_enable_entropy)
    if sel.normaliser == "selected" and loss_agg_mode != "token-mean":
        raise config_error(
            "token_selection.normaliser", "selected",
            "all (with any loss_agg_mode), selected (only with loss_agg_mode=token-mean)",
            f"actor_rollout_ref.actor.loss_agg_mode is {loss_agg_mode!r}; a mean over selected tokens is only "
            "defined for token-mean. Fix: set token_selection.normaliser=all or loss_agg_mode=token-mean.")
    sel.impl.check_with_actor(sel, actor)
    reads_entropy = sel.score_needs_entropy or sel.shaping_needs_entropy
    if reads_entropy and not (calculate_entropy or entropy_coeff != 0 or auto_enable_entropy):
        raise config_error(
            "calculate_entropy", calculate_entropy, "true",
            f"token_selection.score={sel.knobs.score} / shaping={sel.shaping} reads the policy entropy, which the "
            "engine only computes when calculate_entropy=true or entropy_coeff != 0, and "
            "token_selection.auto_enable_entropy=false. Fix: set actor_rollout_ref.actor.calculate_entropy=true or "
            "token_selection.auto_enable_entropy=true.")


def knob_table_rows() -> list[tuple[str, str, str, str]]:
    """(name, default, paper value, meaning) for every knob, for the README table: the preset's default
    (``preset``) or the engine switch's; the meaning says which rule or shaping reads a knob of its own."""
    rows = [("token_selector", "none", "forking / gmts", "Preset: " + ", ".join(PRESETS) + ".")]
    for f in dataclasses.fields(TokenSelectionConfig):
        default = "preset" if f.default is None else str(f.default).lower()
        declared = [w for w in f.metadata.get("declared", []) if w not in ("shared", "ranking", "legacy")]
        prefix = f"{' / '.join(declared)}: " if declared else ""
        rows.append((f"token_selection.{f.name}", default, f.metadata["paper"], prefix + f.metadata["help"]))
    return rows


__all__ = ["ENGINE_SWITCHES", "LEGACY_KEYS", "NORMALISERS", "PRESETS", "SHARED_KEYS", "Selection",
           "TokenSelectionConfig", "TokenSelectionConfigError", "apply_overrides", "check_with_actor", "knob_sources",
           "knob_table_rows", "override", "preset", "register_preset", "resolve_selection"]
