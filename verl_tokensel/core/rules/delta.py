"""DelTA (Discriminative Token Credit Assignment for RLVR, arXiv 2605.21467; released code RUCBM/DelTA @cf048bd, a verl
fork: ``compute_log_prob_h`` of ``verl-DelTA/verl/workers/actor/dp_actor.py``). Pure torch, no verl import.

Each response token's advantage is scaled by a weight read from the model's last hidden state. With ``p`` the old
policy's probability of the token, ``h`` the output layer's input at it (detached) and ``v = (1 - p) h``:

1. centroids ``mu+ = sum A+ v / sum A+`` and ``mu- = sum A- v / sum A-`` over the valid tokens (``A+ = max(A, 0)``,
   ``A- = max(-A, 0)``);
2. margins ``m = |v - mu-|^2 - |v - mu+|^2`` on the tokens with ``A > 0`` and ``-m`` on those with ``A < 0``, and
   ``gamma+`` / ``gamma-`` their standard deviations on each side;
3. ``K`` times: ``mu+ = sum s+ A+ v / sum s+ A+`` with ``s+ = sigmoid(m / gamma+)`` (``mu-`` likewise), and each
   ``gamma`` the spread of the margins at the centroids before that update;
4. the weight ``lam_min + (lam_max - lam_min) sigmoid(m / gamma)`` on its side (``lam_min`` where ``A = 0``), scaled so
   its mean over the valid tokens is 1; the loss is verl's (dual-clip PPO) on ``A * w``.

The statistics are O(H) sums, so each pass streams micro-batches (:class:`DeltaStates`, the rule's
:class:`~verl_tokensel.core.seam.hidden.HiddenStates`): ``K + 3`` passes over the step's batch before its update
(one forward when ``delta_cache_gib`` holds the rank's hidden states). ``delta_stats=global`` (the default) sums them
over every data-parallel rank of the step's batch; ``rank`` keeps each rank's own, as the release does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from verl_tokensel.rules import HiddenStates, Knobs, LossTransform, Needs, Rule, config_error, knob, register_rule

NAME = "delta"
IMPLS = ("Normal", "Memory_efficient")
STATS = ("global", "rank")
#: the release's clamps: of the centroid denominators and the margins' variance (eps), of the final scale's denominator
EPS = 1e-8


@dataclass(frozen=True)
class DeltaKnobs(Knobs):
    delta_k: int = knob(1, "Refinements of the two centroids by sigmoid-weighted margins (the release's K; an "
                        "integer).", "1 (run_DelTA.sh delta_K)", ge=0)
    delta_lam_min: float = knob(0.8, "Weight of the least discriminative tokens (and of every token with A = 0).",
                                "0.8 (run_DelTA.sh delta_lam_min)", ge=0)
    delta_lam_max: float = knob(1.2, "Weight of the most discriminative tokens (>= delta_lam_min).",
                                "1.2 (run_DelTA.sh delta_lam_max)", ge=0)
    delta_impl: str = knob("Normal", "Distance arithmetic: Normal = |v - mu|^2 as written; Memory_efficient = "
                           "|v|^2 - 2 v.mu + |mu|^2 (the release's two versions; they agree to float32 rounding).",
                           "Normal (run_DelTA.sh delta_impl; Memory_efficient for its 14B run)", choices=IMPLS)
    delta_stats: str = knob("global", "Where the centroids, spreads and the mean-1 scale are summed: global = over "
                            "every data-parallel rank of the step's batch (the paper's batch statistics); rank = over "
                            "each rank's share alone (the release: its weights depend on the DP size and balancing).",
                            "rank (the release's per-rank sums)", choices=STATS)
    delta_cache_gib: float = knob(0.0, "Keep the rank's response hidden states between the passes when every rank's "
                                  "fit in this many GiB (valid tokens x hidden size x element size): one forward "
                                  "instead of K + 3. 0 = never (a forward per pass, nothing of [B, S, H] kept).",
                                  "n/a (the release runs K + 3 forwards)", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.delta_k, bool) or not isinstance(self.delta_k, int):
            raise config_error("token_selection.delta_k", self.delta_k, "an integer >= 0")


def _distances(v: torch.Tensor, mu_pos: torch.Tensor, mu_neg: torch.Tensor, impl: str) -> torch.Tensor:
    """``|v - mu-|^2 - |v - mu+|^2`` per token (the margin of a token with A > 0)."""
    if impl == "Normal":
        return ((v - mu_neg) ** 2).sum(-1) - ((v - mu_pos) ** 2).sum(-1)
    vv = (v * v).sum(-1)
    d_pos = (vv - 2.0 * (v @ mu_pos) + (mu_pos * mu_pos).sum()).clamp_min(0.0)
    d_neg = (vv - 2.0 * (v @ mu_neg) + (mu_neg * mu_neg).sum()).clamp_min(0.0)
    return d_neg - d_pos


def _spread(sums: torch.Tensor) -> torch.Tensor:
    """``sqrt(max(E[m^2] - E[m]^2, eps))`` from ``(sum m, sum m^2, count)`` (count at least 1), the release's gamma."""
    count = sums[2].clamp_min(1.0)
    mean = sums[0] / count
    return torch.sqrt((sums[1] / count - mean * mean).clamp_min(EPS))


