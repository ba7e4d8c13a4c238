"""Advantage shapings: per-token reweighting, no ranking, run before the rule (``token_selection.shaping``). Pure
torch, no verl import.

- ``ar``, Advantage Reweighting (Yang et al., "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
  arXiv 2505.12929; released code zhyang2226/AR-Lopti, ``ray_trainer.py``, ``reweight_method=both_linear_normal``):
  ``A'_t = (alpha * pi_old(o_t) + 1 - alpha) * A_t``, ``pi_old = exp(old_log_prob)`` of the sampled token (a
  constant: no gradient). The released code applies it once per step on the driver; the weight reads only the old
  log-prob, so applying it in each micro-batch's loss gives the same numbers.
- ``entropy_adv`` (Cheng et al., "Reasoning with Exploration: An Entropy Perspective",
  arXiv 2506.14758, Sec. 3.2, Eq. 5-6): ``A'_t = A_t + min(alpha * H_t.detach(), |A_t| / kappa)``, ``H_t`` the
  current policy's entropy at the token (the update pass's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from verl_tokensel.core.errors import check_number, config_error
from verl_tokensel.core.rules.base import About, LossTransform, Needs, RuleInput, knob


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




def ar_weight(old_log_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """AR's per-token factor ``alpha * exp(old_log_prob) + 1 - alpha`` (float32, in [1 - alpha, 1])."""
    return (alpha * torch.exp(old_log_prob.detach().float()) + (1.0 - alpha)).float()


def entropy_shift(advantages: torch.Tensor, entropy: torch.Tensor, alpha: float, kappa: float) -> torch.Tensor:
    """The entropy term ``min(alpha * H.detach(), |A| / kappa)`` added to the advantage (float32, >= 0)."""
    adv = advantages.detach().float()
    return torch.minimum(alpha * entropy.detach().float(), adv.abs() / kappa)


@dataclass(frozen=True)
class ARKnobs:
    ar_alpha: float = knob(0.3, "alpha in [0, 1] of A * (alpha * pi_old + 1 - alpha).",
                           "0.3 (K&K figure, AR-Lopti script); 0.2 (AR-only script); 0.1 (math table)")

    def __post_init__(self) -> None:
        check_number("token_selection.ar_alpha", self.ar_alpha, 0.0, 1.0, "a number in [0, 1]")


AR_DEVIATIONS = (
    "The factor is applied in each micro-batch's loss, not once per step on the driver: the same numbers (it reads "
    "only the old log-prob), with any driver and any rule's mask.",
)


@register_shaping("ar", knobs=ARKnobs,
                  source='AR, Advantage Reweighting (Yang et al., "Do Not Let Low-Probability Tokens Over-Dominate in '
                         'RL for LLMs", arXiv 2505.12929; released code zhyang2226/AR-Lopti, ray_trainer.py, '
                         "reweight_method=both_linear_normal)",
                  formula="A'_t = (ar_alpha * pi_old(o_t) + 1 - ar_alpha) * A_t",
                  deviations=AR_DEVIATIONS)
class AdvantageReweighting(Shaping):
    """A * (ar_alpha * pi_old + 1 - ar_alpha)"""

    source = "AR, arXiv 2505.12929"

    def shape(self, x, advantages):
        if x.old_log_prob is None:
            raise ValueError("shaping=ar needs the old log-probs of the sampled tokens")
        return ar_weight(x.old_log_prob, x.knobs.ar_alpha), None

    def stats(self, x):
        if not x.tokens.any():
            return {}
        return {"mean_weight": float(ar_weight(x.old_log_prob, x.knobs.ar_alpha)[x.tokens].mean())}


@dataclass(frozen=True)
class EntropyKnobs:
    entropy_alpha: float = knob(0.4, "alpha of min(alpha * H, |A| / kappa).", "0.4 (GRPO); 0.1 (PPO)")
    entropy_kappa: float = knob(2.0, "kappa > 1 of min(alpha * H, |A| / kappa); the shaped advantage keeps its sign.",
                                "2")

    def __post_init__(self) -> None:
        check_number("token_selection.entropy_alpha", self.entropy_alpha, 0.0, None, "a number >= 0")
        check_number("token_selection.entropy_kappa", self.entropy_kappa, 1.0, None, "a number > 1")
        if self.entropy_kappa <= 1.0:
            raise config_error("token_selection.entropy_kappa", self.entropy_kappa, "a number > 1",
                               "kappa > 1 keeps the shaped advantage's sign (the paper's condition; its value is 2).")


ENTROPY_ADV_DEVIATIONS = (
    "H is each micro-batch's update-pass entropy, and where a token's loss inputs are not finite the shift is 0: the "
    "paper's current policy; dropped tokens never reach the loss.",
)


@register_shaping("entropy_adv", knobs=EntropyKnobs, needs=Needs(entropy=True),
                  source='Cheng et al., "Reasoning with Exploration: An Entropy Perspective", arXiv 2506.14758, Sec. '
                         "3.2, Eq. 5-6 (no released code)",
                  formula="A'_t = A_t + min(entropy_alpha * H_t.detach(), |A_t| / entropy_kappa), H_t the update "
                          "pass's entropy",
                  deviations=ENTROPY_ADV_DEVIATIONS)
class EntropyShaping(Shaping):
    """A + min(entropy_alpha * H, |A| / entropy_kappa), H the update pass's entropy, detached"""

    source = "arXiv 2506.14758"

    def shape(self, x, advantages):
        entropy, knobs = x.entropy, x.knobs
        if entropy is None:
            raise ValueError(f"shaping={self.name} needs the policy entropy of the update pass: set "
                             "actor_rollout_ref.actor.calculate_entropy=True (or token_selection.auto_enable_entropy)")
        return None, entropy_shift(advantages, entropy, knobs.entropy_alpha, knobs.entropy_kappa)

    def stats(self, x):
        shift, tokens = x.transform.advantage_shift, x.tokens
        if not tokens.any() or shift is None:
            return {}
        out = {"mean_shift": float(shift[tokens].mean())}
        if x.advantages is not None:
            capped = (shift < x.knobs.entropy_alpha * x.entropy.float()) & tokens
            out["capped_share"] = float(capped.sum()) / int(tokens.sum())
        return out


__all__ = ["SHAPING_REGISTRY", "ARKnobs", "AdvantageReweighting", "EntropyKnobs", "EntropyShaping", "Shaping",
           "ar_weight", "entropy_shift", "register_shaping"]
