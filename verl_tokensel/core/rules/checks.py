"""The checks every ranking rule shares (the rule seam's, :mod:`~verl_tokensel.core.rules.base`). Pure torch, no
verl import. Each raises :class:`~verl_tokensel.core.errors.TokenSelectionConfigError` naming the key, its valid
values and the fix."""

from __future__ import annotations

from typing import Any

from verl_tokensel.core.errors import config_error
from verl_tokensel.core.scores import SCORE_REGISTRY

# the shared config (:class:`verl_tokensel.core.selection.Selection`), a rule and the actor settings
# (:mod:`~verl_tokensel.core.rules.base`): not imported, both import this module
Selection = Rule = ActorSettings = Any
QUANTILE_SCOPES = ("sequence", "micro_batch")
# Scores whose omega = r * A * 1[not clipped] assumes verl's token-level clipped surrogate and these KL types
OMEGA_LOSS_MODES = ("vanilla",)
OMEGA_KL_TYPES = ("kl", "k1", "mse", "k2", "low_var_kl", "k3")


def check_ranking(sel: Selection, rule: Rule) -> None:
    """The ranking's checks with the shared config: the scope fits the source (for this rule), the normaliser,
    the score's owner, the quantile budget, and a score that ranks nothing has no budget knobs."""
    k = sel.knobs
    check_scope_fits_source(sel, rule)
    if sel.normaliser not in rule.normalisers:
        raise config_error("token_selection.normaliser", sel.normaliser,
                           f"{' or '.join(rule.normalisers)} (with token_selector's rule {rule.name})",
                           f"rule {rule.name} changes the selected tokens' loss and keeps every token in the "
                           "denominator, as its reference does. Fix: set token_selection.normaliser=all.")
    spec = SCORE_REGISTRY[k.score]
    if spec.rule is not None and spec.rule != rule.name:
        raise config_error("token_selection.score", k.score, f"a score other than {k.score} (with token_selector's "
                           f"rule {rule.name})", f"score={k.score} is rule {spec.rule}'s own selection. Fix: use a "
                           f"preset of rule {spec.rule} or another score.")
    if spec.needs_external and sel.score_source != "rollout":
        raise config_error(
            "token_selection.score_source", sel.score_source, "rollout (with score=" + k.score + ")",
            f"token_selection.score={k.score} needs {', '.join(spec.needs_external)}, which only the driver "
            "computes, once per step, for the whole batch. Fix: set token_selection.score_source=rollout "
            "(scope batch, group or sequence; normaliser all).")
    if sel.ref_model_path is not None and "ref_entropy" not in spec.needs_external:
        raise config_error(
            "token_selection.ref_model_path", sel.ref_model_path, "null (with score=" + k.score + ")",
            f"token_selection.score={k.score} does not read a reference model, so the path would be ignored. "
            "Fix: remove it or set token_selection.score=ref_entropy.")
    if k.budget == "quantile" and (sel.scope not in QUANTILE_SCOPES or k.direction != "top" or k.pool != "valid"
                                   or spec.rule is not None):
        raise config_error("token_selection.budget", "quantile",
                           f"count, or quantile with scope {' or '.join(QUANTILE_SCOPES)}, direction top, pool valid "
                           "and a score that is not a rule's own selection",
                           f"got scope={sel.scope}, direction={k.direction}, pool={k.pool}, score={k.score}. "
                           "Fix: set token_selection.budget=count or those keys.")
    if not spec.ranks:
        check_no_budget(sel, "every valid token")


def check_no_budget(sel: Selection, keeps: str) -> None:
    """A selection with no budget (every token, or a rule's own choice): its ranking knobs stay at the
    defaults, since any other value would be ignored."""
    k = sel.knobs
    for key, want in (("ratio", 1.0), ("direction", "top"), ("budget", "count"), ("pool", "valid")):
        if getattr(k, key) != want:
            raise config_error(f"token_selection.{key}", getattr(k, key), f"{want} (with score={k.score})",
                               f"score={k.score} has no budget: it keeps {keeps}, so {key} would be ignored. "
                               f"Fix: remove token_selection.{key}.")


def check_scope_fits_source(sel: Selection, rule: Rule) -> None:
    allowed = rule.source_scopes.get(sel.score_source, ())
    if sel.scope in allowed:
        return
    if not allowed:  # the rule cannot run at this source at all
        sources = ", ".join(rule.source_scopes)
        raise config_error("token_selection.score_source", sel.score_source, f"{sources} (with token_selector's rule "
                           f"{rule.name})", f"rule {rule.name} measures its scores only there. Fix: set "
                           f"token_selection.score_source={next(iter(rule.source_scopes))}.")
    fitting = [src for src, scopes in rule.source_scopes.items() if sel.scope in scopes]
    if not fitting:
        every = sorted({s for scopes in rule.source_scopes.values() for s in scopes})
        raise config_error("token_selection.scope", sel.scope, f"{', '.join(every)} (with token_selector's rule "
                           f"{rule.name})", f"rule {rule.name} pools its choice over one of those scopes. Fix: set "
                           "token_selection.scope to one of them.")
    raise config_error(
        "token_selection.scope", sel.scope, f"{', '.join(allowed)} (with score_source={sel.score_source})",
        f"scope={sel.scope} needs the scores of its whole pool before the first backward, which "
        f"score_source={', '.join(fitting)} provides. Fix: set token_selection.score_source="
        f"{fitting[0]} or pick one of the scopes above.")


def check_score_with_actor(sel: Selection, actor: ActorSettings) -> None:
    """The score's checks with the actor: omega's loss mode and KL type."""
    spec = SCORE_REGISTRY[sel.knobs.score]
    if not spec.needs_omega:
        return
    if actor.loss_mode not in OMEGA_LOSS_MODES:
        raise config_error(
            "policy_loss.loss_mode", actor.loss_mode, ", ".join(OMEGA_LOSS_MODES),
            f"token_selection.score={sel.knobs.score} uses omega = r*A*1[not clipped] of the token-level clipped "
            "surrogate. Fix: use loss_mode=vanilla or a score without omega (entropy, random).")
    if actor.use_kl_loss and actor.kl_loss_type not in OMEGA_KL_TYPES:
        raise config_error(
            "kl_loss_type", actor.kl_loss_type, ", ".join(OMEGA_KL_TYPES),
            f"token_selection.score={sel.knobs.score} adds the KL term's gradient weight to omega.")


__all__ = ["OMEGA_KL_TYPES", "OMEGA_LOSS_MODES", "QUANTILE_SCOPES", "check_no_budget", "check_ranking",
           "check_scope_fits_source", "check_score_with_actor"]
