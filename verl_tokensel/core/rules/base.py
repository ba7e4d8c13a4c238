"""The rule seam. Pure torch, no verl import.

A token rule is a class registered by name (:func:`register_rule`, refusing to overwrite) that owns:

- its knobs: a frozen dataclass extending :class:`Ranking` (which tokens the rule treats: every rule ranks or
  keeps tokens the same way) with the rule's own fields, each with help text, default and paper value in its
  metadata, validated in ``__post_init__``;
- what it needs and supports: the score sources and scopes it runs at, its normalisers, whether it computes the
  policy loss itself, its update passes (Lopti's two), the entropy it reads; the driver-side checks ask the rule;
- how it selects (:meth:`Rule.score` then :meth:`Rule.select`) and what the selected tokens get in the loss: one
  :class:`LossTransform` (:meth:`Rule.transform`), applied as it is by the loss;
- its metrics (:meth:`Rule.stats`, under ``tokensel/<rule name>/``).

An advantage shaping (:func:`register_shaping`) is a smaller component of the same kind with one job, the
advantages' affine map; it runs before any rule (``token_selection.shaping``): AR's factor ahead of Lopti's passes.
A rule in user code is one class and one :func:`~verl_tokensel.core.presets.register_preset` call
(``examples/custom_rule.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from verl_tokensel.core.errors import check_choice, config_error
from verl_tokensel.core.rules.checks import check_ranking, check_score_with_actor
from verl_tokensel.core.scopes import DIRECTIONS, POOLS, SOURCE_SCOPES, invalid_rule_arg
from verl_tokensel.core.scores import SCORE_REGISTRY
from verl_tokensel.core.select import above_quantile, select_tokens

if TYPE_CHECKING:  # pragma: no cover
    from verl_tokensel.core.batch import ScoreBatch

#: the shared config, :class:`verl_tokensel.core.selection.Selection` (not imported: it imports the rules)
Selection = Any

# How many tokens a ranking selects: count = ceil(ratio * N) of the scope's pool; quantile = those strictly above
# the (1 - ratio) quantile of their response (scope sequence) or micro-batch, linear interpolation (Archer's
# per-response 0.8 entropy quantile)
BUDGETS = ("count", "quantile")
#: policy_loss.loss_mode values a rule that computes the policy loss itself accepts (its maths keeps verl's)
OWN_LOSS_MODES = ("vanilla", "tokensel_ppo_clip")


def knob(default: Any, help: str, paper: str) -> Any:
    """A rule knob: its default, its help text and the paper's value (read by the YAML, the README table and
    ``verl-tokensel`` docs; one source for each knob's meaning)."""
    return field(default=default, metadata={"help": help, "paper": paper})


@dataclass(frozen=True)
class Ranking:
    """Which tokens a rule treats: a registered score ranked over the scope's pool (or kept whole, for a score
    that ranks nothing). The base of every rule's knobs."""

    score: str = knob("entropy", "Per-token ranking score: a registered score (verl-tokensel view lists them).",
                      "entropy (80/20); gmts (GMTS)")
    ratio: float = knob(0.2, "Fraction of the scope's valid tokens the rule selects, in (0, 1]; exactly "
                        "ceil(ratio*N) tokens (the covariance rules' own scores: max(1, int(ratio*N)), verl's).",
                        "0.2 (80/20 and GMTS); 2e-4 (verl's KL-Cov / Clip-Cov)")
    direction: str = knob("top", "Keep the highest (top) or lowest (bottom) scores.",
                          "top; bottom for the 80/20 negative control")
    pool: str = knob("valid", f"Tokens of the scope the budget is a fraction of: {' or '.join(POOLS)}. valid = "
                     "every valid response token; nonzero = only tokens whose score is not exactly 0 (the released "
                     "GMTS code, whose padding filter also drops clipped tokens and zero-advantage groups).",
                     "valid (80/20; GMTS paper: a fraction of the responses' tokens); nonzero (GMTS code)")
    budget: str = knob("count", f"How many tokens the rule selects: one of {', '.join(BUDGETS)}. count = "
                       "ceil(ratio*N) of the scope's pool; quantile = the tokens strictly above the (1 - ratio) "
                       "quantile of their response (scope sequence) or micro-batch, linear interpolation.",
                       "count; quantile (Archer: per-response 0.8 quantile)")

    def __post_init__(self) -> None:
        check_choice("token_selection.score", self.score, tuple(SCORE_REGISTRY))
        bad = invalid_rule_arg(self.ratio, self.direction, "micro_batch", self.pool)
        if bad is not None and bad[0] == "ratio":
            raise config_error("token_selection.ratio", self.ratio, bad[2])
        check_choice("token_selection.direction", self.direction, DIRECTIONS)
        check_choice("token_selection.pool", self.pool, POOLS)
        check_choice("token_selection.budget", self.budget, BUDGETS)


