"""The one validation pass of a resolved rule: every check across keys, in one place. Pure torch, no verl import.

:func:`validate` runs the shared keys' checks against each other, what the rule declares it needs
(:class:`~verl_tokensel.core.seam.rule.Needs`: its score sources and scopes, normalisers, own policy loss, update
passes, prompt groups), the score's requirements, the actor's settings where they are known, and last the rule's own
:meth:`~verl_tokensel.core.seam.rule.Rule.check`. A preset validates itself when it is built (the actor unknown);
the driver validates the resolved rule once with the actor's settings, before Ray starts. Each error names the key,
its valid values and the fix.
"""

from __future__ import annotations

from typing import Any, Optional

from verl_tokensel.core.errors import TokenSelectionConfigError, config_error
from verl_tokensel.core.seam.loss_modes import LOSS_MODES, loss_mode
from verl_tokensel.core.seam.knobs import Ranking
from verl_tokensel.core.seam.rule import OWN_LOSS_MODES, ActorSettings
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY

QUANTILE_SCOPES = ("sequence", "micro_batch")
# Scores whose omega = r * A * 1[not clipped] assumes verl's token-level clipped surrogate and these KL types
OMEGA_LOSS_MODES = ("vanilla",)
OMEGA_KL_TYPES = ("kl", "k1", "mse", "k2", "low_var_kl", "k3")
#: verl 0.9.1's advantage estimators that compute each response's advantage without its prompt group
GROUPLESS_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax")


class RuleCheck:
    """What a rule's :meth:`~verl_tokensel.core.seam.rule.Rule.check` reads: the resolved rule's keys (``c.knobs``,
    ``c.scope``, ``c.score_source``, ``c.normaliser``, ...) and ``c.actor``, the actor's settings
    (:class:`~verl_tokensel.core.seam.rule.ActorSettings`), or None while a preset is built (the check then runs
    again when the config is resolved)."""

    def __init__(self, sel: Any, actor: Optional[ActorSettings]) -> None:
        self._sel, self.actor = sel, actor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sel, name)


def validate(sel: Any, actor: Optional[ActorSettings] = None) -> None:
    """Every cross-key check of ``sel`` (a resolved rule), with the actor's settings when given. Raises
    :class:`~verl_tokensel.core.errors.TokenSelectionConfigError` naming the key."""
    rule = sel.impl
    check_shared(sel)
    check_needs(sel, rule)
    if actor is not None:
        check_actor(sel, rule, actor)
    rule.check(RuleCheck(sel, actor))


def check_shared(sel: Any) -> None:
    """The shared keys against each other: a normaliser needs the score source that can give its denominator."""
    if sel.normaliser == "selected" and sel.score_source != "current":
        raise config_error(
            "token_selection.normaliser", "selected",
            "all (with any score_source), selected (only with score_source=current)",
            f"with score_source={sel.score_source} the selection spans more than one micro-batch, so a "
            "per-micro-batch mean over selected tokens would weight them unequally. Fix: set "
            "token_selection.normaliser=all (the 80/20 paper's and GMTS' denominator).")
    if sel.normaliser == "kept" and sel.score_source != "prepass":
        raise config_error(
            "token_selection.normaliser", "kept", "all or selected (with score_source="
            f"{sel.score_source}); kept needs score_source=prepass",
            "the kept tokens' count over the whole mini-batch is the denominator, which only the pre-pass "
            "knows before the first micro-batch's backward. Fix: set token_selection.score_source=prepass "
            "or normaliser=all.")


