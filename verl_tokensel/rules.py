"""Everything a token-rule author imports, in one module (pure torch, no verl import).

A rule is a function of one input that returns what the selected tokens get in the loss::

    from dataclasses import dataclass
    from verl_tokensel.rules import Knobs, LossTransform, knob, register_preset, register_rule

    @dataclass(frozen=True)
    class SurpriseKnobs(Knobs):
        surprise_alpha: float = knob(0.5, "slope of the weight in -log p", "n/a", ge=0)

    @register_rule("surprise_weight", knobs=SurpriseKnobs)
    def surprise_weight(x) -> LossTransform:          # x: RuleInput, the micro-batch's tensors by name
        s = -x.log_prob.float()
        w = (1 + x.knobs.surprise_alpha * (s - s[x.tokens].mean())).clamp(0.5, 2.0)
        return LossTransform(advantage_weight=w, metrics={"mean_weight": w[x.tokens].mean()})

    register_preset("surprise_weight", rule="surprise_weight", score="all", ratio=1.0)

then ``actor_rollout_ref.actor.token_selection.surprise_alpha=0.7`` on the command line (the module listed in
``VERL_USE_EXTERNAL_MODULES``). A rule that scores, selects, checks or runs update passes its own way subclasses
:class:`Rule` (its steps ``score``, ``select``, ``transform``, ``stats``, ``check``, ``merge_passes`` each receive
one :class:`RuleInput`); what it needs from the pipeline (entropy, a pre-pass or the driver's pass, its own policy
loss, update passes, prompt groups, passes over the last hidden states: a :class:`HiddenStates`) is one
:class:`Needs`. Errors in a check: ``raise config_error(key, value, valid, fix)``. ``verl-tokensel rules <preset>``
prints what a preset resolves to.
"""

from verl_tokensel.core.errors import config_error
from verl_tokensel.core.presets import register_preset
from verl_tokensel.core.rules.base import Knobs, LossTransform, Needs, Rule, RuleInput, knob, register_rule
from verl_tokensel.core.rules.hidden import HiddenStates

__all__ = ["HiddenStates", "Knobs", "LossTransform", "Needs", "Rule", "RuleInput", "config_error", "knob",
           "register_preset", "register_rule"]