class DeltaStates(HiddenStates):
    """DelTA's passes (``K + 3``): the centroids, the margins' spreads, ``K`` refinements, the weights."""

    def __init__(self, knobs: DeltaKnobs, dp_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(knobs, dp_group)
        self.sweeps = knobs.delta_k + 3
        self.cache_bytes = float(knobs.delta_cache_gib) * 2**30
        self.reduce_group = dp_group if knobs.delta_stats == "global" else None
        self.acc: Optional[list[torch.Tensor]] = None
        self.mu_pos = self.mu_neg = self.gamma_pos = self.gamma_neg = None
        self.scale = 1.0

    def _add(self, *parts: torch.Tensor) -> None:
        parts = [p.detach().to(torch.float64).reshape(-1) for p in parts]
        self.acc = parts if self.acc is None else [a + p for a, p in zip(self.acc, parts)]

    def _margins(self, batch, v: torch.Tensor):
        adv = batch.advantages
        pos, neg = adv > 0, adv < 0
        diff = _distances(v, self.mu_pos, self.mu_neg, self.knobs.delta_impl)
        return pos, neg, diff, -diff

    @staticmethod
    def _stats(margin: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        m = torch.where(on, margin, 0.0)
        return torch.stack([m.sum(), (m * m).sum(), on.sum().to(m.dtype)])

    def sweep(self, i: int, batch) -> Optional[torch.Tensor]:
        v = (1.0 - batch.log_prob.exp()).unsqueeze(-1) * batch.hidden.float()  # (n, H) float32
        adv = batch.advantages
        a_pos, a_neg = adv.clamp_min(0.0), (-adv).clamp_min(0.0)
        if i == 0:  # the centroids weighted by A+ / A-
            self._add(a_pos @ v, a_neg @ v, a_pos.sum(), a_neg.sum())
            return None
        pos, neg, m_pos, m_neg = self._margins(batch, v)
        if i == 1:  # the spreads of the margins at the first centroids
            self._add(self._stats(m_pos, pos), self._stats(m_neg, neg))
            return None
        if i < self.sweeps - 1:  # a refinement: sigmoid-weighted centroids, and the spreads at the centroids before it
            w_pos = torch.where(pos, torch.sigmoid(m_pos / self.gamma_pos) * a_pos, 0.0)
            w_neg = torch.where(neg, torch.sigmoid(m_neg / self.gamma_neg) * a_neg, 0.0)
            self._add(w_pos @ v, w_neg @ v, w_pos.sum(), w_neg.sum(), self._stats(m_pos, pos),
                      self._stats(m_neg, neg))
            return None
        k = self.knobs
        span = k.delta_lam_max - k.delta_lam_min
        weight = torch.full_like(adv, float(k.delta_lam_min))
        weight = torch.where(pos, k.delta_lam_min + span * torch.sigmoid(m_pos / self.gamma_pos), weight)
        weight = torch.where(neg, k.delta_lam_min + span * torch.sigmoid(m_neg / self.gamma_neg), weight)
        self._add(torch.tensor(float(adv.numel()), device=adv.device), weight.sum(),
                  (weight * pos).sum(), pos.sum(), (weight * neg).sum(), neg.sum())
        return weight

    def end_sweep(self, i: int) -> None:
        sizes = [a.numel() for a in self.acc]
        flat = torch.cat(self.acc)
        if self.reduce_group is not None:
            dist.all_reduce(flat, group=self.reduce_group)
        parts, self.acc = list(torch.split(flat, sizes)), None
        if i == 0 or 1 < i < self.sweeps - 1:
            num_pos, num_neg, den_pos, den_neg = parts[:4]
            self.mu_pos = (num_pos / den_pos.clamp_min(EPS)).float()
            self.mu_neg = (num_neg / den_neg.clamp_min(EPS)).float()
        if i >= 1 and i < self.sweeps - 1:
            stats_pos, stats_neg = parts[-2:]
            self.gamma_pos, self.gamma_neg = _spread(stats_pos).float(), _spread(stats_neg).float()
        if i == self.sweeps - 1:
            tokens, total, w_pos, n_pos, w_neg, n_neg = (float(p) for p in parts)
            self.scale = tokens / max(total, EPS)
            self.metrics = {
                "scale": self.scale, "tokens": tokens, "positive_tokens": n_pos, "negative_tokens": n_neg,
                "weight_positive_mean": self.scale * w_pos / n_pos if n_pos else 0.0,
                "weight_negative_mean": self.scale * w_neg / n_neg if n_neg else 0.0,
                "gamma_positive": float(self.gamma_pos), "gamma_negative": float(self.gamma_neg),
                "centroid_distance": float((self.mu_pos - self.mu_neg).norm()),
            }

    def finish(self, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, values * self.scale, 1.0)


@register_rule(NAME, knobs=DeltaKnobs, needs=Needs(normalisers=("all",), hidden_states=DeltaStates))
class Delta(Rule):
    """The selected tokens (every token under the preset's score ``all``) keep their gradient; each advantage is scaled
    by the weight the hidden-state passes measured."""

    def transform(self, x) -> LossTransform:
        w = x.hidden
        if w is None:
            raise RuntimeError(
                "token_selector=delta scales each advantage by a weight measured from the last hidden states before "
                "the update, and this micro-batch carries none: the passes run in verl's actor worker at "
                "update_actor (installed by python -m verl_tokensel.main_ppo, trainer modes tokensel_*).")
        w = torch.where(x.valid, w.float(), 1.0)
        n = x.tokens.sum().clamp_min(1)
        return LossTransform(gate=x.mask, advantage_weight=w, metrics={"weight_mean": (w * x.tokens).sum() / n})

    def check(self, c) -> None:
        k = c.knobs
        if k.delta_lam_max < k.delta_lam_min:
            raise config_error("token_selection.delta_lam_max", k.delta_lam_max,
                               f"a number >= token_selection.delta_lam_min ({k.delta_lam_min})")


__all__ = ["DeltaKnobs", "DeltaStates", "Delta", "IMPLS", "STATS"]
