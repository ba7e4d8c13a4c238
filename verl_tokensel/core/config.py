"""Token-selection knobs and presets. No verl import.

Why one file over 400 lines: a knob's help, default and paper value, the rule's check of it and its error text,
and the presets that set it are one contract; side by side, a change to one is made with the others.

Two keys on ``actor_rollout_ref.actor`` drive everything:

- ``token_selector``: a preset name from :data:`PRESETS` (``none``, ``forking``, ...);
- ``token_selection.<knob>``: per-knob overrides; ``null`` (the default) takes the preset's value.

The dataclass field defaults below are the single source of truth: the YAML shipped in
``verl_tokensel/config`` mirrors them and a test asserts they match; the README knob table is
checked against :func:`knob_table_rows`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

from verl_tokensel.core.cov import COV_SCOPES
from verl_tokensel.core.pools import DIRECTIONS, POOLS, SCOPES, invalid_rule_arg
from verl_tokensel.core.scores import SCORE_REGISTRY
from verl_tokensel.core.shaping import PHASES, SHAPINGS

# the token-mean denominator: all valid tokens; each micro-batch's selected tokens (80/20 code); or the selected
# (kept) tokens of the whole mini-batch, which then are the loss's only tokens (STAPO's renormalisation)
NORMALISERS = ("all", "selected", "kept")
# Where the ranking scores come from, and the scopes each source can fill. A scope wider than one
# micro-batch needs every score of the pool before the first backward of that pool:
# - current: the update forward of each micro-batch (scores of the policy being trained);
# - prepass: a no-grad forward over the rank's PPO mini-batch at its start (the GMTS code's timing),
#   pooled over the data-parallel ranks by collectives (mini_batch, group) or per response (sequence);
# - rollout: the old-policy pass verl already runs before the update (entropy, log-probs), with the
#   driver's advantages; the driver computes the mask and sends it as a per-token field.
SOURCE_SCOPES = {
    "current": ("micro_batch", "micro_batch_dp", "sequence"),
    "prepass": ("mini_batch", "group", "sequence"),
    "rollout": ("batch", "group", "sequence"),
}
SCORE_SOURCES = tuple(SOURCE_SCOPES)
# Scores that need the PPO gradient weight omega = r * A * 1[not clipped]; its formula assumes
# verl's token-level clipped surrogate.
OMEGA_LOSS_MODES = ("vanilla",)
OMEGA_KL_TYPES = ("kl", "k1", "mse", "k2", "low_var_kl", "k3")


# What the selected tokens get in the loss (the rest keep verl's loss as configured):
# - gradient: the policy gradient (everything else none): the 80/20, GMTS, random ... presets;
# - kl_penalty: KL-Cov's ``kl_penalty_coef * |log r|`` added, on an unclipped surrogate for every token (verl's port);
# - zero_loss: their policy loss zeroed (Clip-Cov's ``corr = 0``), the rest PPO-clipped without dual clip (verl's port);
# - clip_class: their own clip bounds and KL weight (Archer's high-entropy tokens), the rest the actor's.
ACTIONS = ("gradient", "kl_penalty", "zero_loss", "clip_class")
# How many tokens a rule selects: count = ceil(ratio * N) of the scope's pool (the covariance scores: verl's
# max(1, int(ratio * N))); quantile = those strictly above the (1 - ratio) quantile of their response (scope
# sequence) or micro-batch, linear interpolation (Archer's per-response 0.8 entropy quantile)
BUDGETS = ("count", "quantile")
QUANTILE_SCOPES = ("sequence", "micro_batch")
#: policy_loss.loss_mode values a rule whose action replaces the surrogate accepts (its maths keeps verl's conventions)
ACTION_LOSS_MODES = ("vanilla", "tokensel_ppo_clip")

#: knobs of TokenSelectionConfig that switch engine behaviour rather than override a preset's rule
ENGINE_SWITCHES = ("auto_enable_entropy", "no_grad_scores", "prepass_reuse")


class TokenSelectionConfigError(ValueError):
    """A token-selection key has an invalid value. The message names the key and the valid values."""


def _err(key: str, value: Any, valid: str, fix: str = "") -> TokenSelectionConfigError:
    msg = f"actor_rollout_ref.actor.{key}={value!r} is invalid; valid values: {valid}."
    if fix:
        msg += f" {fix}"
    return TokenSelectionConfigError(msg)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _err(key, value, ", ".join(choices))


def _check_number(key: str, value: Any, low: Optional[float], high: Optional[float], valid: str,
                  open_high: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or (value < high if open_high else value <= high))
    if not ok:
        raise _err(key, value, valid)


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _err(key, value, "true, false")


@dataclass(frozen=True)
class Selection:
    """A fully resolved selection rule (a preset, possibly with overrides)."""

    score: str
    ratio: float
    direction: str
    scope: str
    normaliser: str
    seed: int = 0
    mask_entropy_bonus: bool = False
    mask_kl_loss: bool = False
    score_source: str = "current"
    ref_model_path: Optional[str] = None
    pool: str = "valid"
    budget: str = "count"
    action: str = "gradient"
    kl_penalty_coef: float = 0.1
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    selected_clip_ratio_low: Optional[float] = None
    selected_clip_ratio_high: Optional[float] = None
    selected_kl_weight: float = 1.0
    shaping: str = "none"
    ar_alpha: float = 0.3
    entropy_alpha: float = 0.4
    entropy_kappa: float = 2.0
    phases: str = "one"
    lopti_eta: float = 0.5
    stapo_prob: float = 0.002
    stapo_entropy_quantile: float = 0.75

    def __post_init__(self) -> None:
        """Every check a rule can make on its own; those that need the actor's other settings are in
        :func:`check_with_actor`. Errors name the ``token_selection`` key, its valid values and the fix."""
        bad = invalid_rule_arg(self.ratio, self.direction, self.scope, self.pool)
        if bad is not None and bad[0] == "ratio":
            raise _err("token_selection.ratio", self.ratio, bad[2])
        _check_choice("token_selection.score", self.score, tuple(SCORE_REGISTRY))
        _check_choice("token_selection.direction", self.direction, DIRECTIONS)
        _check_choice("token_selection.scope", self.scope, SCOPES)
        _check_choice("token_selection.score_source", self.score_source, SCORE_SOURCES)
        self._check_scope_fits_source()
        _check_choice("token_selection.normaliser", self.normaliser, NORMALISERS)
        _check_choice("token_selection.pool", self.pool, POOLS)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise _err("token_selection.seed", self.seed, "an integer >= 0")
        _check_bool("token_selection.mask_entropy_bonus", self.mask_entropy_bonus)
        _check_bool("token_selection.mask_kl_loss", self.mask_kl_loss)
        if self.ref_model_path is not None and (not isinstance(self.ref_model_path, str) or not self.ref_model_path):
            raise _err("token_selection.ref_model_path", self.ref_model_path, "null or a local checkpoint folder")
        self._check_source_serves_score()
        self._check_action()
        self._check_shaping()
        self._check_mask_rule()

    def _check_shaping(self) -> None:
        _check_choice("token_selection.shaping", self.shaping, SHAPINGS)
        _check_number("token_selection.ar_alpha", self.ar_alpha, 0.0, 1.0, "a number in [0, 1]")
        _check_number("token_selection.entropy_alpha", self.entropy_alpha, 0.0, None, "a number >= 0")
        _check_number("token_selection.entropy_kappa", self.entropy_kappa, 1.0, None, "a number > 1")
        if self.entropy_kappa <= 1.0:
            raise _err("token_selection.entropy_kappa", self.entropy_kappa, "a number > 1",
                       "kappa > 1 keeps the shaped advantage's sign (the paper's condition; its value is 2).")
        _check_choice("token_selection.phases", self.phases, PHASES)
        _check_number("token_selection.lopti_eta", self.lopti_eta, 0.0, 1.0, "a number in (0, 1]")
        if self.lopti_eta <= 0.0:
            raise _err("token_selection.lopti_eta", self.lopti_eta, "a number in (0, 1]")
        if self.phases == "lopti" and self.action != "gradient":
            raise _err("token_selection.phases", "lopti", f"one (with action={self.action})",
                       "Lopti zeroes the other phase's advantages in each update pass; its reference defines that "
                       "for the plain policy gradient only. Fix: set token_selection.phases=one or action=gradient.")

    def _check_mask_rule(self) -> None:
        _check_number("token_selection.stapo_prob", self.stapo_prob, 0.0, 1.0, "a number in (0, 1]")
        if self.stapo_prob <= 0.0:
            raise _err("token_selection.stapo_prob", self.stapo_prob, "a number in (0, 1]")
        _check_number("token_selection.stapo_entropy_quantile", self.stapo_entropy_quantile, 0.0, 1.0,
                      "a number in [0, 1]")
        if self.normaliser == "kept" and self.score_source != "prepass":
            raise _err("token_selection.normaliser", "kept", "all or selected (with score_source="
                       f"{self.score_source}); kept needs score_source=prepass",
                       "the kept tokens' count over the whole mini-batch is the denominator, which only the pre-pass "
                       "knows before the first micro-batch's backward. Fix: set token_selection.score_source=prepass "
                       "or normaliser=all.")
        rule = SCORE_REGISTRY[self.score].mask_rule
        if rule is None:
            return
        keeps = "every valid token" if rule == "all" else "every token but STAPO's spurious ones"
        for key, want in (("ratio", 1.0), ("direction", "top"), ("budget", "count"), ("pool", "valid")):
            if getattr(self, key) != want:
                raise _err(f"token_selection.{key}", getattr(self, key), f"{want} (with score={self.score})",
                           f"score={self.score} has no budget: it keeps {keeps}, so {key} would be ignored. "
                           f"Fix: remove token_selection.{key}.")
        if rule == "stapo" and (self.scope != "mini_batch" or self.score_source != "prepass"
                                or self.normaliser != "kept"):
            key, value, want = next((k, getattr(self, k), w) for k, w in (("scope", "mini_batch"),
                                    ("score_source", "prepass"), ("normaliser", "kept")) if getattr(self, k) != w)
            raise _err(f"token_selection.{key}", value, f"{want} (with score=stapo)",
                       "STAPO takes its entropy quantile over each mini-batch's candidates, at the policy that "
                       "starts the mini-batch's update, and averages the loss over the kept tokens only. Fix: use "
                       "token_selector=stapo as it is (scope mini_batch, score_source prepass, normaliser kept).")

    def _check_action(self) -> None:
        _check_choice("token_selection.budget", self.budget, BUDGETS)
        if self.budget == "quantile" and (self.scope not in QUANTILE_SCOPES or self.direction != "top"
                                          or self.pool != "valid" or SCORE_REGISTRY[self.score].cov_rule):
            raise _err("token_selection.budget", "quantile",
                       f"count, or quantile with scope {' or '.join(QUANTILE_SCOPES)}, direction top, pool valid "
                       "and a score other than kl_cov / clip_cov",
                       f"got scope={self.scope}, direction={self.direction}, pool={self.pool}, score={self.score}. "
                       "Fix: set token_selection.budget=count or those keys.")
        _check_choice("token_selection.action", self.action, ACTIONS)
        _check_number("token_selection.kl_penalty_coef", self.kl_penalty_coef, 0.0, None, "a number >= 0")
        _check_number("token_selection.cov_lb", self.cov_lb, None, None, "a number")
        _check_number("token_selection.cov_ub", self.cov_ub, None, None, "a number > token_selection.cov_lb")
        if not self.cov_lb < self.cov_ub:
            raise _err("token_selection.cov_ub", self.cov_ub, f"a number > token_selection.cov_lb={self.cov_lb}")
        for key in ("selected_clip_ratio_low", "selected_clip_ratio_high"):
            if getattr(self, key) is not None:
                _check_number(f"token_selection.{key}", getattr(self, key), 0.0, 1.0,
                              "null (the actor's clip ratio) or a number in [0, 1)", open_high=True)
        _check_number("token_selection.selected_kl_weight", self.selected_kl_weight, 0.0, None, "a number >= 0")
        if self.action != "gradient" and self.normaliser != "all":
            raise _err("token_selection.normaliser", self.normaliser, f"all (with action={self.action})",
                       f"action={self.action} changes the selected tokens' loss and keeps every token in the "
                       "denominator, as its reference does. Fix: set token_selection.normaliser=all.")
        if SCORE_REGISTRY[self.score].cov_rule is None:
            return
        if self.scope not in COV_SCOPES:
            raise _err("token_selection.scope", self.scope, f"{', '.join(COV_SCOPES)} (with score={self.score})",
                       f"score={self.score} centres A and log pi on one pool's means, which needs one pool. Fix: "
                       "set token_selection.scope=mini_batch (exact over the data-parallel ranks, with "
                       "score_source=prepass) or micro_batch (verl's own loss_mode's pool).")
        if self.pool != "valid" or self.direction != "top":
            key, value = ("pool", self.pool) if self.pool != "valid" else ("direction", self.direction)
            raise _err(f"token_selection.{key}", value, f"{'valid' if key == 'pool' else 'top'} "
                       f"(with score={self.score})", f"score={self.score} follows verl's port: its budget is "
                       "max(1, int(ratio * N)) of the pool's valid tokens, highest first.")

    def _check_scope_fits_source(self) -> None:
        allowed = SOURCE_SCOPES[self.score_source]
        if self.scope in allowed:
            return
        fitting = [src for src, scopes in SOURCE_SCOPES.items() if self.scope in scopes]
        raise _err(
            "token_selection.scope",
            self.scope,
            f"{', '.join(allowed)} (with score_source={self.score_source})",
            f"scope={self.scope} needs the scores of its whole pool before the first backward, which "
            f"score_source={', '.join(fitting)} provides. Fix: set token_selection.score_source="
            f"{fitting[0]} or pick one of the scopes above.",
        )

    def _check_source_serves_score(self) -> None:
        if self.normaliser == "selected" and self.score_source != "current":
            raise _err(
                "token_selection.normaliser",
                "selected",
                "all (with any score_source), selected (only with score_source=current)",
                f"with score_source={self.score_source} the selection spans more than one micro-batch, so a "
                "per-micro-batch mean over selected tokens would weight them unequally. Fix: set "
                "token_selection.normaliser=all (the 80/20 paper's and GMTS' denominator).",
            )
        spec = SCORE_REGISTRY[self.score]
        if spec.needs_external and self.score_source != "rollout":
            raise _err(
                "token_selection.score_source",
                self.score_source,
                "rollout (with score=" + self.score + ")",
                f"token_selection.score={self.score} needs {', '.join(spec.needs_external)}, which only the driver "
                "computes, once per step, for the whole batch. Fix: set token_selection.score_source=rollout "
                "(scope batch, group or sequence; normaliser all).",
            )
        if self.ref_model_path is not None and "ref_entropy" not in spec.needs_external:
            raise _err(
                "token_selection.ref_model_path",
                self.ref_model_path,
                "null (with score=" + self.score + ")",
                f"token_selection.score={self.score} does not read a reference model, so the path would be ignored. "
                "Fix: remove it or set token_selection.score=ref_entropy.",
            )


# Presets. Each mirrors one reference semantics; docs/fidelity.md says how each differs from it.
PRESETS: dict[str, Optional[Selection]] = {
    # stock verl: no selection, loss and gradient bit-identical to verl's ppo_loss
    "none": None,
    # "Beyond the 80/20 Rule" (arXiv 2506.01939) released code: top 20% current-policy entropy,
    # ceil(0.2 N) over the valid tokens of one micro-batch on one rank, mean over selected tokens
    "forking": Selection(score="entropy", ratio=0.2, direction="top", scope="micro_batch", normaliser="selected"),
    # "Beyond the 80/20 Rule" paper formula: keep H >= tau over the whole training batch B (top 20% of
    # its response tokens, old-policy entropy, ranked on the driver), normalise by all response tokens
    "forking_paper": Selection(
        score="entropy", ratio=0.2, direction="top", scope="batch", normaliser="all", score_source="rollout"
    ),
    # the paper's negative control: train on the lowest-entropy 80%
    "forking_bottom": Selection(
        score="entropy", ratio=0.8, direction="bottom", scope="micro_batch", normaliser="selected"
    ),
    # random 20% with the same budget and normaliser as `forking` (control absent from the paper)
    "random": Selection(score="random", ratio=0.2, direction="top", scope="micro_batch", normaliser="selected"),
    # GMTS (arXiv 2608.30632): delta = H * |r A 1[not clipped]| measured by a no-grad forward at the
    # start of each PPO mini-batch, top 20% within each prompt group (all its responses, whatever rank
    # or position they sit at), normalise by all tokens
    "gmts": Selection(
        score="gmts", ratio=0.2, direction="top", scope="group", normaliser="all", score_source="prepass"
    ),
    # exact logit-gradient norm |omega| * ||e_a - p||, top 20%, normalise by all tokens
    "grad_norm": Selection(score="grad_norm", ratio=0.2, direction="top", scope="micro_batch", normaliser="all"),
    # KL-Cov (Cui et al., arXiv 2505.22617): the top max(1, int(ratio * N)) covariances
    # (A - mean A)(log pi - mean log pi) of the whole optimizer mini-batch, exact over the data-parallel ranks,
    # measured at its start, get kl_penalty_coef * |log r| on an unclipped surrogate; verl 0.9.1's defaults
    # (kl_cov_ratio 2e-4, ppo_kl_coef 0.1), so only the pool differs from loss_mode=kl_cov
    "kl_cov_global": Selection(score="kl_cov", ratio=2e-4, direction="top", scope="mini_batch", normaliser="all",
                               score_source="prepass", action="kl_penalty", kl_penalty_coef=0.1),
    # Clip-Cov (same paper): of the mini-batch's tokens with cov_lb < cov < cov_ub not already clipped, a keyed
    # draw of max(1, int(ratio * N)) get no policy loss; verl 0.9.1's defaults (clip_cov_ratio 2e-4, bounds 1, 5)
    "clip_cov_global": Selection(score="clip_cov", ratio=2e-4, direction="top", scope="mini_batch", normaliser="all",
                                 score_source="prepass", action="zero_loss", cov_lb=1.0, cov_ub=5.0),
    # Archer (arXiv 2507.15778, released code wizard-III/ArcherCodeR): per response, the tokens above its 0.8
    # entropy quantile (current policy) are clipped at 0.5 / 0.5 with no KL; the others keep the actor's clip
    # (0.2 / 0.2 in Archer's scripts) and the KL loss (use_kl_loss, low_var_kl, 0.001)
    "archer": Selection(score="entropy", ratio=0.2, direction="top", scope="sequence", normaliser="all",
                        budget="quantile", action="clip_class", selected_clip_ratio_low=0.5,
                        selected_clip_ratio_high=0.5, selected_kl_weight=0.0),
    # AR (Yang et al., arXiv 2505.12929; code zhyang2226/AR-Lopti): every token's advantage times
    # alpha * pi_old + 1 - alpha; alpha 0.3 (the paper's K&K figure; its AR-only script 0.2, its math table 0.1)
    "ar": Selection(score="all", ratio=1.0, direction="top", scope="micro_batch", normaliser="all", shaping="ar",
                    ar_alpha=0.3),
    # Lopti (same paper): a first whole update pass on the tokens with pi_old < eta (0.5), then one on the rest,
    # each with the other tokens' advantages zeroed and kept in the denominator
    "lopti": Selection(score="all", ratio=1.0, direction="top", scope="micro_batch", normaliser="all",
                       phases="lopti", lopti_eta=0.5),
    # the paper's best setting on K&K: AR (alpha 0.3) and Lopti (eta 0.5) together (its AR-Lopti script)
    "ar_lopti": Selection(score="all", ratio=1.0, direction="top", scope="micro_batch", normaliser="all",
                          shaping="ar", ar_alpha=0.3, phases="lopti", lopti_eta=0.5),
    # entropy advantage shaping (Cheng et al., arXiv 2506.14758, Eq. 5-6): A + min(alpha * H.detach(), |A| / kappa)
    # on every token, H the update pass's entropy; alpha 0.4 (GRPO; 0.1 for PPO), kappa 2 (Sec. 4)
    "entropy_adv": Selection(score="all", ratio=1.0, direction="top", scope="micro_batch", normaliser="all",
                             shaping="entropy", entropy_alpha=0.4, entropy_kappa=2.0),
    # STAPO (arXiv 2602.15620, Sec. 3 and 5.1): the spurious tokens (A > 0, pi < 0.002, H under the 0.75 entropy
    # quantile of those candidates in each mini-batch, at the policy starting its update) leave the loss, which is
    # the token-mean over the kept tokens of the whole mini-batch
    "stapo": Selection(score="stapo", ratio=1.0, direction="top", scope="mini_batch", normaliser="kept",
                       score_source="prepass", stapo_prob=0.002, stapo_entropy_quantile=0.75),
}


@dataclass
class TokenSelectionConfig:
    """Per-knob overrides of the preset named by ``actor_rollout_ref.actor.token_selector``.

    Every knob defaults to ``None`` = "use the preset's value"; setting a knob while
    ``token_selector=none`` is an error (nothing is silently ignored).
    """

    ratio: Optional[float] = field(
        default=None,
        metadata={"help": "Fraction of the scope's valid tokens the rule selects, in (0, 1]; "
                  "exactly ceil(ratio*N) tokens (scores kl_cov / clip_cov: max(1, int(ratio*N)), verl's).",
                  "paper": "0.2 (80/20 and GMTS); 2e-4 (verl's KL-Cov / Clip-Cov)"},
    )
    score: Optional[str] = field(
        default=None,
        metadata={"help": f"Per-token ranking score: one of {', '.join(SCORE_REGISTRY)} (or a registered one).",
                  "paper": "entropy (80/20); gmts (GMTS)"},
    )
    direction: Optional[str] = field(
        default=None,
        metadata={"help": "Keep the highest (top) or lowest (bottom) scores.",
                  "paper": "top; bottom for the 80/20 negative control"},
    )
    scope: Optional[str] = field(
        default=None,
        metadata={"help": f"Pool the budget is taken from: one of {', '.join(SCOPES)}. micro_batch_dp and "
                  "mini_batch are exact over all data-parallel ranks; group = the responses sharing a "
                  "prompt (uid); batch = the whole training batch of a step. Each score_source allows: "
                  + "; ".join(f"{k}: {', '.join(v)}" for k, v in SOURCE_SCOPES.items()) + ".",
                  "paper": "batch (80/20 paper), micro_batch (80/20 code), group (GMTS)"},
    )
    score_source: Optional[str] = field(
        default=None,
        metadata={"help": f"When the scores are measured: one of {', '.join(SCORE_SOURCES)}. current = in the "
                  "update forward of each micro-batch; prepass = a no-grad forward at the start of each "
                  "PPO mini-batch; rollout = verl's old-log-prob pass, mask computed on the driver.",
                  "paper": "rollout (80/20 paper), current (80/20 code), prepass (GMTS)"},
    )
    normaliser: Optional[str] = field(
        default=None,
        metadata={"help": "Token-mean denominator: all valid tokens (paper formula); each micro-batch's "
                  "selected tokens, the micro-batch weighted by its share of the mini-batch's responses "
                  "(80/20 released code; needs loss_agg_mode=token-mean); or kept = the selected tokens of the "
                  "whole mini-batch over all ranks, which are then the loss's only tokens (score_source=prepass).",
                  "paper": "all (80/20 paper, GMTS); selected (80/20 code); kept (STAPO)"},
    )
    pool: Optional[str] = field(
        default=None,
        metadata={"help": f"Tokens of the scope the budget is a fraction of: {' or '.join(POOLS)}. valid = every "
                  "valid response token; nonzero = only tokens whose score is not exactly 0 (the released GMTS "
                  "code, whose padding filter also drops clipped tokens and zero-advantage groups).",
                  "paper": "valid (80/20; GMTS paper: a fraction of the responses' tokens); nonzero (GMTS code)"},
    )
    seed: Optional[int] = field(
        default=None,
        metadata={"help": "Seed of the random score; a token's draw depends only on (seed, the token ids of its "
                  "prompt and response, its position), so every rank, micro-batch split and rerun draws the same.",
                  "paper": "n/a"},
    )
    mask_entropy_bonus: Optional[bool] = field(
        default=None,
        metadata={"help": "Apply the mask to the entropy bonus (entropy_coeff) too.",
                  "paper": "false (80/20 code used all tokens)"},
    )
    mask_kl_loss: Optional[bool] = field(
        default=None,
        metadata={"help": "Apply the mask to the KL loss (use_kl_loss) too.",
                  "paper": "false (80/20 code, GMTS, TRL keep KL on all tokens)"},
    )
    ref_model_path: Optional[str] = field(
        default=None,
        metadata={"help": "Local HF checkpoint whose per-token entropy the ref_entropy score ranks by "
                  "(computed on the driver, score_source=rollout); null = actor_rollout_ref.model.path.",
                  "paper": "the base model (80/20: > 86% top-20% overlap of base and RL model)"},
    )
    budget: Optional[str] = field(
        default=None,
        metadata={"help": f"How many tokens the rule selects: one of {', '.join(BUDGETS)}. count = ceil(ratio*N) of "
                  "the scope's pool (scores kl_cov / clip_cov: max(1, int(ratio*N)), verl's); quantile = the tokens "
                  "strictly above the (1 - ratio) quantile of their response (scope sequence) or micro-batch, "
                  "linear interpolation.", "paper": "count; quantile (Archer: per-response 0.8 quantile)"},
    )
    action: Optional[str] = field(
        default=None,
        metadata={"help": f"What the selected tokens get: one of {', '.join(ACTIONS)}. gradient = only they keep the "
                  "policy gradient; kl_penalty = kl_penalty_coef*|log r| added, every token's surrogate unclipped "
                  "(KL-Cov); zero_loss = their policy loss zeroed (Clip-Cov); clip_class = their own clip bounds and "
                  "KL weight (selected_*), the others the actor's (Archer).",
                  "paper": "gradient (80/20, GMTS); kl_penalty (KL-Cov); zero_loss (Clip-Cov); clip_class (Archer)"},
    )
    kl_penalty_coef: Optional[float] = field(
        default=None,
        metadata={"help": "action=kl_penalty: coefficient of |log r| on the selected tokens (verl's "
                  "policy_loss.ppo_kl_coef).", "paper": "0.1 (verl 0.9.1 default); 1 (KL-Cov released scripts)"},
    )
    cov_lb: Optional[float] = field(
        default=None,
        metadata={"help": "score=clip_cov: candidates have covariance > cov_lb (verl's policy_loss.clip_cov_lb).",
                  "paper": "1 (Clip-Cov)"},
    )
    cov_ub: Optional[float] = field(
        default=None,
        metadata={"help": "score=clip_cov: candidates have covariance < cov_ub (verl's policy_loss.clip_cov_ub).",
                  "paper": "5 (Clip-Cov)"},
    )
    selected_clip_ratio_low: Optional[float] = field(
        default=None,
        metadata={"help": "action=clip_class: the selected tokens' lower clip ratio (null: the actor's "
                  "clip_ratio_low).", "paper": "0.5 (Archer, high-entropy tokens)"},
    )
    selected_clip_ratio_high: Optional[float] = field(
        default=None,
        metadata={"help": "action=clip_class: the selected tokens' upper clip ratio (null: the actor's "
                  "clip_ratio_high).", "paper": "0.5 (Archer, high-entropy tokens)"},
    )
    selected_kl_weight: Optional[float] = field(
        default=None,
        metadata={"help": "action=clip_class: factor of the KL loss (use_kl_loss) on the selected tokens; the others "
                  "keep 1.", "paper": "0 (Archer: no KL on high-entropy tokens)"},
    )
    shaping: Optional[str] = field(
        default=None,
        metadata={"help": f"Advantage shaping before the policy loss (and before a score that reads the advantage): "
                  f"one of {', '.join(SHAPINGS)}. ar = A * (ar_alpha * pi_old + 1 - ar_alpha); entropy = A + "
                  "min(entropy_alpha * H, |A| / entropy_kappa), H the update pass's entropy, detached.",
                  "paper": "ar (AR, arXiv 2505.12929); entropy (arXiv 2506.14758)"},
    )
    ar_alpha: Optional[float] = field(
        default=None,
        metadata={"help": "shaping=ar: alpha in [0, 1] of A * (alpha * pi_old + 1 - alpha).",
                  "paper": "0.3 (K&K figure, AR-Lopti script); 0.2 (AR-only script); 0.1 (math table)"},
    )
    entropy_alpha: Optional[float] = field(
        default=None,
        metadata={"help": "shaping=entropy: alpha of min(alpha * H, |A| / kappa).", "paper": "0.4 (GRPO); 0.1 (PPO)"},
    )
    entropy_kappa: Optional[float] = field(
        default=None,
        metadata={"help": "shaping=entropy: kappa > 1 of min(alpha * H, |A| / kappa); the shaped advantage keeps its "
                  "sign.", "paper": "2"},
    )
    phases: Optional[str] = field(
        default=None,
        metadata={"help": f"Update schedule: one of {', '.join(PHASES)}. lopti = two whole update passes per step "
                  "(every mini-batch, every epoch): first the tokens with pi_old < lopti_eta, then the rest, the "
                  "other tokens' advantages, KL and entropy terms zeroed and kept in the denominators; both passes "
                  "use the step's old log-probs, so a step makes twice the optimizer and lr-scheduler steps.",
                  "paper": "lopti (Lopti, arXiv 2505.12929)"},
    )
    lopti_eta: Optional[float] = field(
        default=None,
        metadata={"help": "phases=lopti: the first pass updates the tokens with pi_old < eta (strict).",
                  "paper": "0.5 (paper; AR-Lopti script); 0.4 (Lopti-only script)"},
    )
    stapo_prob: Optional[float] = field(
        default=None,
        metadata={"help": "score=stapo: tau_p, a spurious token has pi < tau_p (and A > 0).",
                  "paper": "0.002 (STAPO v1, Sec. 5.1)"},
    )
    stapo_entropy_quantile: Optional[float] = field(
        default=None,
        metadata={"help": "score=stapo: q; a candidate (A > 0, pi < tau_p) is spurious when its entropy is under the q "
                  "quantile of the mini-batch's candidates (exact over the data-parallel ranks).",
                  "paper": "0.75 (STAPO v1, Sec. 5.1)"},
    )
    auto_enable_entropy: bool = field(
        default=True,
        metadata={"help": "Turn on actor.calculate_entropy for the update pass when the score needs "
                  "entropy; false makes that an error instead.", "paper": "n/a"},
    )
    no_grad_scores: bool = field(
        default=True,
        metadata={"help": "Compute the update pass's entropy and sum_j p_j^2 without an autograd graph, in "
                  "vocabulary-bounded chunks, when nothing needs their gradient (entropy_coeff = 0; FSDP/FSDP2 "
                  "engines, no fused kernels); false keeps verl's graph.",
                  "paper": "n/a (stock verl keeps the graph; TRL computes its selection entropy under no_grad)"},
    )
    prepass_reuse: bool = field(
        default=True,
        metadata={"help": "score_source=prepass: where the pre-pass would measure the weights verl's old-log-prob "
                  "pass measured (the first mini-batch of the first PPO epoch of a step; every mini-batch with "
                  "one mini-batch per step), use that pass's log-probs and entropy instead of a second forward; "
                  "false always runs the forward.",
                  "paper": "n/a (the GMTS code always runs its forward)"},
    )

    def __post_init__(self) -> None:
        for name in ENGINE_SWITCHES:
            _check_bool(f"token_selection.{name}", getattr(self, name))

    def overrides(self) -> dict[str, Any]:
        """The knobs set by the user (not None), excluding the engine switches (auto_enable_entropy,
        no_grad_scores), which are not part of a preset."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ENGINE_SWITCHES and getattr(self, f.name) is not None
        }


