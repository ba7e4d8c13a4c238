"""What a selection means under each of verl's registered policy losses (``policy_loss.loss_mode``). No import.

One meaning for every loss: verl's loss computes its own sequence- and batch-level quantities (GSPO's sequence
ratio, the covariance rules' means and pools, bypass mode's sequence weights, ...) over every valid token, as stock
verl does; the selection decides only which tokens carry the policy gradient and, with ``normaliser`` ``selected``
or ``kept``, which per-token losses enter the token-mean and what it divides by. How the unselected tokens leave the
sum (their ``route``) depends on what the loss reads of ``response_mask`` before its per-token loss:

- ``mask``: it reads nothing there (the mask only aggregates and averages metrics), so the selected tokens are its
  ``response_mask``, as they always were;
- ``weight``: it reads the mask first, and multiplies its per-token loss by ``rollout_is_weights`` right before verl's
  ``agg_loss``: every valid token is its ``response_mask`` and the selection multiplies those weights (1 / 0);
- ``advantage``: it reads the mask first and ignores ``rollout_is_weights`` (bypass mode computes its own), but no
  quantity of its own reads the advantages: every valid token is its ``response_mask`` and the selection multiplies
  the advantages (an unselected token's per-token loss is then exactly 0).

Under ``normaliser=all`` every loss gets every valid token and the gradient gate, whatever its route. A loss that
has no token-mean (SAPO always aggregates seq-mean-token-mean; GMPO's ``geo_mean`` averages responses) cannot serve
``selected`` / ``kept``: the one validation pass (:mod:`~verl_tokensel.core.seam.checks`) refuses that pair.
docs/loss-modes.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTES = ("mask", "weight", "advantage")
EVERY_NORMALISER = ("all", "selected", "kept")


@dataclass(frozen=True)
class LossMode:
    """One of verl's policy losses, as the selection sees it.

    Attributes:
        reads: what it computes from ``response_mask`` before its per-token loss ("" = nothing).
        route: how the unselected tokens leave its sum under ``normaliser`` selected / kept (:data:`ROUTES`).
        normalisers: the ``token_selection.normaliser`` values it can serve.
        refusal: why it cannot serve the others (empty when it serves every one).
    """

    reads: str = ""
    route: str = "mask"
    normalisers: tuple[str, ...] = EVERY_NORMALISER
    refusal: str = ""


_NO_TOKEN_MEAN = ("all",)

#: verl 0.9.1's registered policy losses (``POLICY_LOSS_REGISTRY``) and this project's ``tokensel_ppo_clip``
LOSS_MODES: dict[str, LossMode] = {
    "vanilla": LossMode(),
    "tokensel_ppo_clip": LossMode(),
    "dppo_tv": LossMode(),
    "dppo_kl": LossMode(),
    "gpg": LossMode(),
    "dro": LossMode(),
    "cispo": LossMode(),
    "gspo": LossMode(reads="each response's sequence ratio, the mean log-ratio over its tokens", route="weight"),
    "clip_cov": LossMode(reads="the covariance's means, its candidate pool, the count max(1, int(ratio N)) and the "
                         "random draw", route="weight"),
    "kl_cov": LossMode(reads="the covariance's means, its pool and the count max(1, int(ratio N))", route="weight"),
    "sapo": LossMode(reads="each response's token count: it always aggregates seq-mean-token-mean", route="weight",
                     normalisers=_NO_TOKEN_MEAN,
                     refusal="loss_mode=sapo aggregates each response's token-mean itself (seq-mean-token-mean, "
                     "whatever loss_agg_mode says), so there is no token-mean over the selected or kept tokens for "
                     "this normaliser to divide"),
    "geo_mean": LossMode(reads="each response's geometric-mean ratio and mean advantage; the loss is their mean over "
                         "responses", route="", normalisers=_NO_TOKEN_MEAN,
                         refusal="loss_mode=geo_mean (GMPO) is a mean over responses of one sequence-level ratio "
                         "each, with no per-token loss, so there is no token-mean over the selected or kept tokens "
                         "for this normaliser to divide"),
    "bypass_mode": LossMode(reads="the rollout correction's IS weights (sequence level: over the response's tokens), "
                            "rejection masks and batch normalisation", route="advantage"),
}

#: what a loss_mode this table does not know is taken to be: one that reads response_mask only to aggregate
UNKNOWN = LossMode()


def loss_mode(name: str) -> LossMode:
    """The entry of ``name`` (:data:`UNKNOWN` for a policy loss registered outside verl 0.9.1 and this project)."""
    return LOSS_MODES.get(name, UNKNOWN)


__all__ = ["EVERY_NORMALISER", "LOSS_MODES", "LossMode", "ROUTES", "UNKNOWN", "loss_mode"]
