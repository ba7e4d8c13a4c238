"""Comparison table and plot of the demo runs, from verl's per-step metrics (pure: no verl import).

Input: per preset, the list of per-step metric dicts that verl's trainer logged (``critic/score/mean``,
``perf/throughput``, ``actor/entropy``, and the plugin's ``tokensel/*`` metrics, which verl may log
under a prefix such as ``actor/``, so they are looked up by suffix).

Use::

    from verl_tokensel_cpu.demo.report import summarise, format_table, plot
    rows = [summarise(preset, steps) for preset, steps in runs.items()]
    print(format_table(rows))
    plot(runs, "demo.png", rows)
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

StepMetrics = Mapping[str, float]

# Name (or suffix) of each quantity in verl's metrics; the first present wins.
REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
SELECTED_FRACTION_KEY = "tokensel/selected_fraction"
ENTROPY_SELECTED_KEY = "tokensel/entropy_selected"
ENTROPY_UNSELECTED_KEY = "tokensel/entropy_unselected"
ENTROPY_ALL_KEY = "actor/entropy"
THROUGHPUT_KEY = "perf/throughput"


def metric(step: StepMetrics, *names: str) -> Optional[float]:
    """Value of the first of ``names`` in ``step``, matched exactly or as a ``/``-separated suffix
    (``tokensel/selected_fraction`` matches ``actor/tokensel/selected_fraction``); None if absent
    or not a finite number."""
    for name in names:
        hits = [v for k, v in step.items() if k == name or k.endswith("/" + name)]
        for value in hits:
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                return value
    return None


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass(frozen=True)
class PresetSummary:
    """One row of the comparison table. ``None`` = not measured (verl did not log it, or no rollouts).

    ``selected_fraction`` is 1.0 for a run without ``tokensel/*`` metrics (preset ``none``: verl's
    stock loss, every valid token gets gradient). Entropies are in nats; ``entropy_all`` is verl's
    ``actor/entropy`` (all response tokens, old-policy pass). ``tokens_per_s`` is verl's
    ``perf/throughput`` averaged over the steps after the first (the first one warms up).
    ``entropy_below_0_01_share``, ``entropy_p80``, ``decision_token_share``, ``selected_on_decision_share``
    and ``think_share`` come from the last step's rollouts (:mod:`.rollouts`).
    ``reward_gain`` is the mean reward of the last ``k`` steps minus that of the first ``k``
    (``k = min(3, steps // 2)``: one step's reward carries ~0.04 of sampling noise); ``learned`` is True
    when it exceeds :func:`noise_margin`.
    """

    preset: str
    steps: int
    reward_first: Optional[float]
    reward_last: Optional[float]
    reward_mean: Optional[float]
    selected_fraction: Optional[float]
    entropy_selected: Optional[float]
    entropy_unselected: Optional[float]
    entropy_all: Optional[float]
    tokens_per_s: Optional[float]
    wall_s: Optional[float] = None
    entropy_below_0_01_share: Optional[float] = None
    entropy_p80: Optional[float] = None
    decision_token_share: Optional[float] = None
    selected_on_decision_share: Optional[float] = None
    think_share: Optional[float] = None
    reward_gain: Optional[float] = None
    noise_margin: Optional[float] = None
    learned: Optional[bool] = None


def noise_margin(first: float, last: float, n: int) -> float:
    """Two standard errors of ``last - first`` when each is a mean of ``n`` independent 0/1 rewards:
    ``2 sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n)`` (binomial sampling noise of the answers)."""
    return 2.0 * math.sqrt((first * (1 - first) + last * (1 - last)) / n)


GAIN_STEPS = 3


def summarise(preset: str, steps: Sequence[StepMetrics], wall_s: Optional[float] = None,
              rollouts: Optional[Mapping[str, Any]] = None,
              responses_per_step: Optional[int] = None) -> PresetSummary:
    """Reduce one run's per-step metrics (in step order), and optionally its last step's rollout
    statistics (:func:`.rollouts.analyse_rollouts`), to a :class:`PresetSummary`. With
    ``responses_per_step`` the row also says whether the reward rose beyond its sampling noise."""
    rewards = [metric(s, *REWARD_KEYS) for s in steps]
    fractions = [metric(s, SELECTED_FRACTION_KEY) for s in steps]
    has_selection = any(f is not None for f in fractions)
    throughput = [metric(s, THROUGHPUT_KEY) for s in steps]
    first = next((r for r in rewards if r is not None), None)
    last = next((r for r in reversed(rewards) if r is not None), None)
    gain = margin = learned = None
    known = [r for r in rewards if r is not None]
    k = min(GAIN_STEPS, len(known) // 2)
    if k:
        head, tail = _mean(known[:k]), _mean(known[-k:])
        gain = tail - head
        if responses_per_step:
            margin = noise_margin(head, tail, k * responses_per_step)
            learned = gain > margin
    roll = rollouts or {}
    return PresetSummary(
        preset=preset,
        steps=len(steps),
        reward_first=first,
        reward_last=last,
        reward_mean=_mean(rewards),
        selected_fraction=_mean(fractions) if has_selection else (1.0 if steps else None),
        entropy_selected=_mean([metric(s, ENTROPY_SELECTED_KEY) for s in steps]),
        entropy_unselected=_mean([metric(s, ENTROPY_UNSELECTED_KEY) for s in steps]),
        entropy_all=_mean([metric(s, ENTROPY_ALL_KEY) for s in steps]),
        tokens_per_s=_mean(throughput[1:] if len(throughput) > 1 else throughput),
        wall_s=wall_s,
        entropy_below_0_01_share=roll.get("entropy_below_0_01_share"),
        entropy_p80=roll.get("entropy_p80"),
        decision_token_share=roll.get("decision_token_share"),
        selected_on_decision_share=roll.get("selected_on_decision_share"),
        think_share=roll.get("think_share"),
        reward_gain=gain,
        noise_margin=margin,
        learned=learned,
    )


def _learned_cell(row: PresetSummary) -> Optional[str]:
    if row.learned is None:
        return None
    return "yes" if row.learned else "no"


COLUMNS = (  # (header, attribute or function, format)
    ("preset", "preset", "{}"),
    ("steps", "steps", "{:d}"),
    ("reward first", "reward_first", "{:.3f}"),
    ("reward last", "reward_last", "{:.3f}"),
    ("gain", "reward_gain", "{:+.3f}"),
    ("learned", _learned_cell, "{}"),
    ("think", "think_share", "{:.3f}"),
    ("selected", "selected_fraction", "{:.3f}"),
    ("H<0.01", "entropy_below_0_01_share", "{:.3f}"),
    ("H p80", "entropy_p80", "{:.4f}"),
    ("sel on dec", "selected_on_decision_share", "{:.3f}"),
    ("dec share", "decision_token_share", "{:.3f}"),
    ("H sel", "entropy_selected", "{:.4f}"),
    ("H unsel", "entropy_unselected", "{:.4f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("wall s", "wall_s", "{:.0f}"),
)

TABLE_NOTE = (
    "reward: verl's critic/score/mean (share of correct answers) at the first and last step; gain: mean of the\n"
    "  last 3 steps minus mean of the first 3; learned: yes when the gain exceeds 2 standard errors of the\n"
    "  answers' binomial sampling noise (no: the rise, if any, is within noise);\n"
    "think: share of the last step's answers that take the think route (the forking decision);\n"
    "selected: fraction of response tokens that got gradient (none = stock verl, all tokens);\n"
    "H<0.01 / H p80: share of the last step's response tokens with entropy < 0.01 nats / 80th-percentile\n"
    "  entropy (nats), under the final policy (the 80/20 paper's two statistics);\n"
    "sel on dec / dec share: share of the preset's selected tokens on the task's decisions (the route word and\n"
    "  the written value) vs their share of all response tokens (last step's rollouts, on-policy selection);\n"
    "H sel / H unsel: mean entropy (nats) of selected / unselected tokens in the updates (verl metrics);\n"
    "tokens/s: verl's perf/throughput, mean over steps after the first; wall s: whole run incl. start-up."
)


def format_table(rows: Sequence[PresetSummary]) -> str:
    """A fixed-width text table (one line per preset; ``-`` where nothing was measured)."""
    cells = [[h for h, _, _ in COLUMNS]]
    for row in rows:
        line = []
        for _, attr, fmt in COLUMNS:
            value = attr(row) if callable(attr) else getattr(row, attr)
            line.append("-" if value is None else fmt.format(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json(rows: Sequence[PresetSummary]) -> list[dict]:
    return [asdict(r) for r in rows]


#: (marker, line style, marker size, filled) per line, in order: lines that coincide (two runs with the same rewards)
#: stay visible, a hollow larger marker around a filled smaller one, dashes over a solid line
LINE_STYLES = (("o", "-", 9, True), ("s", "--", 7, False), ("^", ":", 6, True), ("D", "-.", 5, False),
               ("v", (0, (5, 1)), 8, True), ("x", (0, (1, 2)), 8, True), ("P", (0, (3, 1, 1, 1)), 6, False))


def line_style(i: int) -> dict:
    """Matplotlib keywords of the ``i``-th line of :func:`plot` (:data:`LINE_STYLES`, cycled)."""
    marker, linestyle, size, filled = LINE_STYLES[i % len(LINE_STYLES)]
    style = {"marker": marker, "linestyle": linestyle, "markersize": size}
    if not filled:
        style["markerfacecolor"] = "none"
    return style


#: the two bars of each preset in :func:`plot`'s second panel: (PresetSummary attribute, legend label)
DECISION_BARS = (("selected_on_decision_share", "share of its selected tokens on the decisions"),
                 ("decision_token_share", "decisions' share of all response tokens"))


def plot(runs: Mapping[str, Sequence[StepMetrics]], path: str | os.PathLike, rows: Sequence[PresetSummary]) -> str:
    """PNG with two panels; returns the path. Left: the reward per step, one line per preset, each with its own
    marker and dashes (:func:`line_style`). Right, from ``rows`` (the table's, last step's rollouts): per preset, the
    share of its selected tokens that sit on the task's decisions next to the decisions' share of all response
    tokens (:data:`DECISION_BARS`; equal for ``none``, which selects every token; the gap is where a selector puts
    its budget). A preset without rollout statistics gets no bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_r, ax_d) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (preset, steps) in enumerate(runs.items()):
        x = list(range(1, len(steps) + 1))
        rewards = [metric(s, *REWARD_KEYS) for s in steps]
        ax_r.plot(x, [math.nan if r is None else r for r in rewards], label=preset, **line_style(i))
    ax_r.set(title="reward (critic/score/mean)", xlabel="step", ylabel="mean reward")
    ax_r.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_r.grid(alpha=0.3)
    ax_r.legend()
    width = 0.8 / len(DECISION_BARS)
    for j, (attr, label) in enumerate(DECISION_BARS):
        values = [getattr(row, attr) for row in rows]
        bars = ax_d.bar([i + (j - (len(DECISION_BARS) - 1) / 2) * width for i in range(len(rows))],
                        [math.nan if v is None else v for v in values], width, label=label, hatch="//" if j else None,
                        alpha=1.0 if j == 0 else 0.6)
        ax_d.bar_label(bars, labels=["" if v is None else f"{v:.2f}" for v in values], fontsize=8)
    ax_d.set_xticks(range(len(rows)), [row.preset if all(getattr(row, a) is not None for a, _ in DECISION_BARS)
                                       else f"{row.preset}\n(not measured)" for row in rows])
    known = [v for row in rows for v in (getattr(row, a) for a, _ in DECISION_BARS) if v is not None]
    ax_d.set(title="selected tokens on the decisions (last step)", ylabel="share of tokens",
             ylim=(0, min(1.05, 1.3 * max(known, default=0.8))))
    ax_d.grid(alpha=0.3, axis="y")
    ax_d.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