@dataclass
class LossTransform:
    """What a rule does to verl's loss on one micro-batch; every tensor is ``(batch, response_len)``.

    Attributes:
        gate: bool, the tokens that keep the policy gradient (``where(gate, log_prob, log_prob.detach())``);
            None: every token keeps it.
        advantage_weight / advantage_shift: ``A' = weight * A + shift`` before the policy loss (None: as is).
        kl_weight / entropy_weight: per-token factors of the KL-loss and entropy-bonus terms (None: 1).
        policy_loss: the name of a per-token policy loss the rule needs
            (:data:`verl_tokensel.verl_glue.policy_loss.RULE_POLICY_LOSSES`) and ``policy_loss_args``, its
            per-token keyword arguments; None: verl's configured ``loss_mode``.
        token_loss: a policy loss of the rule's own, in its module (pure torch): ``token_loss(old_log_prob,
            log_prob, advantages, response_mask, *, clip_low, clip_high, clip_ratio_c) -> (pg_losses, metrics)``,
            the per-token losses ``(batch, response_len)`` and float metrics (verl's names, ``actor/pg_clipfrac``
            ..., or ``tokensel/<rule>/...``); the loss aggregates them with verl's ``agg_loss`` and the rollout
            importance weights. The clip bounds are the actor's. At most one of ``policy_loss`` / ``token_loss``.
    """

    gate: Optional[torch.Tensor] = None
    advantage_weight: Optional[torch.Tensor] = None
    advantage_shift: Optional[torch.Tensor] = None
    kl_weight: Optional[torch.Tensor] = None
    entropy_weight: Optional[torch.Tensor] = None
    policy_loss: Optional[str] = None
    policy_loss_args: dict[str, Any] = field(default_factory=dict)
    token_loss: Optional[Callable[..., tuple[torch.Tensor, dict[str, float]]]] = None

    def __post_init__(self) -> None:
        if self.policy_loss is not None and self.token_loss is not None:
            raise ValueError("a LossTransform names a policy loss or carries its own token_loss, not both")

    def after(self, first: Optional["LossTransform"]) -> "LossTransform":
        """This transform applied after ``first`` (a shaping): the affine maps of A composed (``w (w1 A + s1) +
        s``), the factors multiplied; gate and policy loss are this one's."""
        if first is None:
            return self
        w1, s1 = first.advantage_weight, first.advantage_shift
        w, s = self.advantage_weight, self.advantage_shift
        weight = w1 if w is None else (w if w1 is None else w1 * w)
        shift = s1 if w is None or s1 is None else s1 * w
        shift = s if shift is None else (shift if s is None else shift + s)
        return dataclasses.replace(self, advantage_weight=weight, advantage_shift=shift,
                                   kl_weight=_product(first.kl_weight, self.kl_weight),
                                   entropy_weight=_product(first.entropy_weight, self.entropy_weight))


