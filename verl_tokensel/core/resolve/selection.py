"""The shared selection config: a rule, its knobs, and what every rule shares. No verl import.

:class:`Selection` is a fully resolved rule: the registered rule's name and its knobs (a dataclass of the rule's
own, :mod:`~verl_tokensel.core.rules`), an optional advantage shaping run before it, and the keys every rule
shares: when the scores are measured, the scope pooled over, the loss's denominator, the seed and the masks of the
entropy and KL terms. It checks each of its keys in ``__post_init__``; the checks across keys run once per resolution
(:func:`~verl_tokensel.core.seam.checks.validate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_tokensel.core.errors import check_bool, check_choice, config_error
from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY, Ranking, Rule, Shaping
from verl_tokensel.core.ranking.scopes import SCOPES, SCORE_SOURCES, SOURCE_SCOPES
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY, ScoreSpec

# the token-mean denominator: all valid tokens; each micro-batch's selected tokens (80/20 code); or the selected
# (kept) tokens of the whole mini-batch, which then are the loss's only tokens (STAPO's renormalisation)
NORMALISERS = ("all", "selected", "kept")


def _shared(default: Any, help: str, paper: str) -> Any:
    return field(default=default, metadata={"help": help, "paper": paper})


@dataclass(frozen=True)
class Selection:
    """A fully resolved selection rule (a preset, possibly with overrides)."""

    rule: str = field(metadata={"help": "The token rule (a registered rule; the preset sets it).", "paper": "n/a"})
    knobs: Any = field(metadata={"help": "The rule's knobs (its Knobs dataclass).", "paper": "n/a"})
    score_source: str = _shared(
        "current", f"When the scores are measured: one of {', '.join(SCORE_SOURCES)}. current = in the update "
        "forward of each micro-batch; prepass = a no-grad forward at the start of each PPO mini-batch; rollout = "
        "verl's old-log-prob pass, mask computed on the driver.",
        "rollout (80/20 paper), current (80/20 code), prepass (GMTS)")
    scope: str = _shared(
        "micro_batch", f"Pool the budget is taken from: one of {', '.join(SCOPES)}. micro_batch_dp and mini_batch are "
        "exact over all data-parallel ranks; group = the responses sharing a prompt (uid); batch = the whole "
        "training batch of a step. Each score_source allows: "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in SOURCE_SCOPES.items()) + ".",
        "batch (80/20 paper), micro_batch (80/20 code), group (GMTS)")
    normaliser: str = _shared(
        "all", "Token-mean denominator: all valid tokens (paper formula); each micro-batch's selected tokens, the "
        "micro-batch weighted by its share of the mini-batch's responses (80/20 released code; needs "
        "loss_agg_mode=token-mean); or kept = the selected tokens of the whole mini-batch over all ranks, which are "
        "then the loss's only tokens (score_source=prepass).",
        "all (80/20 paper, GMTS); selected (80/20 code); kept (STAPO)")
    seed: int = _shared(
        0, "Seed of the random draws (the random score, a rule's keyed draw); a token's draw depends only on (seed, "
        "the token ids of its prompt and response, its position), so every rank, micro-batch split and rerun draws the "
        "same.", "n/a")
    mask_entropy_bonus: bool = _shared(False, "Apply the mask to the entropy bonus (entropy_coeff) too.",
                                       "false (80/20 code used all tokens)")
    mask_kl_loss: bool = _shared(False, "Apply the mask to the KL loss (use_kl_loss) too.",
                                 "false (80/20 code, GMTS, TRL keep KL on all tokens)")
    ref_model_path: Optional[str] = _shared(
        None, "Local HF checkpoint whose per-token entropy the ref_entropy score ranks by (computed on the driver, "
        "score_source=rollout); null = actor_rollout_ref.model.path.",
        "the base model (80/20: > 86% top-20% overlap of base and RL model)")
    shaping: str = _shared(
        "none", "Advantage shaping before the rule (and before a score that reads the advantage): none or a "
        "registered shaping (" + "; ".join(f"{name} = {(s.__doc__ or '').strip()}" for name, s in
                                           SHAPING_REGISTRY.items()) + ").",
        "; ".join(f"{name} ({s.source})" for name, s in SHAPING_REGISTRY.items()))
    shaping_knobs: Any = _shared(None, "The shaping's knobs (its Knobs dataclass), None without one.", "n/a")

    def __post_init__(self) -> None:
        """Each key's own type and values (the checks across keys are one pass,
        :func:`~verl_tokensel.core.seam.checks.validate`, run once per resolution). Errors name the
        ``token_selection`` key, its valid values and the fix."""
        check_choice("token_selection.rule", self.rule, tuple(RULE_REGISTRY))
        knobs_cls = self.impl.Knobs
        if type(self.knobs) is not knobs_cls:
            raise TypeError(f"rule {self.rule!r} needs knobs of type {knobs_cls.__name__}, got "
                            f"{type(self.knobs).__name__}")
        check_choice("token_selection.scope", self.scope, SCOPES)
        check_choice("token_selection.score_source", self.score_source, SCORE_SOURCES)
        check_choice("token_selection.normaliser", self.normaliser, NORMALISERS)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise config_error("token_selection.seed", self.seed, "an integer >= 0")
        check_bool("token_selection.mask_entropy_bonus", self.mask_entropy_bonus)
        check_bool("token_selection.mask_kl_loss", self.mask_kl_loss)
        if self.ref_model_path is not None and (not isinstance(self.ref_model_path, str) or not self.ref_model_path):
            raise config_error("token_selection.ref_model_path", self.ref_model_path,
                               "null or a local checkpoint folder")
        check_choice("token_selection.shaping", self.shaping, ("none", *SHAPING_REGISTRY))
        if self.shaping == "none" and self.shaping_knobs is not None:
            raise TypeError("shaping=none takes no shaping_knobs")
        if self.shaping != "none" and type(self.shaping_knobs) is not self.shaper.Knobs:
            raise TypeError(f"shaping {self.shaping!r} needs knobs of type {self.shaper.Knobs.__name__}")

    def as_knobs(self) -> dict[str, Any]:
        """The flat knob view (``token_selection``'s namespace): the rule, the shared keys, the rule's and the
        shaping's knobs, for reports and logs."""
        out = {"rule": self.rule, **dataclasses.asdict(self.knobs)}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("rule", "knobs", "shaping_knobs")})
        if self.shaping_knobs is not None:
            out.update(dataclasses.asdict(self.shaping_knobs))
        return out

    @property
    def impl(self) -> Rule:
        """The registered rule."""
        return RULE_REGISTRY[self.rule]

    @property
    def shaper(self) -> Optional[Shaping]:
        """The registered shaping, or None."""
        return None if self.shaping == "none" else SHAPING_REGISTRY[self.shaping]

    @property
    def score_specs(self) -> tuple[ScoreSpec, ...]:
        """The registered scores the rule evaluates."""
        return tuple(SCORE_REGISTRY[name] for name in self.scores)

    @property
    def score(self) -> str:
        """The score the rule is measured by: its ranking's (``Ranking`` knobs), else the first its ``Needs``
        names, else ``all`` (a rule that keeps every token)."""
        if isinstance(self.knobs, Ranking):
            return self.knobs.score
        return self.impl.needs.scores[0] if self.impl.needs.scores else "all"

    @property
    def ratio(self) -> float:
        """The budget of a ranking rule (1: a rule that keeps every token)."""
        return self.knobs.ratio if isinstance(self.knobs, Ranking) else 1.0

    @property
    def scores(self) -> tuple[str, ...]:
        """The registered scores the rule evaluates: its score and those its ``Needs`` names."""
        return tuple(dict.fromkeys((self.score, *self.impl.needs.scores)))

    @property
    def score_needs_entropy(self) -> bool:
        """The pass that scores (the update pass for ``score_source=current``) needs the policy entropy."""
        return self.impl.needs.entropy or any(s.needs_entropy for s in self.score_specs)

    @property
    def shaping_needs_entropy(self) -> bool:
        """The update pass needs the entropy whatever the score source (a shaping that reads it)."""
        return self.shaper is not None and self.shaper.needs.entropy

    @property
    def uses_sum_pi_squared(self) -> bool:
        """A score is exact with the engine's sum_j p_j^2 (the pass that scores should ask for it)."""
        return any(s.uses_sum_pi_squared for s in self.score_specs)

    @property
    def needs_rollout_log_probs(self) -> bool:
        """A score reads the rollout engine's log-probs (``rollout_log_probs`` of the update batch)."""
        return any(s.needs_rollout_log_probs for s in self.score_specs)

    @property
    def score_reads_policy(self) -> bool:
        """A score reads the scored policy's values; False: only fields fixed before the update (the pre-pass
        then needs no forward)."""
        return any(s.reads_policy for s in self.score_specs)

    @property
    def needs_external(self) -> tuple[str, ...]:
        """The external per-token fields a score reads (only the driver fills them)."""
        return tuple(dict.fromkeys(name for s in self.score_specs for name in s.needs_external))

    @property
    def needs_row_keys(self) -> bool:
        return any(s.needs_row_keys for s in self.score_specs)

    @property
    def update_passes(self) -> tuple[Optional[int], ...]:
        """The driver's update passes per step (``(None,)``: verl's one)."""
        n = self.impl.needs.passes
        return (None,) if n == 1 else tuple(range(1, n + 1))


__all__ = ["NORMALISERS", "Selection"]
