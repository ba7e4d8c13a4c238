"""The ranked gradient masks: only the selected tokens keep the policy gradient. Pure torch, no verl import.

The 80/20 rule's forking tokens (top 20% entropy, arXiv 2506.01939) and its controls (bottom 80%, random 20%),
GMTS (top 20% of H * |omega| per prompt group, arXiv 2608.30632), the logit-gradient norm, and the score that ranks
nothing (``all``: every token, under a shaping or a rule's update passes). Its knobs are :class:`Ranking`'s; the
selection and the gradient gate are the :class:`~verl_tokensel.rules.Rule` defaults.
"""

from __future__ import annotations

from verl_tokensel.rules import Ranking, Rule, register_rule


DEVIATIONS = (
    "The budget is exactly ceil(ratio * N) of the pool (the 80/20 code: int(N * r + 0.9999); TRL: a quantile "
    "threshold; the GMTS code: a top-k with ties dropped): one exact count, the same on every rank and rerun, equal "
    "to the 80/20 code's for every usual ratio.",
    "Ties at the threshold go to the earlier position, and a token whose loss input or score is not finite leaves the "
    "pool (torch.topk orders ties arbitrarily and picks NaN as largest): deterministic masks.",
    "forking_paper takes the threshold on the driver, over the old policy's entropy of the whole batch: the paper's "
    "1[H >= tau_B] over the batch B is only known before the update.",
    "gmts ranks every valid token of the group (pool=valid; the GMTS code only those with a non-zero score, so "
    "off-policy its budget shrinks with the clipped tokens; pool=nonzero reproduces it): the paper states the budget "
    "as a fraction of the responses' tokens.",
    "gmts scores 0 the tokens in verl's dual-clip branch (A < 0, r > clip_ratio_c), which the GMTS code scores: "
    "verl's loss gives them no gradient, so H * |omega| with omega = dL/dlog p is 0 there.",
    "gmts selects in every prompt group of every rank, its rows in their own order (the GMTS code's group loop only "
    "the first 16 rows of each rank's mini-batch, with rows misaligned under dynamic batch size): the code's bugs, "
    "not its design.",
)


@register_rule("gradient_mask", knobs=Ranking,
               source='"Beyond the 80/20 Rule" (Wang et al., arXiv 2506.01939; its released code and its paper '
                      "formula) and GMTS (arXiv 2608.30632; its released code): the ranked gradient masks",
               formula="where(selected, log pi, sg(log pi)) in verl's policy loss: the top (or bottom) ceil(ratio * "
                       "N) scores of the scope's pool keep the policy gradient, the other tokens none",
               deviations=DEVIATIONS)
class GradientMask(Rule):
    """Rank ``score`` over the scope, keep the policy gradient on the selected tokens only."""


__all__ = ["GradientMask"]