def _product(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return b if a is None else (a if b is None else a * b)


@dataclass(frozen=True)
class LossContext:
    """The loss's normalisation of one micro-batch, for a rule whose weights depend on it.

    Attributes:
        update_pass: the driver's update pass (a rule's :meth:`Rule.update_passes`; None: the one pass).
        denominator: the token-mean denominator of verl's loss (``batch_num_tokens``, over all ranks); None
            outside the loss (the micro-batch alone then is the whole).
        global_rows: the mini-batch's responses over all ranks (``global_batch_size``); None as above.
        loss_agg_mode: the actor's ``loss_agg_mode`` (verl's aggregation of every term).
        scores: ``(batch, response_len)`` float32, the scores the rule step ranked by (for a selection measured
            before the update, the driver's or the pre-pass's, as they arrive with the micro-batch; NaN on dropped
            tokens): a rule that computes a per-token quantity where the whole group is (the driver) carries it
            in its score and reads it back here. Set by :func:`~verl_tokensel.core.rule.apply_rule`.
    """

    update_pass: Optional[int] = None
    denominator: Optional[float] = None
    global_rows: Optional[int] = None
    loss_agg_mode: str = "token-mean"
    scores: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class ActorSettings:
    """The actor settings (``actor_rollout_ref.actor.*``) a rule's checks may need; defaults: verl's."""

    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"
    calculate_entropy: bool = False
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    auto_enable_entropy: bool = True


class Rule:
    """A token rule. Subclass, set :attr:`Knobs`, override what differs, register with :func:`register_rule`.

    The base is the ranked gradient mask: :meth:`select` ranks ``knobs.score`` over the scope (or keeps every
    token for a score that ranks nothing) and :meth:`transform` keeps the policy gradient on the selected tokens.
    """

    #: set by :func:`register_rule`; also the metric group (``tokensel/<name>/...``)
    name: ClassVar[str] = ""
    #: the rule's knobs (a frozen dataclass extending :class:`Ranking`)
    Knobs: ClassVar[type] = Ranking
    #: score source -> the scopes the rule can pool at from it
    source_scopes: ClassVar[dict[str, tuple[str, ...]]] = SOURCE_SCOPES
    #: the token-mean denominators it allows (``token_selection.normaliser``)
    normalisers: ClassVar[tuple[str, ...]] = ("all", "selected", "kept")
    #: it computes the policy loss itself (``loss_mode`` must be one of :data:`OWN_LOSS_MODES`)
    own_policy_loss: ClassVar[bool] = False
    #: what the earlier keys ``token_selection.action`` / ``phases`` read for this rule (they map onto the rule)
    legacy: ClassVar[dict[str, str]] = {"action": "gradient", "phases": "one"}

    # --- what it needs -------------------------------------------------------------------------------------
    def scores(self, sel: "Selection") -> tuple[str, ...]:
        """The registered scores it evaluates (their inputs are prepared: row keys, sum p^2, external fields)."""
        return (sel.knobs.score,)

    def needs_entropy(self, sel: "Selection") -> bool:
        """It reads the policy entropy of the pass that scores (the update pass for ``score_source=current``)."""
        return any(SCORE_REGISTRY[s].needs_entropy for s in self.scores(sel))

    def needs_kl_loss(self, knobs: Any) -> bool:
        """It weights the KL loss per token, so it needs ``use_kl_loss`` on."""
        return False

    def update_passes(self, knobs: Any) -> tuple[Optional[int], ...]:
        """The driver's update passes per step (each a whole actor update); ``(None,)``: verl's one."""
        return (None,)

    def merge_pass_metrics(self, knobs: Any, per_pass: list[dict[str, Any]]) -> dict[str, Any]:
        """The step's metrics from those of each update pass (only for a rule with several)."""
        raise NotImplementedError(f"rule {self.name!r} has one update pass")

    # --- checks --------------------------------------------------------------------------------------------
    def check(self, sel: "Selection") -> None:
        """Checks of the knobs with the shared config (scope, score source, normaliser). Raise
        :class:`~verl_tokensel.core.errors.TokenSelectionConfigError` naming the key."""
        check_ranking(sel, self)

    def check_with_actor(self, sel: "Selection", actor: ActorSettings) -> None:
        """Checks that need the actor's other settings."""
        check_score_with_actor(sel, actor)
        if self.own_policy_loss and actor.loss_mode not in OWN_LOSS_MODES:
            raise config_error(
                "policy_loss.loss_mode", actor.loss_mode, f"{', '.join(OWN_LOSS_MODES)} (with token_selector's rule "
                f"{self.name})", f"rule {self.name} computes the policy loss itself (verl's maths with the rule's "
                "per-token outputs), so it cannot also run loss_mode's. Fix: set "
                "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla (verl's default)."
                + (f" The preset already is the global version of verl's loss_mode={actor.loss_mode}."
                   if actor.loss_mode == self.name else ""))

    # --- selection -----------------------------------------------------------------------------------------
    def score(self, sel: "Selection", batch: "ScoreBatch") -> Optional[torch.Tensor]:
        """Step 1: the scores before the pool is known (a NaN score drops its token), or None for a rule that
        scores inside :meth:`select` (over the pool of finite tokens: the covariance's means, a quantile)."""
        if not SCORE_REGISTRY[sel.knobs.score].ranks:
            return None
        return batch.score(sel.knobs.score)

    def select(self, sel: "Selection", batch: "ScoreBatch", scores: Optional[torch.Tensor], pool: torch.Tensor, *,
               ratio: float, scope: str, dp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: ``(mask, scores)`` over ``pool`` (the valid tokens with finite inputs and score)."""
        k = sel.knobs
        if scores is None:  # a score that ranks nothing keeps every token of the pool
            return pool.clone(), torch.zeros_like(batch.inputs.log_prob, dtype=torch.float32)
        if k.budget == "quantile":
            return above_quantile(scores, pool, 1.0 - ratio, per_row=scope == "sequence"), scores
        return select_tokens(scores, pool, ratio, scope=scope, direction=k.direction, dp_group=dp_group,
                             group_ids=batch.group_ids if scope == "group" else None, pool=k.pool) & pool, scores

    def transform(self, sel: "Selection", batch: "ScoreBatch", mask: torch.Tensor, tokens: torch.Tensor,
                  ctx: LossContext) -> LossTransform:
        """What the selected tokens get: by default only they keep the policy gradient."""
        return LossTransform(gate=mask)

    def stats(self, sel: "Selection", batch: "ScoreBatch", mask: torch.Tensor, scores: torch.Tensor,
              tokens: torch.Tensor, transform: LossTransform) -> dict[str, float]:
        """The rule's own metrics (keys without the ``tokensel/`` prefix, under the rule's name)."""
        return {}


class GroupShiftRule(Rule):
    """A rule that changes each token's advantage by a quantity only the whole prompt group determines (KTAE's
    key-token score, GTPO's conflict weights): its own score computes the change on the driver (``score_source
    =rollout``, ``scope=group``), every token is kept, and the loss adds the measured score back to verl's
    advantages (``LossContext.scores``). Subclasses set ``Knobs`` and override :meth:`score` (and ``stats``)."""

    source_scopes = {"rollout": ("group",)}
    normalisers = ("all",)
    legacy = {"action": "gradient", "phases": "one"}

    def check(self, sel: "Selection") -> None:
        check_ranking(sel, self)
        if sel.knobs.score != self.name:
            raise config_error("token_selection.score", sel.knobs.score, f"{self.name} (with token_selector's rule "
                               f"{self.name})", f"rule {self.name} sets each token's advantage itself; it ranks "
                               "nothing.")

    def select(self, sel, batch, scores, pool, *, ratio, scope, dp_group):
        return pool.clone(), scores

    def transform(self, sel, batch, mask, tokens, ctx) -> LossTransform:
        if ctx.scores is None:
            raise RuntimeError(f"rule {self.name} adds the advantage change the driver measured to the loss's "
                               "advantages; none reached the loss")
        return LossTransform(advantage_shift=torch.where(tokens, ctx.scores, 0.0))


class Shaping:
    """An advantage shaping: ``A' = weight * A + shift`` on every token, nothing ranked. Runs before the rule
    (``token_selection.shaping``), so a score that reads the advantage (omega) ranks by the shaped one.
    Register with :func:`register_shaping`; its knobs are a frozen dataclass of its own."""

    name: ClassVar[str] = ""
    Knobs: ClassVar[type] = type(None)
    #: where it comes from (paper, released code), for the knob docs
    source: ClassVar[str] = ""
    #: earlier values of ``token_selection.shaping`` that name it (they keep working and say its name)
    aliases: ClassVar[tuple[str, ...]] = ()

    def needs_entropy(self, knobs: Any) -> bool:
        return False

    def shape(self, batch: "ScoreBatch", knobs: Any,
              advantages: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(weight, shift)`` on every token (None where it leaves A as is)."""
        raise NotImplementedError

    def transform(self, batch: "ScoreBatch", knobs: Any, tokens: torch.Tensor) -> LossTransform:
        """The shaping as a transform; off ``tokens`` (padding, dropped tokens) A stays as is, so a NaN input
        there never reaches a masked sum."""
        adv = batch.advantages if batch.advantages is not None else torch.zeros_like(batch.inputs.log_prob)
        weight, shift = self.shape(batch, knobs, adv)
        return LossTransform(advantage_weight=None if weight is None else torch.where(tokens, weight, 1.0),
                             advantage_shift=None if shift is None else torch.where(tokens, shift, 0.0))

    def stats(self, batch: "ScoreBatch", knobs: Any, tokens: torch.Tensor,
              transform: LossTransform) -> dict[str, float]:
        """Its own metrics (keys without the ``tokensel/`` prefix)."""
        return {}


