"""Archer (Wang et al., arXiv 2507.15778; released code wizard-III/ArcherCodeR). Pure torch, no verl import.

Per response, the tokens above its 0.8 entropy quantile (current policy; ``budget=quantile``, ``ratio`` 0.2) are
clipped at ``selected_clip_ratio_low`` / ``_high`` (0.5 / 0.5) and get ``selected_kl_weight`` (0) of the KL loss; the
others keep the actor's clip (0.2 / 0.2 in Archer's scripts) and the KL loss (``use_kl_loss``, low_var_kl, 0.001).
The policy loss is verl's vanilla PPO clip with per-token bounds (:mod:`~verl_tokensel.core.rules.ppo_clip`).

The KL term (``archer_kl_mean``): ``class`` (default) is the released code's, per micro-batch the token-mean of the
KL over each entropy class's own tokens, times the class's weight (``dp_actor.py``: ``agg_loss(kld,
loss_mask=<class>, token-mean)``), the micro-batch weighted by its share of the mini-batch's responses as the
released gradient accumulation does; it is written as per-token weights ``c_t * D * rows / (G * n_class)`` under
verl's token-mean over all D tokens of the mini-batch (G responses over all ranks, ``rows`` in the micro-batch).
With ``loss_agg_mode=seq-mean-token-mean`` (the recipes': the released script's micro-batches of one response) the
same ``agg_loss`` per class is each response's mean over its own class tokens, averaged over the responses. With
``token-sum``, ``seq-mean-token-sum`` and ``seq-mean-token-sum-norm`` the per-class ``agg_loss`` is a sum over the
class's tokens with a denominator that does not depend on the class (the responses, the horizon), so the two classes'
terms add up to weights ``selected_kl_weight`` / 1 under verl's own aggregation, the same weights as ``all``.
``all``: one token-mean over every valid token with weight ``selected_kl_weight`` on the selected ones (this
package's earlier variant; about 0.8x the released term at the paper's settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from verl_tokensel.core.rules.maths import share
from verl_tokensel.core.rules.ppo_clip import ppo_clip_token_losses
from verl_tokensel.rules import LossTransform, Needs, Ranking, Rule, config_error, knob, register_rule

NAME = "archer"
KL_MEANS = ("class", "all")
#: verl's aggregations whose per-class agg_loss is a sum over the class's tokens (denominator free of the class)
SUM_AGG_MODES = ("token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class ArcherKnobs(Ranking):
    selected_clip_ratio_low: Optional[float] = knob(
        None, "The selected tokens' lower clip ratio (null: the actor's clip_ratio_low).",
        "0.5 (Archer, high-entropy tokens)", ge=0, lt=1)
    selected_clip_ratio_high: Optional[float] = knob(
        None, "The selected tokens' upper clip ratio (null: the actor's clip_ratio_high).",
        "0.5 (Archer, high-entropy tokens)", ge=0, lt=1)
    selected_kl_weight: float = knob(
        1.0, "Factor of the KL loss (use_kl_loss) on the selected tokens; the others keep 1.",
        "0 (Archer: no KL on high-entropy tokens)", ge=0)
    archer_kl_mean: str = knob(
        "class", f"The KL term's mean: one of {', '.join(KL_MEANS)}. class = the token-mean over each entropy class's "
        "own tokens per micro-batch (per response with loss_agg_mode=seq-mean-token-mean), times its weight (the "
        "released code's agg_loss per class under the actor's loss_agg_mode; with the token-sum modes it equals all); "
        "all = one token-mean over every valid token, selected_kl_weight on the selected ones.",
        "class (ArcherCodeR dp_actor.py)", choices=KL_MEANS)


def class_mean_weights(mask: torch.Tensor, tokens: torch.Tensor, selected_weight: float,
                       denominator: Optional[float], global_rows: Optional[int],
                       loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Per-token KL weights under verl's ``loss_agg_mode`` that give the released ``agg_loss(kld, loss_mask=<class>,
    loss_agg_mode)`` per class (``mask`` and the rest of ``tokens``), times the class's weight (float32; 0 off
    ``tokens``).

    ``token-mean``: each class's token-mean over the micro-batch, the micro-batch weighted by ``rows /
    global_rows`` (the released gradient accumulation): ``c * D * rows / (G * n_class)`` under verl's token-mean over
    ``denominator`` = D tokens. ``seq-mean-token-mean``: each response's token-mean over its own class tokens,
    averaged over the G responses: ``c * n_response / n_response_class``. The token-sum modes (``SUM_AGG_MODES``):
    a sum per class, so ``c`` on the selected tokens and 1 on the others. ``None``: the micro-batch alone is the
    whole."""
    selected, others = mask & tokens, tokens & ~mask
    if loss_agg_mode == "seq-mean-token-mean":
        n = tokens.sum(-1, keepdim=True).float()
        w_sel = selected_weight * n / selected.sum(-1, keepdim=True).clamp_min(1).float()
        w_other = n / others.sum(-1, keepdim=True).clamp_min(1).float()
    elif loss_agg_mode == "token-mean":
        rows = mask.shape[0]
        d = float(tokens.sum()) if denominator is None else float(denominator)
        g = rows if global_rows is None else int(global_rows)
        scale = d * rows / g
        w_sel = torch.tensor(selected_weight * scale / max(int(selected.sum()), 1))
        w_other = torch.tensor(scale / max(int(others.sum()), 1))
    elif loss_agg_mode in SUM_AGG_MODES:
        w_sel, w_other = torch.tensor(float(selected_weight)), torch.tensor(1.0)
    else:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")
    return torch.where(selected, w_sel, torch.where(others, w_other, 0.0)).to(torch.float32)


