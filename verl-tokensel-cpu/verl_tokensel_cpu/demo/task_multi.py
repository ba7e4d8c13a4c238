"""The multi-decision task: K arithmetic steps per answer, each with its own route choice; every one must be right.

The two-route task (:mod:`.task`) has one fork per answer, so a random 20% of an answer's tokens holds it about
once in five answers. Here every prompt asks K single-digit problems (the two-route task's problem space), and
the answer works through them in order, each step taking the ``think`` or the ``guess`` route::

    What are 3 + 4, 5 * 2, 7 - 1 and 9 * 9? Put the final answers in \\boxed{}.
    Let's think. 3 + 4 = 7. Let's guess. 5 * 2 = 11. Let's think. 7 - 1 = 6. Let's think. 9 * 9 = 81.
    So \\boxed{7,11,6,81}.

(one line in the answer)

After ``think`` the step writes the computed value, after ``guess`` a near miss (:func:`.task.warmup_value`); the
reward (:mod:`.reward_multi`) is 1 only when every boxed value is right, so one wrong route anywhere loses it. The
warm-up (:mod:`.warmup`, :class:`.warmup.MultiWarmupConfig`) draws each step's route independently (``think``
with probability ``q``), so the warmed model is near-deterministic on the template and spread at each of the K
route words: with K = 4 and q = 0.8 about 0.8^4 = 0.41 of the answers take ``think`` everywhere.

:func:`decision_spans` finds the route words' and the written values' characters (the decisions, as in the
two-route task), :func:`route_spans` the route words only and :func:`fork_spans` the character where each route is
chosen (the space before the word: the tiny tokenizer writes `` think`` as one token but ``guess`` as a space token
followed by four determined pieces, so the choice is the token holding that space); :func:`decision_token_mask` maps
any of them onto response tokens.
"""

from __future__ import annotations

import random
import re
from typing import Optional, Sequence

from verl_tokensel_cpu.demo.task import ROUTES, warmup_route, warmup_value

#: one step of the answer; the steps follow each other with a space, then the boxed list of the written values
STEP = "Let's {route}. {q} = {value}."
FINAL = "So \\boxed{{{values}}}."
#: the route words of a step (the word after "Let's"), as :data:`.task.ROUTES` names them
STEP_ROUTES = {name: name for name in ROUTES}

# one step: its route word and its written value
_STEP = re.compile(r"Let's (think|guess)\. [^=.]*= (-?\d+)\.")
# the route word of a step, also when the rest of the step is off the template
_ROUTE = re.compile(r"Let's (think|guess)\b")


def trace(questions: Sequence[str], values: Sequence[int | str], routes: Sequence[str]) -> str:
    """The templated answer to ``questions``: step i takes ``routes[i]`` and writes ``values[i]`` (right or wrong);
    the boxed list repeats the written values."""
    if not len(questions) == len(values) == len(routes) or not questions:
        raise ValueError(f"questions, values and routes: one per step and at least one step, got {len(questions)}, "
                         f"{len(values)} and {len(routes)}")
    bad = [r for r in routes if r not in STEP_ROUTES]
    if bad:
        raise ValueError(f"route={bad[0]!r}: must be one of {', '.join(STEP_ROUTES)}")
    steps = [STEP.format(route=r, q=q, value=v) for q, v, r in zip(questions, values, routes)]
    return " ".join(steps + [FINAL.format(values=",".join(str(v) for v in values))])


def ground_truth(answers: Sequence[int | str]) -> str:
    """The reward's ground truth: the right values, comma-separated (``"7,10,6,81"``)."""
    return ",".join(str(int(a)) for a in answers)


def warmup_example(problems: Sequence[tuple[str, str]], k: int, q: float,
                   rng: random.Random) -> tuple[list[str], list[int], list[str]]:
    """One warm-up answer: ``k`` distinct problems drawn from ``problems``, each step's route drawn independently
    (``think`` with probability ``q``) and its value written accordingly; returns ``(questions, values, routes)``."""
    picked = rng.sample(list(problems), k)
    questions, values, routes = [], [], []
    for question, answer in picked:
        route = warmup_route(q, rng)
        questions.append(question)
        routes.append(route)
        values.append(warmup_value(int(answer), route, rng))
    return questions, values, routes


def steps_of(response: str) -> list[tuple[str, int]]:
    """``(route, written value)`` of each step that follows the template, in order."""
    return [(m.group(1), int(m.group(2))) for m in _STEP.finditer(response)]


def routes_of(response: str) -> list[str]:
    """The route word of every step (``think`` / ``guess``), in order; ``[]`` off the template."""
    return [m.group(1) for m in _ROUTE.finditer(response)]


def route_spans(response: str) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the route words."""
    return [(m.start(1), m.end(1)) for m in _ROUTE.finditer(response)]


def fork_spans(response: str) -> list[tuple[int, int]]:
    """Character spans of the place where each step's route is chosen: the space before its route word."""
    return [(m.start(1) - 1, m.start(1)) for m in _ROUTE.finditer(response)]


def decision_spans(response: str) -> list[tuple[int, int]]:
    """Character spans of the decisions: every route word and every written value of a templated step."""
    spans = route_spans(response)
    spans += [(m.start(2), m.end(2)) for m in _STEP.finditer(response)]
    return sorted(set(spans))


def decision_token_mask(token_texts: Sequence[str], response: str, *, routes_only: bool = False,
                        forks_only: bool = False) -> list[bool]:
    """Per response token: does it overlap a decision's characters (``routes_only``: a route word's; ``forks_only``:
    the place a route is chosen, one token per step)?

    ``token_texts`` concatenate to ``response`` (as :func:`verl_tokensel.analysis.page.token_texts` returns them).
    """
    spans = fork_spans(response) if forks_only else route_spans(response) if routes_only else decision_spans(response)
    return spans_token_mask(token_texts, spans)


def spans_token_mask(token_texts: Sequence[str], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token of ``token_texts`` (consecutive pieces of one text): does it overlap one of ``spans``?"""
    out, pos = [], 0
    for text in token_texts:
        start, end = pos, pos + len(text)
        pos = end
        out.append(any(start < e and end > s for s, e in spans))
    return out


def think_counts(response: str) -> tuple[int, int]:
    """``(steps on the think route, steps)`` of ``response``."""
    routes = routes_of(response)
    return sum(r == "think" for r in routes), len(routes)


def route_of(response: str) -> Optional[str]:
    """``think`` when every step takes the think route, ``guess`` when one does not, None off the template."""
    routes = routes_of(response)
    if not routes:
        return None
    return "think" if all(r == "think" for r in routes) else "guess"
