"""The ranked gradient masks: only the selected tokens keep the policy gradient. Pure torch, no verl import.

The 80/20 rule's forking tokens (top 20% entropy, arXiv 2506.01939) and its controls (bottom 80%, random 20%),
GMTS (top 20% of H * |omega| per prompt group, arXiv 2608.30632), the logit-gradient norm, and the score that ranks
nothing (``all``: every token, under a shaping or a rule's update passes). Its knobs are :class:`Ranking`'s; the
selection and the gradient gate are the :class:`~verl_tokensel.rules.Rule` defaults.
"""

from __future__ import annotations

from verl_tokensel.rules import Ranking, Rule, register_rule


@register_rule("gradient_mask", knobs=Ranking)
class GradientMask(Rule):
    """Rank ``score`` over the scope, keep the policy gradient on the selected tokens only."""


__all__ = ["GradientMask"]