@register_rule(NAME, knobs=ArcherKnobs, needs=Needs(normalisers=("all",), policy_loss=True, kl_loss=True))
class Archer(Rule):
    """High-entropy tokens (per-response quantile) get their own clip bounds and KL weight."""

    def check(self, c) -> None:
        k = c.knobs
        if c.actor is not None and k.selected_kl_weight != 1.0 and not c.actor.use_kl_loss:
            raise config_error(
                "use_kl_loss", c.actor.use_kl_loss,
                f"true (with token_selection.selected_kl_weight={k.selected_kl_weight})",
                "the rule weights the KL loss per token, and the KL loss is off. Fix: set "
                "actor_rollout_ref.actor.use_kl_loss=true (Archer: kl_loss_coef=0.001, kl_loss_type=low_var_kl), or "
                "token_selection.selected_kl_weight=1 to run without a KL term.")

    def transform(self, x) -> LossTransform:
        k, mask = x.knobs, x.mask
        low = x.clip_ratio_low if k.selected_clip_ratio_low is None else k.selected_clip_ratio_low
        high = x.clip_ratio_high if k.selected_clip_ratio_high is None else k.selected_clip_ratio_high
        # float64: ``1 - bound`` then rounds to float32 as verl's scalar bound does, for every token
        clip_low = torch.where(mask, float(low), x.clip_ratio_low).to(torch.float64)
        clip_high = torch.where(mask, float(high), x.clip_ratio_high).to(torch.float64)
        if k.archer_kl_mean == "class":
            kl_weight = class_mean_weights(mask, x.tokens, k.selected_kl_weight, x.denominator, x.global_rows,
                                           x.loss_agg_mode)
        else:
            kl_weight = (None if k.selected_kl_weight == 1.0
                         else torch.where(mask, float(k.selected_kl_weight), 1.0).to(torch.float32))
        return LossTransform(kl_weight=kl_weight, token_loss=partial(
            ppo_clip_token_losses, token_clip_low=clip_low, token_clip_high=clip_high, classes=mask,
            metric_group=NAME))

    def stats(self, x) -> dict[str, float]:
        n_sel, n_pool = int(x.mask.sum()), int(x.tokens.sum())
        return {"selected_tokens": float(n_sel), "selected_share": share(n_sel, n_pool)}


__all__ = ["Archer", "ArcherKnobs", "KL_MEANS", "class_mean_weights"]