def check_needs(sel: Any, rule: Any) -> None:
    """What the rule declares it needs, and what its score needs: the scope fits the source (for this rule), the
    normaliser, the score's owner, the driver's fields, the quantile budget, and a ranking by a score that ranks
    nothing has no budget knobs."""
    k = sel.knobs
    ranking = isinstance(k, Ranking)
    check_scope_fits_source(sel, rule)
    if sel.normaliser not in rule.needs.normalisers:
        raise config_error("token_selection.normaliser", sel.normaliser,
                           f"{' or '.join(rule.needs.normalisers)} (with token_selector's rule {rule.name})",
                           f"rule {rule.name} changes the selected tokens' loss and keeps every token in the "
                           "denominator, as its reference does. Fix: set token_selection.normaliser=all.")
    spec = SCORE_REGISTRY[sel.score]
    if ranking and spec.rule is not None and spec.rule != rule.name:
        raise config_error("token_selection.score", k.score, f"a score other than {k.score} (with token_selector's "
                           f"rule {rule.name})", f"score={k.score} is rule {spec.rule}'s own selection. Fix: use a "
                           f"preset of rule {spec.rule} or another score.")
    if spec.needs_external and sel.score_source != "rollout":
        raise config_error(
            "token_selection.score_source", sel.score_source, "rollout (with score=" + sel.score + ")",
            f"token_selection.score={sel.score} needs {', '.join(spec.needs_external)}, which only the driver "
            "computes, once per step, for the whole batch. Fix: set token_selection.score_source=rollout "
            "(scope batch, group or sequence; normaliser all).")
    if sel.ref_model_path is not None and "ref_entropy" not in spec.needs_external:
        raise config_error(
            "token_selection.ref_model_path", sel.ref_model_path, "null (with score=" + sel.score + ")",
            f"token_selection.score={sel.score} does not read a reference model, so the path would be ignored. "
            "Fix: remove it or set token_selection.score=ref_entropy.")
    if ranking and k.budget == "quantile" and (sel.scope not in QUANTILE_SCOPES or k.direction != "top"
                                               or k.pool != "valid" or spec.rule is not None):
        raise config_error("token_selection.budget", "quantile",
                           f"count, or quantile with scope {' or '.join(QUANTILE_SCOPES)}, direction top, pool valid "
                           "and a score that is not a rule's own selection",
                           f"got scope={sel.scope}, direction={k.direction}, pool={k.pool}, score={k.score}. "
                           "Fix: set token_selection.budget=count or those keys.")
    if ranking and not spec.ranks:
        for key, want in (("ratio", 1.0), ("direction", "top"), ("budget", "count"), ("pool", "valid")):
            if getattr(k, key) != want:
                raise config_error(f"token_selection.{key}", getattr(k, key), f"{want} (with score={k.score})",
                                   f"score={k.score} has no budget: it keeps every valid token, so {key} would be "
                                   f"ignored. Fix: remove token_selection.{key}.")


def check_scope_fits_source(sel: Any, rule: Any) -> None:
    """The scope is one the rule can pool at from the score source (``Needs.sources``)."""
    sources = rule.needs.sources
    allowed = sources.get(sel.score_source, ())
    if sel.scope in allowed:
        return
    if not allowed:  # the rule cannot run at this source at all
        raise config_error("token_selection.score_source", sel.score_source, f"{', '.join(sources)} (with "
                           f"token_selector's rule "
                           f"{rule.name})", f"rule {rule.name} measures its scores only there. Fix: set "
                           f"token_selection.score_source={next(iter(sources))}.")
    fitting = [src for src, scopes in sources.items() if sel.scope in scopes]
    if not fitting:
        every = sorted({s for scopes in sources.values() for s in scopes})
        raise config_error("token_selection.scope", sel.scope, f"{', '.join(every)} (with token_selector's rule "
                           f"{rule.name})", f"rule {rule.name} pools its choice over one of those scopes. Fix: set "
                           "token_selection.scope to one of them.")
    raise config_error(
        "token_selection.scope", sel.scope, f"{', '.join(allowed)} (with score_source={sel.score_source})",
        f"scope={sel.scope} needs the scores of its whole pool before the first backward, which "
        f"score_source={', '.join(fitting)} provides. Fix: set token_selection.score_source="
        f"{fitting[0]} or pick one of the scopes above.")


