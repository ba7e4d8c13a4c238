"""Verifiable reward for the demo dataset: 1.0 if the response's final answer equals the ground truth.

verl's custom reward function (signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)``), selected in verl 0.9.1 with::

    reward.custom_reward_function.path=pkg://verl_tokensel_cpu.demo.reward
    reward.custom_reward_function.name=compute_score

The answer is the last ``\\boxed{...}`` of the response, else its last number. Checking, cheapest
first:

1. exact match of that answer with the ground truth (the common case: ``\\boxed{7}``, ``... = 7``);
2. both plain integers and different: 0.0, without parsing;
3. otherwise math-verify (``parse`` + ``verify``, e.g. ``\\boxed{14/2}`` or ``7.0``), on the last
   :data:`MAX_CHARS` characters of the response only.

Never raises: a random model's output is arbitrary text, and anything math-verify cannot parse
scores 0.0. math-verify's timeouts use ``signal.alarm``, which only works in a process's main
thread; verl calls reward functions from a thread pool, so elsewhere the timeouts are off (the
inputs are short and bounded by :data:`MAX_CHARS`).
"""

from __future__ import annotations

import re
import threading

MAX_CHARS = 300
_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_INT = re.compile(r"-?\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces (``\\boxed{\\frac{1}{2}}``), or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of ``text``: its last ``\\boxed{...}`` content, else its last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(s: str) -> str:
    return s.strip().replace(" ", "").rstrip(".").removeprefix("+")


def _math_verify(solution: str, ground_truth: str) -> float:
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
    pred = parse(solution, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 if the final answer of ``solution_str`` equals ``ground_truth``, else 0.0 (never raises)."""
    try:
        text = str(solution_str)[-MAX_CHARS:]
        truth = _normalise(str(ground_truth))
        answer = extract_answer(text)
        if answer is None:
            return 0.0
        answer = _normalise(answer)
        if answer == truth:
            return 1.0
        if _INT.fullmatch(answer) and _INT.fullmatch(truth):
            return 1.0 if int(answer) == int(truth) else 0.0  # "07" == "7"
        return _math_verify(text, truth)
    except Exception:  # noqa: BLE001 - arbitrary model output must never crash the reward worker
        return 0.0
