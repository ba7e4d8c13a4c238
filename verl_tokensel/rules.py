"""Everything a token-rule author imports, in one module (pure torch, no verl import). The built-in rules import it
and nothing else of the project (but for helper modules that themselves import only it).

A rule is a function of one input that returns what the tokens get in the loss; it keeps every valid token unless it
says otherwise (a gate, its own selection, or :class:`Ranking` knobs)::

    from dataclasses import dataclass
    from verl_tokensel.rules import Knobs, LossTransform, knob, register_rule

    @dataclass(frozen=True)
    class SurpriseKnobs(Knobs):
        surprise_alpha: float = knob(0.5, "slope of the weight in -log p", "n/a", ge=0)

    @register_rule("surprise_weight", knobs=SurpriseKnobs)
    def surprise_weight(x) -> LossTransform:          # x: RuleInput, the micro-batch's tensors by name
        s = -x.log_prob.float()
        w = (1 + x.knobs.surprise_alpha * (s - s[x.tokens].mean())).clamp(0.5, 2.0)
        return LossTransform(advantage_weight=w, metrics={"mean_weight": w[x.tokens].mean()})

then ``actor_rollout_ref.actor.token_selector=surprise_weight`` and
``actor_rollout_ref.actor.token_selection.surprise_alpha=0.7`` on the command line (the module listed in
``VERL_USE_EXTERNAL_MODULES``). A preset (:func:`register_preset`) is optional: a named set of knob values.

The steps of a rule (:class:`Rule`: ``score``, ``select``, ``transform``, ``stats``, ``merge_passes``) each receive
one :class:`RuleInput` ``x``; ``check(c)``, run once when the config is resolved, receives the resolved config
(``c.knobs``, ``c.scope``, ``c.actor``, ...). Of the input, ``x.tokens`` are the tokens the rule may treat (valid,
finite inputs) and ``x.mask`` the tokens its selection kept (after ``select``; every one of ``x.tokens`` for a rule
that does not rank); a gate (``LossTransform(gate=...)``) narrows the gradient further, and the selection metrics
count both. What a rule needs from the pipeline (entropy, a pre-pass or the driver's pass, its own policy loss,
update passes, prompt groups, passes over the last hidden states: a :class:`HiddenStates`, per-token reductions over
the vocabulary in verl's old-log-prob pass or the update forward: :class:`VocabStat` s) is one :class:`Needs`; a
rule that declares a need and does not get it fails naming the need. A rule that ranks extends :class:`Ranking` (the
score, ratio, direction, pool and budget knobs); one that pools over the data-parallel ranks uses ``x.pool`` (a
:class:`Pool`); one whose per-token score the driver, the pre-pass or ``verl-tokensel view`` evaluates registers it
(:func:`register_score`). Errors in a check: ``raise config_error(key, value, valid, fix)``. ``verl-tokensel rules
<name>`` prints what a rule or preset resolves to; docs/rule-api.md lists every field.
"""

from __future__ import annotations

from typing import Any

from verl_tokensel.core.errors import config_error
from verl_tokensel.core.ranking.scores import register_score
from verl_tokensel.core.seam.hidden import HiddenStates
from verl_tokensel.core.seam.pool import Pool
from verl_tokensel.core.seam.knobs import Knobs, Ranking, knob
from verl_tokensel.core.seam.rule import LossTransform, Needs, Rule, RuleInput, register_rule
from verl_tokensel.core.seam.vocab import VocabStat


def register_preset(name: str, *, rule: str, **values: Any):
    """Add a ``token_selector`` preset ``name``: the registered ``rule`` with values of its knobs and of the shared
    keys (``scope``, ``score_source``, ``normaliser``, ``shaping=`` / ``shaping_knobs=``, ...); refuses to overwrite
    a name. The knobs it leaves out take their defaults; each can be set on the command line."""
    # the presets module imports the built-in rules, which import this module
    from verl_tokensel.core.resolve.presets import register_preset as add

    return add(name, rule=rule, **values)


__all__ = ["HiddenStates", "Knobs", "LossTransform", "Needs", "Pool", "Ranking", "Rule", "RuleInput", "config_error",
           "VocabStat", "knob", "register_preset", "register_rule", "register_score"]
