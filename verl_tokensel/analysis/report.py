"""Write analysis reports: ``report.json``, ``report.md`` and PNG plots (matplotlib, Agg backend).

Everything is written into a temporary sibling folder first and moved into the output folder only
when every file is complete, so a failure leaves no partial report behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

ENTROPY_FLOOR = 1e-6
SCATTER_MAX_POINTS = 20_000


def require_matplotlib():
    """Import matplotlib with the Agg backend, or explain how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the analysis plots need matplotlib: pip install matplotlib "
                           "(or pip install 'verl-tokensel[analysis]')") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def staged_output(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success move its files into ``out_dir``, on failure delete it.

    ``out_dir`` is created (by an atomic rename) only when it did not exist; otherwise the files are
    moved in one by one, replacing same-named files.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=str(out.parent)))
    try:
        yield tmp
        if not out.exists():
            os.replace(tmp, out)
        else:
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # strict JSON has no NaN/inf
    if isinstance(obj, (np.floating,)):
        return _jsonable(float(obj))
    if isinstance(obj, (np.integer,)):
        return int(obj)
    return obj


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(_jsonable(report), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fmt(v, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _md_escape(text: Optional[str]) -> str:
    if text is None:
        return ""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n").replace("`", "'")


# ----------------------------------------------------------------------------------------------------
# analyze


def analysis_markdown(report: dict, plots: Sequence[str]) -> str:
    e = report["entropy"]
    lines = [
        "# Token entropy analysis",
        "",
        f"Model: `{report.get('model', '?')}`  ",
        f"Data: `{report.get('data', '?')}`  ",
        f"Temperature: {report.get('temperature', 1.0)}",
        "",
        "| statistic | value |",
        "|---|---|",
        f"| responses scored | {report['responses']} ({report['empty_responses']} empty) |",
        f"| response tokens | {report['token_count']} |",
        f"| mean entropy (nats) | {_fmt(e['mean'])} |",
    ]
    for q, v in e["percentiles"].items():
        lines.append(f"| entropy P{q} | {_fmt(v)} |")
    lines += [
        f"| share of tokens with H < 0.01 | {_fmt(e['share_below_0.01'])} |",
        f"| top-{round(100 * report['top_ratio'])}% threshold (min H kept) | {_fmt(e['top_threshold'])} |",
    ]
    lw = report["entropy_vs_logit_grad_norm"]
    lines.append(f"| Spearman(H, ‖e_a − p‖) within answers (mean of {lw['within_answers_used']}) "
                 f"| {_fmt(lw['within_answer_mean'])} |")
    lines.append(f"| Spearman(H, ‖e_a − p‖) across answers | {_fmt(lw['across_answers'])} |")
    g = report.get("gmts")
    if g:
        c = g["entropy_vs_exact_grad_norm"]
        lines += [
            f"| Spearman(H, exact grad norm) within answers (mean of {c['within_answers_used']}) "
            f"| {_fmt(c['within_answer_mean'])} |",
            f"| Spearman(H, exact grad norm) across answers | {_fmt(c['across_answers'])} |",
            f"| Jaccard(entropy top-20%, GMTS top-20%) | {_fmt(g['jaccard_entropy_top_vs_gmts_top'])} |",
            f"| gradient mass kept by entropy top-20% | {_fmt(g['grad_mass_kept']['entropy_top'])} |",
            f"| gradient mass kept by GMTS top-20% | {_fmt(g['grad_mass_kept']['gmts_top'])} |",
        ]
    lines.append("")
    lines.append(f"Percentiles: {e['percentile_definition']}, so P80 is the lowest entropy the top-20% "
                 "selection keeps.")
    lines.append("")
    if g:
        lines.append(f"Advantages: {report['advantages']['source']}. Exact gradient norm of a token = "
                     "|A| · ‖e_a − p‖ (on-policy, nothing clipped); GMTS score = H · |A|.")
    else:
        lines.append(f"GMTS and exact-gradient statistics omitted: {report.get('gmts_omitted_reason')}.")
    lines += ["", f"## Top forking tokens (most frequent in the top {round(100 * report['top_ratio'])}% by entropy)",
              "", "| # | token | id | count in top | occurrences | forking rate |", "|---|---|---|---|---|---|"]
    for i, t in enumerate(report["forking_tokens"], start=1):
        lines.append(f"| {i} | `{_md_escape(t['text'])}` | {t['token_id']} | {t['count']} | {t['occurrences']} "
                     f"| {_fmt(t['forking_rate'], 3)} |")
    if plots:
        lines += ["", "## Plots", ""]
        for p in plots:
            lines.append(f"![{p}]({p})")
    return "\n".join(lines) + "\n"


def plot_entropy_histogram(plt, path: Path, entropy: torch.Tensor, threshold: float) -> None:
    h = entropy.double().numpy()
    n_floor = int((h < ENTROPY_FLOOR).sum())
    clipped = np.clip(h, ENTROPY_FLOOR, None)
    fig, ax = plt.subplots(figsize=(7, 4))
    hi = max(float(clipped.max()) if clipped.size else 1.0, ENTROPY_FLOOR * 10)
    bins = np.logspace(math.log10(ENTROPY_FLOOR), math.log10(hi * 1.01), 60)
    ax.hist(clipped, bins=bins, color="tab:blue")
    ax.set_xscale("log")
    ax.axvline(0.01, color="tab:gray", ls="--", label="H = 0.01")
    if math.isfinite(threshold) and threshold > 0:
        ax.axvline(max(threshold, ENTROPY_FLOOR), color="tab:red", ls="-", label=f"top-20% threshold {threshold:.3g}")
    ax.set_xlabel("token entropy H (nats, log scale)")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper left")
    ax.set_title(f"Entropy of {h.size} response tokens")
    fig.text(0.01, 0.01, f"{n_floor} tokens with H < {ENTROPY_FLOOR:g} (incl. H = 0) are drawn at {ENTROPY_FLOOR:g}.",
             fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_correlations(plt, path: Path, report: dict) -> None:
    groups = [("H vs ‖e_a − p‖", report["entropy_vs_logit_grad_norm"])]
    if report.get("gmts"):
        groups.append(("H vs exact grad norm |A|·‖e_a − p‖", report["gmts"]["entropy_vs_exact_grad_norm"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    x = np.arange(len(groups))
    within = [g["within_answer_mean"] for _, g in groups]
    across = [g["across_answers"] for _, g in groups]
    nz = lambda v: 0.0 if v is None or not math.isfinite(v) else v  # noqa: E731
    ax.bar(x - width / 2, [nz(v) for v in within], width, label="within answers (mean)", color="tab:green")
    ax.bar(x + width / 2, [nz(v) for v in across], width, label="across answers (pooled)", color="tab:orange")
    for xi, w, a in zip(x, within, across):
        ax.text(xi - width / 2, nz(w), _fmt(w, 3), ha="center", va="bottom", fontsize=8)
        ax.text(xi + width / 2, nz(a), _fmt(a, 3), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([name for name, _ in groups])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylim(-1.05, 1.1)
    ax.set_ylabel("Spearman correlation")
    ax.legend(loc="lower left")
    title = "Entropy vs gradient size: within vs across answers"
    if not report.get("gmts"):
        title += "\n(exact gradient norm omitted: no advantages)"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scatter(plt, path: Path, entropies: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 ylabel: str, seed: int = 0) -> None:
    answer = np.concatenate([np.full(e.numel(), i) for i, e in enumerate(entropies)]) if entropies else np.zeros(0)
    h = torch.cat([e.double() for e in entropies]).numpy() if entropies else np.zeros(0)
    g = torch.cat([x.double() for x in grads]).numpy() if grads else np.zeros(0)
    n = h.size
    if n > SCATTER_MAX_POINTS:
        idx = np.sort(np.random.default_rng(seed).choice(n, SCATTER_MAX_POINTS, replace=False))
        h, g, answer = h[idx], g[idx], answer[idx]
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter(np.clip(h, ENTROPY_FLOOR, None), np.clip(g, ENTROPY_FLOOR, None), c=answer % 20, cmap="tab20",
               s=4, alpha=0.6, linewidths=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("token entropy H (nats)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{h.size} of {n} tokens, coloured by answer")
    fig.text(0.01, 0.01, f"values below {ENTROPY_FLOOR:g} (incl. 0) are drawn at {ENTROPY_FLOOR:g}", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_analysis(out_dir: str | os.PathLike, report: dict, scores, advantages: Optional[Sequence[float]]) -> Path:
    """Write report.json, report.md and the PNGs into ``out_dir`` (staged); returns report.json's path."""
    plt = require_matplotlib()
    entropies = [s.entropy.double() for s in scores]
    H = torch.cat(entropies) if entropies else torch.zeros(0, dtype=torch.float64)
    plots = ["entropy_hist.png", "correlation.png", "entropy_vs_grad.png"]
    with staged_output(out_dir) as tmp:
        plot_entropy_histogram(plt, tmp / plots[0], H, report["entropy"]["top_threshold"])
        plot_correlations(plt, tmp / plots[1], report)
        if advantages is not None:
            grads = [s.grad_norm.double() * abs(float(a)) for s, a in zip(scores, advantages)]
            ylabel = "exact gradient norm |A|·‖e_a − p‖"
        else:
            grads = [s.grad_norm.double() for s in scores]
            ylabel = "‖e_a − p‖ (no advantages: |A| omitted)"
        plot_scatter(plt, tmp / plots[2], entropies, grads, ylabel)
        report = dict(report, plots=plots)
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(analysis_markdown(report, plots), encoding="utf-8")
    return Path(out_dir) / "report.json"


# ----------------------------------------------------------------------------------------------------
# compare


def compare_markdown(report: dict, plot: str) -> str:
    o, d = report["overlap"], report["entropy_change"]
    pct = round(100 * report["top_ratio"])
    lines = [
        "# Entropy comparison of two models on the same responses",
        "",
        f"Model A: `{report.get('model_a', '?')}`  ",
        f"Model B: `{report.get('model_b', '?')}`  ",
        f"Data: `{report.get('data', '?')}` ({report['responses']} responses, {report['token_count']} tokens)",
        "",
        "| statistic | value |",
        "|---|---|",
        f"| share of A's top-{pct}% positions also in B's top-{pct}% | {_fmt(o['share_of_a_top_in_b_top'])} |",
        f"| Jaccard(A top-{pct}%, B top-{pct}%) | {_fmt(o['jaccard'])} |",
        f"| Spearman(H_A, H_B) over all tokens | {_fmt(report['spearman_entropy_a_b'])} |",
        f"| mean H_A / mean H_B | {_fmt(report['mean_entropy_a'])} / {_fmt(report['mean_entropy_b'])} |",
        "",
        "## How entropy moved (H_B − H_A, nats)",
        "",
        "| tokens | count | mean change | median change | share increased |",
        "|---|---|---|---|---|",
    ]
    for name, key in ((f"A's top-{pct}%", "a_top"), ("the rest", "rest")):
        g = d[key]
        lines.append(f"| {name} | {g['count']} | {_fmt(g['mean'])} | {_fmt(g['median'])} "
                     f"| {_fmt(g['share_increased'])} |")
    lines += ["", "The paper (arXiv 2506.01939) reports that RL training keeps > 86% of the base model's "
              "top-20% positions.", "", f"![{plot}]({plot})"]
    return "\n".join(lines) + "\n"


def plot_compare(plt, path: Path, h_a: torch.Tensor, h_b: torch.Tensor, a_top: torch.Tensor, seed: int = 0) -> None:
    a, b, top = h_a.double().numpy(), h_b.double().numpy(), a_top.numpy()
    n = a.size
    idx = np.arange(n)
    if n > SCATTER_MAX_POINTS:
        idx = np.sort(np.random.default_rng(seed).choice(n, SCATTER_MAX_POINTS, replace=False))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ca, cb = np.clip(a[idx], ENTROPY_FLOOR, None), np.clip(b[idx], ENTROPY_FLOOR, None)
    t = top[idx]
    ax1.scatter(ca[~t], cb[~t], s=4, alpha=0.5, color="tab:blue", label="rest", linewidths=0)
    ax1.scatter(ca[t], cb[t], s=4, alpha=0.7, color="tab:red", label="A's top-20%", linewidths=0)
    lo, hi = ENTROPY_FLOOR, max(float(max(ca.max(), cb.max())) if n else 1.0, 10 * ENTROPY_FLOOR)
    ax1.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("H_A (nats)")
    ax1.set_ylabel("H_B (nats)")
    ax1.legend(loc="upper left")
    ax1.set_title(f"{idx.size} of {n} tokens; values < {ENTROPY_FLOOR:g} drawn at {ENTROPY_FLOOR:g}", fontsize=9)
    delta = b - a
    rng = float(np.abs(delta).max()) if n else 1.0
    rng = rng if rng > 0 else 1.0
    bins = np.linspace(-rng, rng, 61)
    ax2.hist(delta[~top], bins=bins, alpha=0.6, color="tab:blue", label="rest", density=True)
    ax2.hist(delta[top], bins=bins, alpha=0.6, color="tab:red", label="A's top-20%", density=True)
    ax2.axvline(0, color="black", lw=0.8)
    ax2.set_xlabel("H_B − H_A (nats)")
    ax2.set_ylabel("density")
    ax2.legend()
    ax2.set_title("Entropy change")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_comparison(out_dir: str | os.PathLike, report: dict, h_a: torch.Tensor, h_b: torch.Tensor,
                     a_top: torch.Tensor) -> Path:
    plt = require_matplotlib()
    plot = "entropy_a_vs_b.png"
    with staged_output(out_dir) as tmp:
        plot_compare(plt, tmp / plot, h_a, h_b, a_top)
        report = dict(report, plots=[plot])
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(compare_markdown(report, plot), encoding="utf-8")
    return Path(out_dir) / "report.json"


__all__ = [
    "ENTROPY_FLOOR",
    "analysis_markdown",
    "compare_markdown",
    "require_matplotlib",
    "staged_output",
    "write_analysis",
    "write_comparison",
    "write_json",
]