def resolve_selection(
    token_selector: Any,
    overrides: Optional[TokenSelectionConfig] = None,
    **actor: Any,
) -> Optional[Selection]:
    """The preset named ``token_selector`` with the knobs of ``overrides``, or None for ``none``.

    The rule validates itself (:class:`Selection`); ``actor`` holds the actor settings of
    :func:`check_with_actor` (defaults: verl's). Raises :class:`TokenSelectionConfigError` naming the key.
    """
    overrides = overrides if overrides is not None else TokenSelectionConfig()
    if not isinstance(token_selector, str) or token_selector not in PRESETS:
        raise _err("token_selector", token_selector, ", ".join(PRESETS))
    preset = PRESETS[token_selector]
    given = overrides.overrides()
    if preset is None:
        if given:
            keys = ", ".join(f"token_selection.{k}" for k in given)
            raise TokenSelectionConfigError(
                f"actor_rollout_ref.actor.{keys} set while actor_rollout_ref.actor.token_selector=none; "
                f"these knobs would be ignored. Fix: pick a selector ({', '.join(p for p in PRESETS if p != 'none')}) "
                "or remove the overrides."
            )
        return None
    sel = replace(preset, **given)
    _check_knobs_serve_rule(token_selector, sel, given)
    check_with_actor(sel, auto_enable_entropy=overrides.auto_enable_entropy, **actor)
    return sel


