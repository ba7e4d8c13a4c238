"""The base of the rules that change each token's advantage by a quantity only its whole prompt group determines
(KTAE's key-token score, GTPO's conflict weights). Pure torch, no verl import."""

from __future__ import annotations

import torch

from verl_tokensel.rules import LossTransform, Needs, Rule, RuleInput


class GroupShiftRule(Rule):
    """A rule that changes each token's advantage by a quantity only the whole prompt group determines (KTAE's
    key-token score, GTPO's conflict weights): its own score computes the change on the driver (``score_source
    =rollout``, ``scope=group``), every token is kept, and the loss adds the measured score back to verl's
    advantages. Subclasses override :meth:`score` (and ``stats``); register with ``needs=group_shift_needs(name)``."""

    def select(self, x: RuleInput) -> torch.Tensor:
        return x.tokens.clone()

    def transform(self, x: RuleInput) -> LossTransform:
        if x.scores is None:
            raise RuntimeError(f"rule {self.name} adds the advantage change the driver measured to the loss's "
                               "advantages; none reached the loss")
        return LossTransform(advantage_shift=torch.where(x.tokens, x.scores, 0.0))


def group_shift_needs(name: str, **more) -> Needs:
    """What a :class:`GroupShiftRule` named ``name`` needs: its own score (registered as ``name``) measured on the
    driver over whole prompt groups, every token in the denominator."""
    return Needs(scores=(name,), sources={"rollout": ("group",)}, normalisers=("all",), prompt_groups=True, **more)


__all__ = ["GroupShiftRule", "group_shift_needs"]
