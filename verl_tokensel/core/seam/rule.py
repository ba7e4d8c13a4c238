"""The rule seam. Pure torch, no verl import. Rule authors import it from :mod:`verl_tokensel.rules`.

A token rule is registered by name (:func:`register_rule`, refusing to overwrite) with its knobs (a frozen
dataclass extending :class:`Knobs`, each field a :func:`knob` with help text, default, paper value and valid range)
and what it needs (one :class:`Needs`). It is a function ``rule(x) -> LossTransform`` (the common case: what the
selected tokens get in the loss) or a :class:`Rule` subclass for a rule that also scores, selects, checks or runs
update passes its own way. Every step receives one :class:`RuleInput` ``x`` (the micro-batch's tensors by name, the
knobs, the pool and where the step stands) and returns one value: scores, a mask, a :class:`LossTransform`.

An advantage shaping (:mod:`~verl_tokensel.core.rules.shaping`) is a smaller component of the same kind with one job,
the advantages' affine map; it runs before any rule (``token_selection.shaping``): AR's factor ahead of Lopti's passes.
The rules that shift each token's advantage by what its whole prompt group determines share
:mod:`~verl_tokensel.core.rules.group_shift`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

import torch
import torch.distributed as dist

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.scopes import SOURCE_SCOPES
from verl_tokensel.core.seam.hidden import HiddenStates
from verl_tokensel.core.seam.knobs import Knobs, Ranking
from verl_tokensel.core.seam.pool import POOLED_SCOPES, Pool
from verl_tokensel.core.seam.vocab import VocabStat
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY
from verl_tokensel.core.ranking.select import above_quantile, select_tokens

#: policy_loss.loss_mode values a rule that computes the policy loss itself accepts (its maths keeps verl's)
OWN_LOSS_MODES = ("vanilla", "tokensel_ppo_clip")


@dataclass(frozen=True)
class Needs:
    """What a rule needs from the pipeline, declared once (``register_rule(..., needs=Needs(...))``).

    Attributes:
        entropy: its own steps read the policy entropy (the entropy its score reads is the score's to declare).
        scores: registered scores it evaluates besides ``knobs.score`` (their inputs are prepared: row keys...).
        sources: score source -> the scopes the rule can pool at from it (``current`` = in the update forward,
            ``prepass`` = a no-grad pre-pass at each mini-batch start, ``rollout`` = the driver's old-log-prob pass).
        normalisers: the token-mean denominators it allows (``token_selection.normaliser``).
        policy_loss: it computes the policy loss itself (``LossTransform.token_loss``), so ``loss_mode`` stays
            vanilla (verl's maths with the rule's per-token outputs).
        kl_loss: it weights the KL loss per token (``LossTransform.kl_weight``): recipes turn ``use_kl_loss`` on.
        passes: whole update passes per step (Lopti: 2; each micro-batch sees its ``update_pass``).
        prompt_groups: it reads the responses of each prompt together (an advantage estimator with groups).
        hidden_states: a :class:`~verl_tokensel.core.seam.hidden.HiddenStates` subclass: the rule reads the last
            hidden states (the output layer's input) of no-grad passes over the step's batch before the update;
            the last pass's per-token values reach its steps as ``x.hidden``. None: nothing is kept or run.
        vocab: the per-token reductions over the vocabulary it reads (:class:`~verl_tokensel.core.seam.vocab.VocabStat`:
            the old policy's in verl's old-log-prob pass, the current policy's in the update forward), as
            ``x.vocab[stat.key]``. Empty: nothing is computed.
    """

    entropy: bool = False
    scores: tuple[str, ...] = ()
    sources: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(SOURCE_SCOPES))
    normalisers: tuple[str, ...] = ("all", "selected", "kept")
    policy_loss: bool = False
    kl_loss: bool = False
    passes: int = 1
    prompt_groups: bool = False
    hidden_states: Optional[type] = None
    vocab: tuple[VocabStat, ...] = ()


@dataclass(frozen=True)
class About:
    """What ``verl-tokensel rules`` and the docs say of a rule or shaping: its ``source`` (paper, released code),
    its ``formula`` (one line) and its ``deviations`` from the source (each a sentence with its reason)."""

    source: str = ""
    formula: str = ""
    deviations: tuple[str, ...] = ()


@dataclass
class LossTransform:
    """What a rule does to verl's loss on one micro-batch; every tensor is ``(batch, response_len)``.

    Attributes:
        gate: bool, the tokens that keep the policy gradient (``where(gate, log_prob, log_prob.detach())``);
            None: every token keeps it.
        advantage_weight / advantage_shift: ``A' = weight * A + shift`` before the policy loss (None: as is).
        kl_weight / entropy_weight: per-token factors of the KL-loss and entropy-bonus terms (None: 1).
        token_loss: the rule's own policy loss (pure torch, in its module): ``token_loss(old_log_prob, log_prob,
            advantages, response_mask, *, clip_low, clip_high, clip_ratio_c) -> (pg_losses, metrics)``, the
            per-token losses and float metrics (verl's names, ``actor/pg_clipfrac`` ..., or ``tokensel/<rule>/...``);
            the glue aggregates them with verl's ``agg_loss`` and the rollout importance weights; the clip bounds are
            the actor's. None: verl's configured ``loss_mode``.
        metrics: the rule's own metrics on this micro-batch (numbers or 0-d tensors), reported as
            ``tokensel/<rule>/<key>``.
    """

    gate: Optional[torch.Tensor] = None
    advantage_weight: Optional[torch.Tensor] = None
    advantage_shift: Optional[torch.Tensor] = None
    kl_weight: Optional[torch.Tensor] = None
    entropy_weight: Optional[torch.Tensor] = None
    token_loss: Optional[Callable[..., tuple[torch.Tensor, dict[str, float]]]] = None
    metrics: dict[str, Any] = field(default_factory=dict)

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
class ActorSettings:
    """The actor settings (``actor_rollout_ref.actor.*``, and the advantage estimator) a rule's checks may need;
    defaults: verl's."""

    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"
    calculate_entropy: bool = False
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    auto_enable_entropy: bool = True
    adv_estimator: Optional[str] = None


@dataclass(frozen=True)
class LossContext:
    """Where a micro-batch sits in the loss, for a rule whose weights depend on it (the loss builds it; ``x.where``).

    Attributes:
        update_pass: the driver's update pass (``Needs(passes=...)``; None: the one pass).
        denominator: the token-mean denominator of verl's loss (``batch_num_tokens``, over all ranks); None
            outside the loss (the micro-batch alone then is the whole).
        global_rows: the mini-batch's responses over all ranks (``global_batch_size``); None as above.
        loss_agg_mode: the actor's ``loss_agg_mode``.
    """

    update_pass: Optional[int] = None
    denominator: Optional[float] = None
    global_rows: Optional[int] = None
    loss_agg_mode: str = "token-mean"


class RuleInput:
    """The one input every step of a rule receives: one micro-batch (or a pre-pass's mini-batch, the driver's batch)
    and where the rule step stands on it; after the step, its result. Tensors are ``(batch, response_len)``,
    detached unless said.

    What a rule reads:
        knobs: the rule's knobs (its ``Knobs`` dataclass). ``selection``: the resolved selection (``scope``,
            ``score_source``, ``normaliser``, ``seed``, ...).
        log_prob: the scored policy's log p(a_t) (the update pass's for ``score_source=current``).
        old_log_prob / rollout_log_prob: the old policy's (verl's old-log-prob pass) / the rollout engine's, or None.
        advantages: verl's advantages as the batch carries them (None: not given); ``weighted_advantages``: times
            the rollout importance weights (the token loss's weight), after the shaping for a score that reads them.
        entropy: the scored policy's entropy (declare ``Needs(entropy=True)``, or rank a score that reads it: a
            rule that declares it and gets none fails, naming the need).
        valid: bool, the valid response tokens. ``finite``: False on a valid token with a non-finite input.
        tokens: bool, the tokens the rule treats (valid, finite inputs, finite score): the pool it selects from.
        group_ids: ``(batch,)`` int64 prompt-group ids (``scope=group``), or None.
        external: the per-token fields the driver filled (``response_ids``, ``sequence_reward``, ...).
        hidden: float32, the per-token values of the rule's hidden-state passes (``Needs(hidden_states=...)``), or
            None where they did not run.
        vocab: the per-token reductions over the vocabulary the rule declares (``Needs(vocab=...)``), by
            ``VocabStat.key``: float32 ``(batch, response_len)`` or ``(batch, response_len, k)``; a declared one that
            did not come fails, naming it.
        clip_ratio_low / clip_ratio_high / clip_ratio_c: the actor's PPO clip.
        ratio / scope: the budget and the pool of this call. ``pool``: the ranks the scope spans (a :class:`Pool`:
            exact sums, counts and top-k over them); ``dp_group`` its process group (None: this process alone).
        where: the micro-batch's place in the loss (:class:`LossContext`: ``update_pass``, ``denominator``,
            ``global_rows``, ``loss_agg_mode``, also readable as ``x.update_pass`` ...).
        score(name): a registered score evaluated on this batch.

    What the steps fill in, in order (each step sees those before it):
        scores: float32, the step's scores (None before :meth:`Rule.score`; NaN on dropped tokens).
        mask: bool, the tokens the rule selected (None before :meth:`Rule.select`; every token of ``tokens`` for a
            rule that does not rank).
        transform: the :class:`LossTransform` (only in :meth:`Rule.stats`).
        selected: bool, the selected tokens that keep the policy gradient: ``mask`` and the transform's ``gate``
            (what the selection metrics count).
    """

    def __init__(self, selection: Any, batch: Any, *, ratio: float, scope: str,
                 dp_group: Optional[dist.ProcessGroup] = None, where: LossContext = LossContext()) -> None:
        self.selection, self.batch = selection, batch
        self.knobs = selection.knobs
        self.ratio, self.scope, self.dp_group, self.where = ratio, scope, dp_group, where
        self.tokens: torch.Tensor = batch.valid & batch.finite
        self.scores: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None
        self.transform: Optional[LossTransform] = None
        self.dropped = False
        self.stats: dict[str, float] = {}

    def with_knobs(self, knobs: Any) -> "RuleInput":
        """A copy of this input with other knobs (a shaping's, run on the same micro-batch)."""
        out = copy.copy(self)
        out.knobs = knobs
        return out

    def score(self, name: str) -> torch.Tensor:
        """The registered score ``name`` on this batch (float32, detached, 0 off ``valid``)."""
        return self.batch.score(name)

    @property
    def pool(self) -> Pool:
        """The ranks this call's scope spans: every data-parallel rank for a pooled scope, else this process."""
        return Pool(self.dp_group if self.scope in POOLED_SCOPES else None)

    @property
    def entropy(self) -> Optional[torch.Tensor]:
        entropy = self.batch.inputs.entropy
        rule = self.selection.impl
        if entropy is None and rule.needs.entropy:
            raise RuntimeError(
                f"rule {rule.name} declares Needs(entropy=True) but its input carries no policy entropy: the pass "
                "that fed it ran without it (actor_rollout_ref.actor.calculate_entropy=False and "
                "token_selection.auto_enable_entropy=False, or a harness that built the batch without it). Fix: "
                "run through verl_tokensel's loss installed by its trainer, or set calculate_entropy=True.")
        return entropy

    @property
    def vocab(self) -> dict[str, torch.Tensor]:
        rule = self.selection.impl
        external = self.batch.inputs.external
        out = {}
        for stat in rule.needs.vocab:
            value = external.get(fields.VOCAB_PREFIX + stat.key)
            if value is None:
                raise RuntimeError(
                    f"rule {rule.name} declares Needs(vocab=(VocabStat({stat.kind!r}, forward={stat.forward!r}), ...)) "
                    f"but its input carries no {stat.key!r}: the forward that computes it ran without the rule "
                    "(a stock loss in that pass, verl's fused kernels, or a harness that built the batch without it). "
                    "Fix: run through verl_tokensel's loss installed by its trainer.")
            out[stat.key] = value
        return out

    @property
    def selected(self) -> torch.Tensor:
        gate = None if self.transform is None else self.transform.gate
        return self.mask if gate is None else self.mask & gate

    log_prob = property(lambda self: self.batch.inputs.log_prob)
    old_log_prob = property(lambda self: self.batch.inputs.old_log_prob)
    rollout_log_prob = property(lambda self: self.batch.inputs.rollout_log_prob)
    advantages = property(lambda self: self.batch.advantages)
    weighted_advantages = property(lambda self: self.batch.inputs.advantages)
    valid = property(lambda self: self.batch.valid)
    finite = property(lambda self: self.batch.finite)
    group_ids = property(lambda self: self.batch.group_ids)
    external = property(lambda self: self.batch.inputs.external)
    hidden = property(lambda self: self.batch.inputs.external.get(fields.HIDDEN))
    clip_ratio_low = property(lambda self: float(self.batch.inputs.clip_ratio_low))
    clip_ratio_high = property(lambda self: float(self.batch.inputs.clip_ratio_high))
    clip_ratio_c = property(lambda self: float(self.batch.inputs.clip_ratio_c))
    update_pass = property(lambda self: self.where.update_pass)
    denominator = property(lambda self: self.where.denominator)
    global_rows = property(lambda self: self.where.global_rows)
    loss_agg_mode = property(lambda self: self.where.loss_agg_mode)


class Rule:
    """A token rule, class form: subclass, override the steps that differ, register with :func:`register_rule`
    (which sets :attr:`name`, :attr:`Knobs` and :attr:`needs`). A rule whose only step is :meth:`transform` is
    simpler written as a function (``@register_rule(name, knobs=...)`` on ``def rule(x) -> LossTransform``).

    The base keeps every valid token unless the rule says otherwise: with :class:`Ranking` knobs, :meth:`select` ranks
    ``knobs.score`` over the scope (a score that ranks nothing keeps every token); with plain :class:`Knobs` it keeps
    every token of ``x.tokens``. :meth:`transform` keeps the policy gradient on the selected tokens. Every step
    receives one :class:`RuleInput` ``x``.
    """

    #: the registered name; also the metric group (``tokensel/<name>/...``)
    name: ClassVar[str] = ""
    #: the rule's knobs (a frozen dataclass extending :class:`Knobs`)
    Knobs: ClassVar[type] = Knobs
    #: what it needs (:class:`Needs`)
    needs: ClassVar[Needs] = Needs()
    #: where it comes from, its formula and its deviations (:class:`About`), for ``verl-tokensel rules`` and the docs
    about: ClassVar["About"]

    def score(self, x: RuleInput) -> Optional[torch.Tensor]:
        """Step 1: the scores (a NaN drops its token): the ranking's score, or the rule's own (the first of
        ``Needs.scores``); None where that score ranks nothing (or the rule has none)."""
        name = x.selection.score
        return x.score(name) if SCORE_REGISTRY[name].ranks else None

    def select(self, x: RuleInput) -> torch.Tensor:
        """Step 2: the selected tokens, a subset of ``x.tokens``, ranked by ``x.scores`` (none: every token)."""
        k = x.knobs
        if x.scores is None or not isinstance(k, Ranking):  # nothing ranked: every token of the pool
            return x.tokens.clone()
        if k.budget == "quantile":
            return above_quantile(x.scores, x.tokens, 1.0 - x.ratio, per_row=x.scope == "sequence")
        return select_tokens(x.scores, x.tokens, x.ratio, scope=x.scope, direction=k.direction, dp_group=x.dp_group,
                             group_ids=x.group_ids if x.scope == "group" else None, pool=k.pool) & x.tokens

    def transform(self, x: RuleInput) -> LossTransform:
        """Step 3: what the selected tokens get in the loss; by default only they keep the policy gradient."""
        return LossTransform(gate=x.mask)

    def stats(self, x: RuleInput) -> dict[str, Any]:
        """The rule's metrics that need host numbers (keys under ``tokensel/<name>/``; ``x.transform`` is set); run
        only where metrics are reported. Cheap ones can travel in ``LossTransform.metrics`` instead."""
        return {}

    def check(self, c: Any) -> None:
        """Checks of the knobs with the shared keys and the actor's settings (``c.knobs``, ``c.scope``, ...,
        ``c.actor``), beyond what :class:`Needs` and the knobs' ranges say. Raise ``config_error(key, value, valid,
        fix)``. Run once, on the driver, when the config is resolved."""

    def merge_passes(self, per_pass: list[dict[str, Any]]) -> dict[str, Any]:
        """The step's metrics from those of each update pass (only for a rule with ``Needs(passes > 1)``)."""
        raise NotImplementedError(f"rule {self.name!r} has one update pass")


RULE_REGISTRY: dict[str, Rule] = {}


def _check_vocab(name: str, stats: Any, knobs_cls: type) -> None:
    """``Needs(vocab=...)``: a tuple of :class:`VocabStat`, one per key, a ``kappa`` named by a knob the rule has."""
    if not isinstance(stats, tuple) or not all(isinstance(s, VocabStat) for s in stats):
        raise TypeError(f"rule {name!r}: Needs(vocab=...) must be a tuple of VocabStat, got {stats!r}")
    keys = [s.key for s in stats]
    if len(set(keys)) != len(keys):
        raise TypeError(f"rule {name!r}: Needs(vocab=...) names one reduction per kind and forward, got {keys}")
    names = {f.name for f in dataclasses.fields(knobs_cls)}
    for s in stats:
        for field_name in ("k", "kappa"):
            value = getattr(s, field_name)
            if isinstance(value, str) and value not in names:
                raise TypeError(f"rule {name!r}: VocabStat({field_name}={value!r}) names no knob of "
                                f"{knobs_cls.__name__} (its knobs: {', '.join(sorted(names)) or 'none'})")


def register_rule(name: str, *, knobs: Optional[type] = None, needs: Optional[Needs] = None, source: str = "",
                  formula: str = "", deviations: tuple[str, ...] = ()) -> Callable:
    """Register a token rule as ``name`` (refusing to overwrite a name): a :class:`Rule` subclass, or a function
    ``rule(x: RuleInput) -> LossTransform`` (the rule's :meth:`Rule.transform`; it keeps the base's ranking).
    ``knobs``: its knobs, a frozen dataclass extending :class:`Knobs` (default: :class:`Knobs`); ``needs``: what it
    needs (default: :class:`Needs`); ``source`` (paper and released code), ``formula`` (one line) and
    ``deviations`` (each a sentence: where it departs from its source, and why) are what ``verl-tokensel rules``
    and the docs print. Returns what it decorates."""

    def deco(obj: Any) -> Any:
        if name in RULE_REGISTRY:
            raise ValueError(f"rule {name!r} is already registered; pick another name")
        knobs_cls = knobs if knobs is not None else getattr(obj, "Knobs", Knobs)
        if not (dataclasses.is_dataclass(knobs_cls) and isinstance(knobs_cls, type) and issubclass(knobs_cls, Knobs)):
            raise TypeError(f"rule {name!r}: knobs must be a frozen dataclass extending Knobs")
        if isinstance(obj, type):
            if not issubclass(obj, Rule):
                raise TypeError(f"register_rule({name!r}) needs a subclass of Rule or a function, got {obj!r}")
            cls = obj
        elif callable(obj):
            cls = type(f"{name}_rule", (Rule,), {"transform": lambda self, x: obj(x), "__doc__": obj.__doc__,
                                                  "__module__": getattr(obj, "__module__", __name__)})
        else:
            raise TypeError(f"register_rule({name!r}) needs a subclass of Rule or a function, got {obj!r}")
        cls.name, cls.Knobs = name, knobs_cls
        cls.needs = needs if needs is not None else cls.__dict__.get("needs", Needs())
        cls.about = About(source=source, formula=formula, deviations=tuple(deviations))
        if not isinstance(cls.needs, Needs):
            raise TypeError(f"rule {name!r}: needs must be a Needs(...)")
        states = cls.needs.hidden_states
        if states is not None and not (isinstance(states, type) and issubclass(states, HiddenStates)):
            raise TypeError(f"rule {name!r}: Needs(hidden_states=...) must be a HiddenStates subclass, got {states!r}")
        _check_vocab(name, cls.needs.vocab, knobs_cls)
        RULE_REGISTRY[name] = cls()
        return obj

    return deco


__all__ = ["About", "ActorSettings", "LossContext", "LossTransform", "Needs", "OWN_LOSS_MODES", "RULE_REGISTRY", "Rule",
           "RuleInput", "register_rule"]
