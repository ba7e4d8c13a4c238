"""Verifiable reward of the multi-decision task: 1.0 when every boxed value equals its ground truth, else 0.0.

verl's custom reward function (the signature of :func:`.reward.compute_score`), selected with::

    reward.custom_reward_function.path=pkg://verl_tokensel_cpu.demo.reward_multi
    reward.custom_reward_function.name=compute_score

The ground truth is the comma-separated list of the K right values (``"7,10,6,81"``,
:func:`.task_multi.ground_truth`); the answer is the response's last ``\\boxed{...}``, split at commas. The reward
is 1.0 only when there are exactly K entries, each an integer equal to its ground truth (``07`` counts as ``7``):
one wrong step anywhere loses the whole reward. Never raises (arbitrary model output scores 0.0).
"""

from __future__ import annotations

import re

from verl_tokensel_cpu.demo.reward import MAX_CHARS, last_boxed

_INT = re.compile(r"[+-]?\d+")


def boxed_values(text: str) -> list[int] | None:
    """The integers of the last ``\\boxed{a,b,...}`` of ``text`` (None when there is no box or an entry is not an
    integer)."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    parts = [p.strip() for p in boxed.split(",")]
    if not all(_INT.fullmatch(p) for p in parts):
        return None
    return [int(p) for p in parts]


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 if the last box of ``solution_str`` lists exactly the values of ``ground_truth``, else 0.0."""
    try:
        got = boxed_values(str(solution_str)[-MAX_CHARS:])
        want = [int(v) for v in str(ground_truth).split(",")]
        return 1.0 if got == want else 0.0
    except Exception:  # noqa: BLE001 - arbitrary model output must never crash the reward worker
        return 0.0
