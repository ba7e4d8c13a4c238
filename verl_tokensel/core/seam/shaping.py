"""Advantage shapings: the base and the registry (``token_selection.shaping``). Pure torch, no verl import.

A shaping is a smaller component of a rule's kind with one job, the advantages' affine map ``A' = weight * A +
shift`` on every token, nothing ranked; it runs before any rule (AR's factor ahead of Lopti's passes), so a score that
reads the advantage ranks by the shaped one. The built-in shapings are in :mod:`verl_tokensel.core.rules.shaping`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Optional

import torch

from verl_tokensel.core.seam.rule import About, LossTransform, Needs, RuleInput


class Shaping:
    """An advantage shaping: ``A' = weight * A + shift`` on every token, nothing ranked. Runs before the rule
    (``token_selection.shaping``), so a score that reads the advantage (omega) ranks by the shaped one.
    Register with :func:`register_shaping`; its knobs are a frozen dataclass of its own (``x.knobs``)."""

    name: ClassVar[str] = ""
    Knobs: ClassVar[type] = type(None)
    needs: ClassVar[Needs] = Needs()
    #: where it comes from (paper, released code), for the knob docs
    source: ClassVar[str] = ""

    def shape(self, x: RuleInput, advantages: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(weight, shift)`` on every token (None where it leaves A as is)."""
        raise NotImplementedError

    def transform(self, x: RuleInput, tokens: torch.Tensor) -> LossTransform:
        """The shaping as a transform; off ``tokens`` (padding, dropped tokens) A stays as is, so a NaN input
        there never reaches a masked sum."""
        adv = x.advantages if x.advantages is not None else torch.zeros_like(x.log_prob)
        weight, shift = self.shape(x, adv)
        return LossTransform(advantage_weight=None if weight is None else torch.where(tokens, weight, 1.0),
                             advantage_shift=None if shift is None else torch.where(tokens, shift, 0.0))

    def stats(self, x: RuleInput) -> dict[str, float]:
        """Its own metrics (keys without the ``tokensel/`` prefix; ``x.tokens`` and ``x.transform`` set)."""
        return {}


SHAPING_REGISTRY: dict[str, Shaping] = {}


def register_shaping(name: str, *, knobs: type, needs: Optional[Needs] = None, source: str = "", formula: str = "",
                     deviations: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator: register a :class:`Shaping` subclass as ``name`` (a ``token_selection.shaping`` value) with
    its ``knobs`` (a frozen dataclass of :func:`knob` fields), ``needs`` and what the docs say of it (as
    :func:`register_rule`); refuses to overwrite a name."""

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Shaping)):
            raise TypeError(f"register_shaping({name!r}) needs a subclass of Shaping, got {cls!r}")
        if name in SHAPING_REGISTRY or name == "none":
            raise ValueError(f"shaping {name!r} is already registered; pick another name")
        if not dataclasses.is_dataclass(knobs):
            raise TypeError(f"shaping {name!r}: knobs must be a dataclass")
        cls.name, cls.Knobs, cls.needs = name, knobs, needs if needs is not None else Needs()
        cls.about = About(source=source or cls.source, formula=formula, deviations=tuple(deviations))
        SHAPING_REGISTRY[name] = cls()
        return cls

    return deco


__all__ = ["SHAPING_REGISTRY", "Shaping", "register_shaping"]