#: knobs that only one kind of rule reads: (what the rule must be, the test on the resolved rule)
RULE_KNOBS = {
    "kl_penalty_coef": ("action=kl_penalty", lambda s: s.action == "kl_penalty"),
    "cov_lb": ("score=clip_cov", lambda s: SCORE_REGISTRY[s.score].cov_rule == "clip_cov"),
    "cov_ub": ("score=clip_cov", lambda s: SCORE_REGISTRY[s.score].cov_rule == "clip_cov"),
    "selected_clip_ratio_low": ("action=clip_class", lambda s: s.action == "clip_class"),
    "selected_clip_ratio_high": ("action=clip_class", lambda s: s.action == "clip_class"),
    "selected_kl_weight": ("action=clip_class", lambda s: s.action == "clip_class"),
    "ar_alpha": ("shaping=ar", lambda s: s.shaping == "ar"),
    "entropy_alpha": ("shaping=entropy", lambda s: s.shaping == "entropy"),
    "entropy_kappa": ("shaping=entropy", lambda s: s.shaping == "entropy"),
    "lopti_eta": ("phases=lopti", lambda s: s.phases == "lopti"),
    "stapo_prob": ("score=stapo", lambda s: SCORE_REGISTRY[s.score].mask_rule == "stapo"),
    "stapo_entropy_quantile": ("score=stapo", lambda s: SCORE_REGISTRY[s.score].mask_rule == "stapo"),
}