RULE_REGISTRY: dict[str, Rule] = {}
SHAPING_REGISTRY: dict[str, Shaping] = {}


def register_rule(name: str) -> Callable[[type], type]:
    """Class decorator: register a :class:`Rule` subclass as ``name``; refuses to overwrite a name."""

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Rule)):
            raise TypeError(f"register_rule({name!r}) needs a subclass of Rule, got {cls!r}")
        if name in RULE_REGISTRY:
            raise ValueError(f"rule {name!r} is already registered; pick another name")
        if not (dataclasses.is_dataclass(cls.Knobs) and issubclass(cls.Knobs, Ranking)):
            raise TypeError(f"rule {name!r}: Knobs must be a dataclass extending Ranking")
        cls.name = name
        RULE_REGISTRY[name] = cls()
        return cls

    return deco


def register_shaping(name: str) -> Callable[[type], type]:
    """Class decorator: register a :class:`Shaping` subclass as ``name`` (a ``token_selection.shaping``
    value); refuses to overwrite a name."""

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Shaping)):
            raise TypeError(f"register_shaping({name!r}) needs a subclass of Shaping, got {cls!r}")
        if name in SHAPING_REGISTRY or name == "none":
            raise ValueError(f"shaping {name!r} is already registered; pick another name")
        if not dataclasses.is_dataclass(cls.Knobs):
            raise TypeError(f"shaping {name!r}: Knobs must be a dataclass")
        cls.name = name
        SHAPING_REGISTRY[name] = cls()
        return cls

    return deco


def knob_fields(knobs_cls: type) -> list[dataclasses.Field]:
    """A knobs class's own fields (those :class:`Ranking` does not declare)."""
    shared = {f.name for f in dataclasses.fields(Ranking)} if issubclass(knobs_cls, Ranking) else set()
    return [f for f in dataclasses.fields(knobs_cls) if f.name not in shared]


def share(n: int, of: int) -> float:
    return n / of if of else 0.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_mean`` (``sum(values * mask) / (sum(mask) + 1e-8)``), for the metrics of a rule's own loss."""
    return (values * mask).sum() / (mask.sum() + 1e-8)


__all__ = ["ActorSettings", "BUDGETS", "GroupShiftRule", "LossContext", "LossTransform", "OWN_LOSS_MODES",
           "RULE_REGISTRY", "Ranking", "Rule", "SHAPING_REGISTRY", "Shaping", "knob", "knob_fields", "masked_mean",
           "register_rule", "register_shaping", "share"]
