"""The built-in token rules, one module each, written with :mod:`verl_tokensel.rules` as a user's rule is.

Importing this package imports every module in it, which registers the built-in rules and shapings: a new rule is
one module here (and, optionally, its preset line in :mod:`~verl_tokensel.core.resolve.presets`). A rule module
imports, of this project, only :mod:`verl_tokensel.rules` and the helper modules named in :data:`HELPERS` (a
family's shared maths), which themselves import only it. The seam they are written against is
:mod:`verl_tokensel.core.seam`.
"""

import importlib
import pkgutil
import tomllib
from pathlib import Path

from verl_tokensel.core.seam.knobs import Knobs, Ranking, knob
from verl_tokensel.core.seam.rule import (
    RULE_REGISTRY,
    About,
    ActorSettings,
    LossTransform,
    Needs,
    Rule,
    RuleInput,
    register_rule,
)
from verl_tokensel.core.seam.shaping import SHAPING_REGISTRY, Shaping, register_shaping

#: modules of this package that hold what several rules share (not rules): each imports, of this project, only
#: verl_tokensel.rules; ``shaping`` holds the built-in advantage shapings
HELPERS = ("covariance", "group_shift", "maths", "ppo_clip")

#: where each built-in rule and shaping comes from, its formula and its deviations: one data file
PROVENANCE = Path(__file__).with_name("provenance.toml")

for _module in ("shaping", *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in HELPERS)):
    importlib.import_module(f"{__name__}.{_module}")


def _attach_provenance() -> None:
    """Each built-in rule's and shaping's ``about`` from :data:`PROVENANCE` (every one has an entry; a test holds
    the file and the registries to each other)."""
    data = tomllib.loads(PROVENANCE.read_text(encoding="utf-8"))
    for kind, registry in (("rule", RULE_REGISTRY), ("shaping", SHAPING_REGISTRY)):
        for name, entry in data.get(kind, {}).items():
            component = type(registry[name])
            component.about = About(source=entry["source"], formula=entry["formula"],
                                    deviations=tuple(entry["deviations"]))


_attach_provenance()

__all__ = ["HELPERS", "PROVENANCE", "RULE_REGISTRY", "SHAPING_REGISTRY", "ActorSettings", "Knobs", "LossTransform",
           "Needs", "Ranking", "Rule", "RuleInput", "Shaping", "knob", "register_rule", "register_shaping"]
