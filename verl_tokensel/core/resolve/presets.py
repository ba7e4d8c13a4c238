"""The presets: each a rule name and values of its knobs (and of the shared ones). No verl import.

``actor_rollout_ref.actor.token_selector=<name>`` picks one; ``token_selection.<knob>=...`` overrides its values.
Each mirrors one reference semantics; docs/fidelity.md says how each differs from it, docs/toolbox.md its source.
``register_preset`` adds one from user code (``examples/custom_preset.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY
from verl_tokensel.core.seam.checks import validate
from verl_tokensel.core.ranking.scopes import SOURCE_SCOPES
from verl_tokensel.core.resolve.selection import Selection


def preset(rule: str, *, shaping: str = "none", shaping_knobs: Optional[dict[str, Any]] = None,
           **values: Any) -> Selection:
    """A :class:`Selection` of ``rule``: ``values`` are the shared keys and the rule's knobs (its ``Knobs``
    fields), ``shaping_knobs`` those of ``shaping``."""
    knobs_cls = RULE_REGISTRY[rule].Knobs
    own = {f for f in knobs_cls.__dataclass_fields__}
    knobs = knobs_cls(**{k: v for k, v in values.items() if k in own})
    shared = {k: v for k, v in values.items() if k not in own}
    shaped = None if shaping == "none" else SHAPING_REGISTRY[shaping].Knobs(**(shaping_knobs or {}))
    sel = Selection(rule=rule, knobs=knobs, shaping=shaping, shaping_knobs=shaped, **{**_fitting(rule), **shared})
    validate(sel)
    return sel


def _fitting(rule: str) -> dict[str, str]:
    """The shared keys a rule runs with when its preset does not set them: the first score source, scope and
    normaliser its ``Needs`` allows (for the default ``Needs``: current, micro_batch, all)."""
    needs = RULE_REGISTRY[rule].needs
    source = next((s for s in SOURCE_SCOPES if needs.sources.get(s)), "current")
    return {"score_source": source, "scope": needs.sources[source][0], "normaliser": needs.normalisers[0]}

PRESETS: dict[str, Optional[Selection]] = {
    # stock verl: no selection, loss and gradient bit-identical to verl's ppo_loss
    "none": None,
    # "Beyond the 80/20 Rule" (arXiv 2506.01939) released code: top 20% current-policy entropy,
    # ceil(0.2 N) over the valid tokens of one micro-batch on one rank, mean over selected tokens
    "forking": preset("gradient_mask", score="entropy", ratio=0.2, scope="micro_batch", normaliser="selected"),
    # "Beyond the 80/20 Rule" paper formula: keep H >= tau over the whole training batch B (top 20% of
    # its response tokens, old-policy entropy, ranked on the driver), normalise by all response tokens
    "forking_paper": preset("gradient_mask", score="entropy", ratio=0.2, scope="batch", normaliser="all",
                            score_source="rollout"),
    # the paper's negative control: train on the lowest-entropy 80%
    "forking_bottom": preset("gradient_mask", score="entropy", ratio=0.8, direction="bottom", scope="micro_batch",
                             normaliser="selected"),
    # random 20% with the same budget and normaliser as `forking` (control absent from the paper)
    "random": preset("gradient_mask", score="random", ratio=0.2, scope="micro_batch", normaliser="selected"),
    # GMTS (arXiv 2608.30632): delta = H * |r A 1[not clipped]| measured by a no-grad forward at the
    # start of each PPO mini-batch, top 20% within each prompt group (all its responses, whatever rank
    # or position they sit at), normalise by all tokens
    "gmts": preset("gradient_mask", score="gmts", ratio=0.2, scope="group", normaliser="all", score_source="prepass"),
    # exact logit-gradient norm |omega| * ||e_a - p||, top 20%, normalise by all tokens
    "grad_norm": preset("gradient_mask", score="grad_norm", ratio=0.2, scope="micro_batch", normaliser="all"),
    # KL-Cov (Cui et al., arXiv 2505.22617): the top max(1, int(ratio * N)) covariances
    # (A - mean A)(log pi - mean log pi) of the whole optimizer mini-batch, exact over the data-parallel ranks,
    # measured at its start, get kl_penalty_coef * |log r| on an unclipped surrogate; verl 0.9.1's defaults
    # (kl_cov_ratio 2e-4, ppo_kl_coef 0.1), so only the pool differs from loss_mode=kl_cov
    "kl_cov_global": preset("kl_cov", score="kl_cov", ratio=2e-4, scope="mini_batch", normaliser="all",
                            score_source="prepass", kl_penalty_coef=0.1),
    # Clip-Cov (same paper): of the mini-batch's tokens with cov_lb < cov < cov_ub not already clipped, a keyed
    # draw of max(1, int(ratio * N)) get no policy loss; verl 0.9.1's defaults (clip_cov_ratio 2e-4, bounds 1, 5)
    "clip_cov_global": preset("clip_cov", score="clip_cov", ratio=2e-4, scope="mini_batch", normaliser="all",
                              score_source="prepass", cov_lb=1.0, cov_ub=5.0),
    # Archer (arXiv 2507.15778, released code wizard-III/ArcherCodeR): per response, the tokens above its 0.8
    # entropy quantile (current policy) are clipped at 0.5 / 0.5 with no KL; the others keep the actor's clip
    # (0.2 / 0.2 in Archer's scripts) and the KL loss (use_kl_loss, low_var_kl, 0.001), its token-mean per class
    "archer": preset("archer", score="entropy", ratio=0.2, scope="sequence", normaliser="all", budget="quantile",
                     selected_clip_ratio_low=0.5, selected_clip_ratio_high=0.5, selected_kl_weight=0.0,
                     archer_kl_mean="class"),
    # AR (Yang et al., arXiv 2505.12929; code zhyang2226/AR-Lopti): every token's advantage times
    # alpha * pi_old + 1 - alpha; alpha 0.3 (the paper's K&K figure; its AR-only script 0.2, its math table 0.1)
    "ar": preset("gradient_mask", score="all", ratio=1.0, shaping="ar", shaping_knobs=dict(ar_alpha=0.3)),
    # Lopti (same paper): a first whole update pass on the tokens with pi_old < eta (0.5), then one on the rest,
    # each with the other tokens' advantages zeroed and kept in the denominator
    "lopti": preset("lopti", lopti_eta=0.5),
    # the paper's best setting on K&K: AR (alpha 0.3) and Lopti (eta 0.5) together (its AR-Lopti script)
    "ar_lopti": preset("lopti", lopti_eta=0.5, shaping="ar", shaping_knobs=dict(ar_alpha=0.3)),
    # entropy advantage shaping (Cheng et al., arXiv 2506.14758, Eq. 5-6): A + min(alpha * H.detach(), |A| / kappa)
    # on every token, H the update pass's entropy; alpha 0.4 (GRPO; 0.1 for PPO), kappa 2 (Sec. 4)
    "entropy_adv": preset("gradient_mask", score="all", ratio=1.0, shaping="entropy_adv",
                          shaping_knobs=dict(entropy_alpha=0.4, entropy_kappa=2.0)),
    # STAPO (arXiv 2602.15620, Sec. 3 and 5.1): the spurious tokens (A > 0, pi < 0.002, H under the 0.75 entropy
    # quantile of those candidates in each mini-batch, at the policy starting its update) leave the loss, which is
    # the token-mean over the kept tokens of the whole mini-batch
    "stapo": preset("stapo", scope="mini_batch", normaliser="kept", score_source="prepass", stapo_prob=0.002,
                    stapo_entropy_quantile=0.75),
    # CE-GPPO (arXiv 2509.20712, released code Kwai-Klear/CE-GPPO): every token keeps its gradient, the clipped ones
    # a bounded one: beta1 (0.75) for r < 1 - eps with A < 0, beta2 (1.0) for r > 1 + eps with A > 0
    "ce_gppo": preset("ce_gppo", ce_gppo_beta1=0.75, ce_gppo_beta2=1.0),
    # ASPO (arXiv 2510.06062, released code wizard-III/Archer2.0): per response, the tokens above its 0.8 entropy
    # quantile get clip 0.4 / 0.4, the others the actor's (0.2); A > 0 tokens the flipped ratio and its soft dual clip
    "aspo": preset("aspo", score="entropy", ratio=0.2, scope="sequence", normaliser="all", budget="quantile",
                   aspo_clip_ratio_low=0.4, aspo_clip_ratio_high=0.4),
    # KTAE (arXiv 2505.16826, released code xiaolizh1/KTAE): per prompt group, each token id's bounded key-token
    # score (Fisher exact test, information gain, Cohen's h and BM25 term frequencies of correct vs wrong responses)
    # added to every token's advantage; computed on the driver, where the whole group is; the release's constants
    "ktae": preset("ktae", scope="group", normaliser="all", score_source="rollout", ktae_alpha=1.0, ktae_beta=1.0,
                   ktae_tf=True, ktae_top=1.0),
    # GTPO (arXiv 2508.03772, released code winstonsmith1897/GTPO): within each prompt group, the conflict tokens (same
    # id at the same position, from the start or from the end, in a positive and a negative response) skip the
    # negative update and get the positive one doubled; responses above 0.7 mean entropy get no update, the others
    # A - 0.1 H; each response divided by its conflict count; computed on the driver
    "gtpo": preset("gtpo", scope="group", normaliser="all", score_source="rollout", gtpo_conflict_weight=2.0,
                   gtpo_entropy_threshold=0.7, gtpo_entropy_scale=0.1),
    # FIPO (arXiv 2603.19835, released in ms-swift as loss_type=fipo): every token's advantage times
    # clip(exp(FutureKL), 1, 1.2), FutureKL the response's 2^(-1/32)-discounted sum of log pi - log pi_old from the
    # token on (current log-probs); A < 0 tokens with r > 4 keep a weight in [0.8, 1]
    "fipo": preset("fipo", fipo_decay_rate=32.0, fipo_clip_range=0.2, fipo_clip_high_only=True,
                   fipo_safety_threshold=4.0),
    # M2PO (arXiv 2510.01161, released as AReaL's m2_threshold): the tokens of largest (log pi_rollout -
    # log pi_old)^2 leave the loss until the mean of the rest is under 0.04, the pool the whole mini-batch over all
    # data-parallel ranks (AReaL: each rank's micro-batch); the loss is the token-mean over the kept tokens
    "m2po_global": preset("m2po", scope="mini_batch", normaliser="kept", score_source="prepass",
                          m2po_threshold=0.04),
    # DelTA (arXiv 2605.21467, released code RUCBM/DelTA): every token's advantage times a weight in [0.8, 1.2] (mean
    # 1) from how close v = (1 - p) h (h the last hidden state) lies to the positive vs the negative tokens' centroid,
    # measured before the update by K + 3 passes over the step's batch, summed over every data-parallel rank
    # Lp-Reg (arXiv 2510.03222, released code CarlanLark/Lp-Reg-dev): the 1% lowest-probability A < 0 tokens of the
    # mini-batch (over all data-parallel ranks) whose log-prob is under the old policy's min-p proxy (kappa 0.02) get
    # -A r + k3 to the proxy instead of the clip; the proxy from verl's old-log-prob pass
    "lp_reg": preset("lp_reg", scope="mini_batch", normaliser="all", score_source="prepass", lp_reg_kappa=0.02,
                     lp_reg_rho=0.01, lp_reg_beta=1.0),
    # SimKO (arXiv 2510.14807, released code CLR-Lab/SimKO): a correct response's tokens above its 0.8 entropy
    # quantile spread 1% of their ratio over the current top-3 log-probs; a wrong response's hot argmax tokens
    # weigh 1.1
    "simko": preset("simko", normaliser="all", simko_k=3, simko_mix=0.01, simko_quantile=0.8, simko_neg_scale=1.1),
    "delta": preset("delta", delta_k=1, delta_lam_min=0.8, delta_lam_max=1.2, delta_impl="Normal",
                    delta_stats="global"),
}


def register_preset(name: str, *, rule: str, **values: Any) -> Selection:
    """Add a ``token_selector`` preset ``name``: the registered ``rule`` with values of the shared keys and of its
    knobs (as :func:`preset`, ``shaping=`` / ``shaping_knobs=`` included); refuses to overwrite a name. The knobs the
    preset leaves out take their defaults, and every knob can be set on the command line (``token_selection.<knob>``).

    The registration must run in every process that converts the actor config (driver, TaskRunner, workers): put it
    in a module listed in ``VERL_USE_EXTERNAL_MODULES`` or in your own ``verl.plugins`` entry point.
    """
    if name in PRESETS:
        raise ValueError(f"token_selector preset {name!r} already exists; pick another name")
    if rule not in RULE_REGISTRY:
        raise ValueError(f"register_preset({name!r}): rule {rule!r} is not registered; registered: "
                         f"{', '.join(RULE_REGISTRY)}")
    PRESETS[name] = preset(rule, **values)
    return PRESETS[name]


def selectors() -> tuple[str, ...]:
    """Every valid ``token_selector``: the presets, then each registered rule that no preset names (its knobs'
    defaults; a rule with presets is reached through them)."""
    used = {sel.rule for sel in PRESETS.values() if sel is not None}
    return (*PRESETS, *(name for name in RULE_REGISTRY if name not in PRESETS and name not in used))


def selection_for(name: str) -> Optional[Selection]:
    """What ``token_selector=name`` trains with: the preset ``name``, else the registered rule ``name`` (one no preset
    names) with its knobs' defaults and the first score source, scope and normaliser its ``Needs`` allows (None for
    ``none``)."""
    if name in PRESETS:
        return PRESETS[name]
    if name in selectors():
        return preset(name)
    raise KeyError(name)


__all__ = ["PRESETS", "preset", "register_preset", "selection_for", "selectors"]