def _check_knobs_serve_rule(token_selector: str, sel: Selection, given: dict[str, Any]) -> None:
    """A knob set for a rule that does not read it would be silently ignored: refuse it, naming it."""
    for key in sorted(given):
        if key in RULE_KNOBS and not RULE_KNOBS[key][1](sel):
            raise _err(
                f"token_selection.{key}", given[key], f"null (with token_selector={token_selector}, action="
                f"{sel.action}, score={sel.score})", f"only a rule with {RULE_KNOBS[key][0]} reads it, so it would "
                f"be ignored. Fix: remove token_selection.{key} (a recipe may set it for its own preset: "
                f"override it with token_selection.{key}=null) or pick a preset that reads it.")


def check_with_actor(
    sel: Selection,
    *,
    auto_enable_entropy: bool = True,
    loss_agg_mode: str = "token-mean",
    loss_mode: str = "vanilla",
    calculate_entropy: bool = False,
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_type: str = "low_var_kl",
) -> None:
    """The checks of a rule that need the actor's other settings (``actor_rollout_ref.actor.*``)."""
    if sel.normaliser == "selected" and loss_agg_mode != "token-mean":
        raise _err(
            "token_selection.normaliser",
            "selected",
            "all (with any loss_agg_mode), selected (only with loss_agg_mode=token-mean)",
            f"actor_rollout_ref.actor.loss_agg_mode is {loss_agg_mode!r}; a mean over selected tokens is only "
            "defined for token-mean. Fix: set token_selection.normaliser=all or loss_agg_mode=token-mean.",
        )
    _check_action_with_actor(sel, loss_mode, use_kl_loss)
    spec = SCORE_REGISTRY[sel.score]
    if (spec.needs_entropy or sel.shaping == "entropy") and not (calculate_entropy or entropy_coeff != 0
                                                                  or auto_enable_entropy):
        raise _err(
            "calculate_entropy",
            calculate_entropy,
            "true",
            f"token_selection.score={sel.score} / shaping={sel.shaping} reads the policy entropy, which the engine "
            "only computes "
            "when calculate_entropy=true or entropy_coeff != 0, and token_selection.auto_enable_entropy=false. "
            "Fix: set actor_rollout_ref.actor.calculate_entropy=true or token_selection.auto_enable_entropy=true.",
        )
    if not spec.needs_omega:
        return
    if loss_mode not in OMEGA_LOSS_MODES:
        raise _err(
            "policy_loss.loss_mode",
            loss_mode,
            ", ".join(OMEGA_LOSS_MODES),
            f"token_selection.score={sel.score} uses omega = r*A*1[not clipped] of the token-level clipped "
            "surrogate. Fix: use loss_mode=vanilla or a score without omega (entropy, random).",
        )
    if use_kl_loss and kl_loss_type not in OMEGA_KL_TYPES:
        raise _err(
            "kl_loss_type",
            kl_loss_type,
            ", ".join(OMEGA_KL_TYPES),
            f"token_selection.score={sel.score} adds the KL term's gradient weight to omega.",
        )


