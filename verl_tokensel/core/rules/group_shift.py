"""The base of the rules that change each token's advantage by a quantity only its whole prompt group determines
(KTAE's key-token score, GTPO's conflict weights). Pure torch, no verl import."""

from __future__ import annotations

from typing import Any

import torch

from verl_tokensel.core.errors import config_error
from verl_tokensel.core.rules.base import LossTransform, Needs, Rule, RuleInput


class GroupShiftRule(Rule):
    """A rule that changes each token's advantage by a quantity only the whole prompt group determines (KTAE's
    key-token score, GTPO's conflict weights): its own score computes the change on the driver (``score_source
    =rollout``, ``scope=group``), every token is kept, and the loss adds the measured score back to verl's
    advantages. Subclasses override :meth:`score` (and ``stats``); register with ``needs=GROUP_SHIFT``."""

    def check(self, c: Any) -> None:
        if c.knobs.score != self.name:
            raise config_error("token_selection.score", c.knobs.score, f"{self.name} (with token_selector's rule "
                               f"{self.name})", f"rule {self.name} sets each token's advantage itself; it ranks "
                               "nothing.")

    def select(self, x: RuleInput) -> torch.Tensor:
        return x.tokens.clone()

    def transform(self, x: RuleInput) -> LossTransform:
        if x.scores is None:
            raise RuntimeError(f"rule {self.name} adds the advantage change the driver measured to the loss's "
                               "advantages; none reached the loss")
        return LossTransform(advantage_shift=torch.where(x.tokens, x.scores, 0.0))


#: what a :class:`GroupShiftRule` needs: the driver's whole prompt groups, every token in the denominator
GROUP_SHIFT = Needs(sources={"rollout": ("group",)}, normalisers=("all",), prompt_groups=True)


__all__ = ["GROUP_SHIFT", "GroupShiftRule"]
