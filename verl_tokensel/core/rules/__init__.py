"""The token rules, one module each, registered by name (:mod:`~verl_tokensel.core.rules.base` is the seam).

Importing this package imports every module in it, which registers the built-in rules and shapings: a new rule
is one module here (and its preset line in :mod:`~verl_tokensel.core.presets`). A rule in user code registers the
same way, importing :mod:`verl_tokensel.rules` (``examples/custom_rule.py``).
"""

import importlib
import pkgutil

from verl_tokensel.core.rules.base import (
    RULE_REGISTRY,
    ActorSettings,
    Knobs,
    LossTransform,
    Needs,
    Rule,
    RuleInput,
    knob,
    register_rule,
)
from verl_tokensel.core.rules.shaping import SHAPING_REGISTRY, Shaping, register_shaping

#: modules of this package that hold helpers shared by rules, not rules
HELPERS = ("base", "checks", "covariance", "group_shift", "hidden", "ppo_clip", "shaping")

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in HELPERS):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["RULE_REGISTRY", "SHAPING_REGISTRY", "ActorSettings", "Knobs", "LossTransform", "Needs", "Rule",
           "RuleInput", "Shaping", "knob", "register_rule", "register_shaping"]