def check_actor(sel: Any, rule: Any, actor: ActorSettings) -> None:
    """The checks that need the actor's other settings (``actor_rollout_ref.actor.*``, ``algorithm.adv_estimator``):
    the denominator's aggregation, the rule's own policy loss, the normaliser verl's loss_mode can serve, omega's loss
    and KL type, the entropy the rule reads, the KL loss and the prompt groups it needs."""
    if sel.normaliser == "selected" and actor.loss_agg_mode != "token-mean":
        raise config_error(
            "token_selection.normaliser", "selected",
            "all (with any loss_agg_mode), selected (only with loss_agg_mode=token-mean)",
            f"actor_rollout_ref.actor.loss_agg_mode is {actor.loss_agg_mode!r}; a mean over selected tokens is only "
            "defined for token-mean. Fix: set token_selection.normaliser=all or loss_agg_mode=token-mean.")
    if rule.needs.policy_loss and actor.loss_mode not in OWN_LOSS_MODES:
        raise config_error(
            "policy_loss.loss_mode", actor.loss_mode, f"{', '.join(OWN_LOSS_MODES)} (with token_selector's rule "
            f"{rule.name})", f"rule {rule.name} computes the policy loss itself (verl's maths with the rule's "
            "per-token outputs), so it cannot also run loss_mode's. Fix: set "
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla (verl's default)."
            + (f" The preset already is the global version of verl's loss_mode={actor.loss_mode}."
               if actor.loss_mode == rule.name else ""))
    check_loss_mode_serves_normaliser(sel, rule, actor.loss_mode)
    spec = SCORE_REGISTRY[sel.score]
    if spec.needs_omega:
        if actor.loss_mode not in OMEGA_LOSS_MODES:
            raise config_error(
                "policy_loss.loss_mode", actor.loss_mode, ", ".join(OMEGA_LOSS_MODES),
                f"token_selection.score={sel.score} uses omega = r*A*1[not clipped] of the token-level clipped "
                "surrogate. Fix: use loss_mode=vanilla or a score without omega (entropy, random).")
        if actor.use_kl_loss and actor.kl_loss_type not in OMEGA_KL_TYPES:
            raise config_error(
                "kl_loss_type", actor.kl_loss_type, ", ".join(OMEGA_KL_TYPES),
                f"token_selection.score={sel.score} adds the KL term's gradient weight to omega.")
    reads_entropy = sel.score_needs_entropy or sel.shaping_needs_entropy
    if reads_entropy and not (actor.calculate_entropy or actor.entropy_coeff != 0 or actor.auto_enable_entropy):
        raise config_error(
            "calculate_entropy", actor.calculate_entropy, "true",
            f"token_selection.score={sel.score} / shaping={sel.shaping} reads the policy entropy, which the "
            "engine only computes when calculate_entropy=true or entropy_coeff != 0, and "
            "token_selection.auto_enable_entropy=false. Fix: set actor_rollout_ref.actor.calculate_entropy=true or "
            "token_selection.auto_enable_entropy=true.")
    check_prompt_groups(sel, actor.adv_estimator)


def check_loss_mode_serves_normaliser(sel: Any, rule: Any, mode: str) -> None:
    """verl's policy loss ``mode`` can serve the normaliser (:mod:`~verl_tokensel.core.seam.loss_modes`): a loss
    without a token-mean (SAPO, GMPO) serves only ``normaliser=all``, where the selection gates the gradient and
    nothing else."""
    if rule.needs.policy_loss or sel.normaliser in loss_mode(mode).normalisers:
        return
    serving = [m for m, spec in LOSS_MODES.items() if sel.normaliser in spec.normalisers]
    raise config_error(
        "policy_loss.loss_mode", mode, f"{', '.join(serving)} (with token_selection.normaliser={sel.normaliser})",
        f"{loss_mode(mode).refusal}. Fix: keep loss_mode={mode} with a preset whose normaliser is all "
        "(forking_paper, ar, entropy_adv, fipo, ...) or token_selection.normaliser=all where the rule allows it "
        "(the selection then only gates the gradient), or pick another loss_mode.")


def check_prompt_groups(sel: Any, adv_estimator: Optional[str]) -> None:
    """A rule that reads each prompt group's responses together (``Needs(prompt_groups=True)``) needs an advantage
    estimator that forms the groups (``algorithm.adv_estimator``; None: not known here)."""
    rule = sel.impl
    if rule.needs.prompt_groups and adv_estimator in GROUPLESS_ESTIMATORS:
        raise TokenSelectionConfigError(
            f"algorithm.adv_estimator={adv_estimator!r} is invalid with token_selector's rule {rule.name}; "
            f"valid values: an estimator with prompt groups (not {', '.join(GROUPLESS_ESTIMATORS)}). Rule "
            f"{rule.name} compares the responses of each prompt group (their rewards and group advantages), which "
            f"adv_estimator={adv_estimator} does not form. Fix: set algorithm.adv_estimator=grpo (the "
            "release's) with actor_rollout_ref.rollout.n > 1.")


__all__ = ["GROUPLESS_ESTIMATORS", "OMEGA_KL_TYPES", "OMEGA_LOSS_MODES", "QUANTILE_SCOPES", "RuleCheck",
           "check_actor", "check_loss_mode_serves_normaliser", "check_needs", "check_prompt_groups",
           "check_scope_fits_source", "check_shared", "validate"]