def _check_action_with_actor(sel: Selection, loss_mode: str, use_kl_loss: bool) -> None:
    if sel.action == "gradient":
        return
    if loss_mode not in ACTION_LOSS_MODES:
        raise _err(
            "policy_loss.loss_mode", loss_mode, f"{', '.join(ACTION_LOSS_MODES)} (with token_selection.action="
            f"{sel.action})", f"action={sel.action} computes the policy loss itself (verl's "
            f"{'kl_cov' if sel.action == 'kl_penalty' else 'clip_cov' if sel.action == 'zero_loss' else 'vanilla'} "
            "maths with the rule's per-token outputs), so it cannot also run loss_mode's. Fix: set "
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla (verl's default)."
            + (" The preset already is the global version of verl's loss_mode=" + loss_mode + "."
               if loss_mode in ("kl_cov", "clip_cov") else ""))
    if sel.action == "clip_class" and sel.selected_kl_weight != 1.0 and not use_kl_loss:
        raise _err(
            "use_kl_loss", use_kl_loss, f"true (with token_selection.selected_kl_weight={sel.selected_kl_weight})",
            "the rule weights the KL loss per token, and the KL loss is off. Fix: set "
            "actor_rollout_ref.actor.use_kl_loss=true (Archer: kl_loss_coef=0.001, kl_loss_type=low_var_kl), or "
            "token_selection.selected_kl_weight=1 to run without a KL term.")


def register_preset(name: str, selection: Selection) -> Selection:
    """Add a ``token_selector`` preset; refuses to overwrite an existing name.

    The registration must run in every process that converts the actor config (driver, TaskRunner,
    workers): put it in a module listed in ``VERL_USE_EXTERNAL_MODULES`` or in your own
    ``verl.plugins`` entry point. ``score`` must name a registered score.
    """
    if name in PRESETS:
        raise ValueError(f"token_selector preset {name!r} already exists; pick another name")
    if not isinstance(selection, Selection):  # a Selection validated itself when it was built
        raise TypeError(f"register_preset needs a Selection, got {type(selection).__name__}")
    PRESETS[name] = selection
    return selection


def knob_table_rows() -> list[tuple[str, str, str, str]]:
    """(name, default, paper value, meaning) for every knob, for the README table."""
    rows = [("token_selector", "none", "forking / gmts", "Preset: " + ", ".join(PRESETS) + ".")]
    for f in fields(TokenSelectionConfig):
        default = "preset" if f.default is None else str(f.default).lower()
        rows.append((f"token_selection.{f.name}", default, f.metadata["paper"], f.metadata["help"]))
    return rows
