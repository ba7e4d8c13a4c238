"""Statistics of per-token scores: pure functions on lists of :class:`TokenScores`, hand-checkable.

Definitions (all over the valid response tokens of every scored answer, entropies in nats):

* Percentile ``q`` of a sample of ``N`` values is the threshold of the top-``(100 - q)``% selection:
  the smallest of the ``k = ceil((100 - q)/100 * N)`` largest values (``select.budget``). So ``P80`` is
  exactly the entropy of the lowest-entropy token the paper's top-20% selection keeps, and a token is
  in the top 20% iff its entropy is above ``P80`` (ties at ``P80`` broken by position). Computed with
  ``torch.kthvalue`` in float64: exact at any size (``torch.quantile`` fails above 2^24 values).
* Advantages: the ``advantage`` column when given, else GRPO from rewards per prompt group,
  ``(r - mean_g) / (std_g + 1e-6)`` with the population std, else none (GMTS statistics omitted).
* GMTS score of a token: ``H * |A|`` (on-policy, ``r = 1``, nothing clipped).
* Exact gradient norm of a token (logit gradient of its policy-gradient loss, on-policy):
  ``|A| * ||e_a - p||`` (times ``1/T``, a constant that changes no ranking or correlation).
* Spearman correlation: Pearson correlation of average ranks (ties share the mean of their ranks).
  Within answers: the mean over answers with ``>= 3`` tokens whose two series are both non-constant;
  across answers: one correlation over all tokens pooled.
* Top-20% sets: :func:`verl_tokensel.core.ranking.select.select_tokens` (exactly ``ceil(0.2 N)`` tokens,
  ties by position) over all tokens pooled.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from verl_tokensel.analysis.training_masks import per_response, scored_batch
from verl_tokensel.core.ranking.scopes import budget
from verl_tokensel.core.ranking.select import select_tokens

PERCENTILES = (50, 80, 90, 99)
LOW_ENTROPY = 0.01
TOP_RATIO = 0.2
MIN_ANSWER_TOKENS = 3
GRPO_EPS = 1e-6
UNIT_ADVANTAGE_SOURCE = "A = 1 for every response: the data has no advantage and no reward/score column"


# ----------------------------------------------------------------------------------------------------
# advantages


def grpo_advantages(rewards: Sequence[float], groups: Sequence) -> list[float]:
    """verl's ``compute_grpo_outcome_advantage`` (``norm_adv_by_std_in_grpo=True``) on scalar rewards.

    Per prompt group: ``(r - mean_g) / (std_g + 1e-6)`` with the unbiased (n - 1) std, as torch's
    ``std()`` in verl; a group of one response has mean 0 and std 1 (verl's special case), so its
    advantage is its reward.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    by_group: dict = {}
    for r, g in zip(rewards, groups):
        by_group.setdefault(g, []).append(float(r))
    moments = {}
    for g, vals in by_group.items():
        if len(vals) == 1:
            moments[g] = (0.0, 1.0)
        else:
            t = torch.tensor(vals, dtype=torch.float32)
            moments[g] = (float(t.mean()), float(t.std()))
    return [(float(r) - moments[g][0]) / (moments[g][1] + GRPO_EPS) for r, g in zip(rewards, groups)]


def resolve_advantages(records) -> tuple[Optional[list[float]], str]:
    """(advantages or None, how they were obtained / why there are none) for ``ResponseRecord`` s."""
    if not records:
        return None, "no responses"
    if all(r.advantage is not None for r in records):
        return [float(r.advantage) for r in records], "from the data's advantage column"
    if all(r.reward is not None for r in records):
        return (grpo_advantages([r.reward for r in records], [r.group for r in records]),
                "GRPO from the rewards per prompt group, as verl computes it: (r - mean_g) / (std_g + 1e-6), "
                "unbiased std; a group of one response gets A = r")
    return None, ("the input has neither an advantage nor a reward/score column, so GMTS scores and "
                  "exact gradient norms (which scale with |A|) cannot be computed")


def advantages_or_unit(records) -> tuple[list[float], str]:
    """The analysis advantages (:func:`resolve_advantages`), or A = 1 for every response (``view``, demo)."""
    advantages, source = resolve_advantages(records)
    if advantages is None:
        return [1.0] * len(records), UNIT_ADVANTAGE_SOURCE
    return advantages, source


# ----------------------------------------------------------------------------------------------------
# elementary statistics


def exact_percentiles(values: torch.Tensor, qs: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """``{str(q): P_q}`` with ``P_q`` the smallest of the ``ceil((100-q)/100 N)`` largest values (exact)."""
    x = values.detach().flatten().double().cpu()
    n = x.numel()
    out = {}
    for q in qs:
        if n == 0:
            out[_qkey(q)] = math.nan
            continue
        k = budget((100.0 - q) / 100.0, n) if q < 100 else 1
        k = max(k, 1)
        out[_qkey(q)] = float(torch.kthvalue(x, n - k + 1).values)
    return out


def _qkey(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def rankdata(x) -> np.ndarray:
    """Ranks 1..n with ties given the average of the ranks they span (scipy's ``method='average'``)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts).astype(np.float64)  # rank of the last member of each tie block
    avg = ends - (counts - 1) / 2.0
    return avg[inverse.ravel()]


def spearman(x, y) -> float:
    """Spearman rank correlation with average ranks for ties; NaN when ``n < 2`` or a series is constant."""
    a = np.asarray(x, dtype=np.float64).ravel()
    b = np.asarray(y, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"spearman: lengths differ ({a.size} vs {b.size})")
    if a.size < 2:
        return math.nan
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    if den == 0.0:
        return math.nan
    return float((ra * rb).sum() / den)


def within_across(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
                  min_tokens: int = MIN_ANSWER_TOKENS) -> dict:
    """Spearman of x vs y within each answer (mean over eligible answers) and across (all tokens pooled).

    An answer is eligible when it has ``>= min_tokens`` tokens and neither series is constant in it.
    """
    per_answer = []
    for x, y in zip(xs, ys):
        if x.numel() < min_tokens:
            continue
        xa, ya = x.double().numpy(), y.double().numpy()
        if np.all(xa == xa[0]) or np.all(ya == ya[0]):
            continue
        per_answer.append(spearman(xa, ya))
    pooled_x = torch.cat([x.double() for x in xs]) if xs else torch.zeros(0, dtype=torch.float64)
    pooled_y = torch.cat([y.double() for y in ys]) if ys else torch.zeros(0, dtype=torch.float64)
    return {
        "within_answer_mean": float(np.mean(per_answer)) if per_answer else math.nan,
        "within_answer_median": float(np.median(per_answer)) if per_answer else math.nan,
        "within_answers_used": len(per_answer),
        "answers_total": len(xs),
        "across_answers": spearman(pooled_x.numpy(), pooled_y.numpy()),
    }


def pooled_entropy(scores) -> torch.Tensor:
    """Every response token's entropy, in order, as one float64 tensor (empty when there are none)."""
    if not scores:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([s.entropy.double().flatten() for s in scores])


def top_mask(values: torch.Tensor, ratio: float = TOP_RATIO) -> torch.Tensor:
    """Bool mask of the exact top-``ratio`` of a 1-D tensor via ``select_tokens`` (ties by position)."""
    v = values.detach().flatten()
    if v.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    return select_tokens(v.view(1, -1), torch.ones(1, v.numel(), dtype=torch.bool), ratio)[0]


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a & b| / |a | b| of two bool masks (NaN when both are empty)."""
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else math.nan


def forking_tokens(token_ids: torch.Tensor, selected: torch.Tensor, *, top: int = 20,
                   decode: Optional[Callable[[int], str]] = None) -> list[dict]:
    """Most frequent token ids among the ``selected`` positions, with counts.

    Each entry: ``token_id``, ``text`` (``decode(id)`` or None), ``count`` (selected occurrences),
    ``occurrences`` (all occurrences), ``forking_rate`` = count / occurrences. Ordered by count
    (descending), then token id.
    """
    ids = token_ids.flatten().long()
    sel = selected.flatten().bool()
    if ids.numel() == 0 or not bool(sel.any()):
        return []
    if int(ids.min()) < 0:
        raise ValueError("negative token id")
    # vectorised counts (tens of millions of tokens): bincount over the id range
    total = torch.bincount(ids)
    chosen = torch.bincount(ids[sel], minlength=total.numel())
    present = chosen.nonzero().flatten()
    counts = chosen[present]
    # order: count descending, then token id ascending (present is ascending; a stable sort keeps it)
    order = torch.sort(-counts, stable=True).indices[:top]
    out = []
    for t, c in zip(present[order].tolist(), counts[order].tolist()):
        occ = int(total[t])
        out.append({"token_id": int(t), "text": decode(int(t)) if decode else None, "count": int(c),
                    "occurrences": occ, "forking_rate": c / occ})
    return out


# ----------------------------------------------------------------------------------------------------
# the report


def _registry_scores(scores, advantages: Sequence[float], name: str) -> list[torch.Tensor]:
    """The registered score ``name`` of each answer's tokens (on-policy), float64, via the training builder."""
    if not scores:
        return []
    batch = scored_batch(scores, advantages, name)
    return [v.double() for v in per_response(batch.score(name), batch.valid)]


def exact_grad_norms(scores, advantages: Sequence[float]) -> list[torch.Tensor]:
    """``|A_i| * ||e_a - p||`` per token of each answer: the registry's ``grad_norm`` score (on-policy)."""
    return _registry_scores(scores, advantages, "grad_norm")


def gmts_scores(scores, advantages: Sequence[float]) -> list[torch.Tensor]:
    """``H * |A_i|`` per token of each answer: the registry's ``gmts`` score (on-policy)."""
    return _registry_scores(scores, advantages, "gmts")


def build_report(scores, advantages: Optional[Sequence[float]] = None, *,
                 decode: Optional[Callable[[int], str]] = None,
                 advantage_source: str = "",
                 top_ratio: float = TOP_RATIO, top_tokens: int = 20) -> dict:
    """The analysis report (a JSON-able dict) of a list of ``TokenScores``.

    ``advantages``: one per answer or None; without them the GMTS / exact-gradient statistics are
    omitted and ``gmts_omitted_reason`` says why (``advantage_source`` when given).
    """
    if advantages is not None and len(advantages) != len(scores):
        raise ValueError(f"{len(advantages)} advantages for {len(scores)} answers")
    ent = [s.entropy.double().flatten() for s in scores]
    H = torch.cat(ent) if ent else torch.zeros(0, dtype=torch.float64)
    ids = torch.cat([s.token_ids.flatten().long() for s in scores]) if scores else torch.zeros(0, dtype=torch.long)
    n = H.numel()
    pct = exact_percentiles(H)
    top_pct = _qkey(100 * (1 - top_ratio)) if (100 * (1 - top_ratio)).is_integer() else None
    ent_top = top_mask(H, top_ratio)
    report: dict = {
        "responses": len(scores),
        "empty_responses": sum(1 for s in scores if s.entropy.numel() == 0),
        "token_count": n,
        "top_ratio": top_ratio,
        "entropy": {
            "mean": float(H.mean()) if n else math.nan,
            "percentiles": pct,
            "percentile_definition": "P_q = smallest of the ceil((100-q)/100 * N) largest values (exact)",
            "share_below_0.01": float((H < LOW_ENTROPY).double().mean()) if n else math.nan,
            "share_zero": float((H == 0).double().mean()) if n else math.nan,
            "top_threshold": float(H[ent_top].min()) if n else math.nan,
        },
        "forking_tokens": forking_tokens(ids, ent_top, top=top_tokens, decode=decode),
        # advantage-free: ||e_a - p|| (the per-token logit-gradient norm before |A|)
        "entropy_vs_logit_grad_norm": within_across(ent, [s.grad_norm.double() for s in scores]),
    }
    if top_pct is not None:
        report["entropy"]["top_threshold_is_percentile"] = top_pct
    if advantages is None:
        report["advantages"] = None
        report["gmts"] = None
        report["gmts_omitted_reason"] = advantage_source or "no advantages or rewards in the input"
        return report
    adv = np.asarray([float(a) for a in advantages], dtype=np.float64)
    report["advantages"] = {
        "source": advantage_source,
        "mean_abs": float(np.abs(adv).mean()) if adv.size else math.nan,
        "zero_share": float((adv == 0).mean()) if adv.size else math.nan,
    }
    g_exact = exact_grad_norms(scores, advantages)
    gmts = gmts_scores(scores, advantages)
    G = torch.cat(g_exact) if g_exact else torch.zeros(0, dtype=torch.float64)
    S = torch.cat(gmts) if gmts else torch.zeros(0, dtype=torch.float64)
    gmts_top = top_mask(S, top_ratio)
    total_mass = float(G.sum())
    report["gmts"] = {
        "entropy_vs_exact_grad_norm": within_across(ent, g_exact),
        "jaccard_entropy_top_vs_gmts_top": jaccard(ent_top, gmts_top) if n else math.nan,
        "grad_mass_kept": {
            "entropy_top": float(G[ent_top].sum()) / total_mass if total_mass > 0 else math.nan,
            "gmts_top": float(G[gmts_top].sum()) / total_mass if total_mass > 0 else math.nan,
        },
    }
    return report


# ----------------------------------------------------------------------------------------------------
# two models on the same responses


def _group_change(delta: torch.Tensor) -> dict:
    n = delta.numel()
    return {
        "count": n,
        "mean": float(delta.mean()) if n else math.nan,
        # the lower median: an actual value of the group (exact, any size)
        "median": float(torch.kthvalue(delta, (n + 1) // 2).values) if n else math.nan,
        "share_increased": float((delta > 0).double().mean()) if n else math.nan,
    }


def compare_entropies(scores_a, scores_b, *, top_ratio: float = TOP_RATIO) -> dict:
    """How the entropies of the same response tokens differ between model A and model B.

    ``overlap.share_of_a_top_in_b_top`` = |top_A & top_B| / |top_A| (the paper's "RL keeps > 86% of the
    base model's top-20% positions"), ``overlap.jaccard`` = |top_A & top_B| / |top_A | top_B|; both sets
    are exact top-``top_ratio`` selections over all tokens pooled. ``entropy_change`` gives count, mean,
    (lower) median and share ``> 0`` of ``H_B - H_A`` for A's top tokens and for the rest.
    """
    if len(scores_a) != len(scores_b):
        raise ValueError(f"{len(scores_a)} vs {len(scores_b)} scored responses")
    for i, (a, b) in enumerate(zip(scores_a, scores_b)):
        if not torch.equal(a.token_ids, b.token_ids):
            raise ValueError(f"response {i}: the two models scored different token ids")
    h_a, h_b = pooled_entropy(scores_a), pooled_entropy(scores_b)
    top_a, top_b = top_mask(h_a, top_ratio), top_mask(h_b, top_ratio)
    n_top_a = int(top_a.sum())
    delta = h_b - h_a
    return {
        "responses": len(scores_a),
        "token_count": h_a.numel(),
        "top_ratio": top_ratio,
        "mean_entropy_a": float(h_a.mean()) if h_a.numel() else math.nan,
        "mean_entropy_b": float(h_b.mean()) if h_b.numel() else math.nan,
        "spearman_entropy_a_b": spearman(h_a.numpy(), h_b.numpy()),
        "overlap": {
            "top_count": n_top_a,
            "share_of_a_top_in_b_top": int((top_a & top_b).sum()) / n_top_a if n_top_a else math.nan,
            "jaccard": jaccard(top_a, top_b),
        },
        "entropy_change": {"a_top": _group_change(delta[top_a]), "rest": _group_change(delta[~top_a])},
    }


__all__ = [
    "LOW_ENTROPY",
    "PERCENTILES",
    "UNIT_ADVANTAGE_SOURCE",
    "advantages_or_unit",
    "build_report",
    "compare_entropies",
    "exact_grad_norms",
    "exact_percentiles",
    "forking_tokens",
    "gmts_scores",
    "grpo_advantages",
    "jaccard",
    "rankdata",
    "resolve_advantages",
    "spearman",
    "top_mask",
    "within_across",
]
