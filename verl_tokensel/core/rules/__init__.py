"""The token rules, one module each, registered by name (:mod:`~verl_tokensel.core.rules.base` is the seam).

Importing this package registers the built-in rules and shapings; a rule in user code registers the same way
(``examples/custom_rule.py``).
"""

# the gradient mask registers first: the rule an earlier key (action=gradient, phases=one) maps back to
from verl_tokensel.core.rules import mask  # noqa: F401  # isort: split
from verl_tokensel.core.rules import archer, clip_cov, kl_cov, lopti, shaping, stapo  # noqa: F401  (register)
from verl_tokensel.core.rules.base import (
    RULE_REGISTRY,
    SHAPING_REGISTRY,
    ActorSettings,
    LossContext,
    LossTransform,
    Ranking,
    Rule,
    Shaping,
    knob,
    register_rule,
    register_shaping,
)

__all__ = ["RULE_REGISTRY", "SHAPING_REGISTRY", "ActorSettings", "LossContext", "LossTransform", "Ranking", "Rule",
           "Shaping", "knob", "register_rule", "register_shaping"]
