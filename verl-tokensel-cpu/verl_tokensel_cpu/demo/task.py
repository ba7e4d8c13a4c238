"""The demo's reasoning trace: a fixed template around two decisions, and where those decisions sit.

Every answer to ``What is a op b?`` follows one template (:data:`TEMPLATE`) and takes one of two routes::

    Compute 3 + 4. Let's think step by step. 3 + 4 = 7. So the answer is \\boxed{7}.
    Compute 3 + 4. Let's guess. 3 + 4 = 9. So the answer is \\boxed{9}.

Everything but two places follows from the prompt or what came before. The two decisions: the **route**
(``think`` or ``guess`` after ``Let's``), a forking token in the 80/20 paper's sense, with the same context in
every problem, so what RL learns there carries over to all of them; and the **value** after ``=`` (the
computed result after ``think``, a near miss after ``guess``). The warm-up (:mod:`.warmup`) draws the route
with :func:`warmup_route` and the value with :func:`warmup_value`, so the warmed model is near-deterministic
on the template, spread at the route and partly right: the structure the 80/20 paper measures in real chains
of thought, with a reward that depends on the forking token.

:func:`decision_spans` finds the route word's and the value's characters in a response, and
:func:`decision_token_mask` maps them onto response tokens, so the demo can say which share of the selected
tokens sits on decisions.
"""

from __future__ import annotations

import random
import re
from typing import Optional, Sequence

TEMPLATE = "Compute {q}. {route} {q} = {value}. So the answer is \\boxed{{{value}}}."

#: the two routes: the word after "Let's" decides the trace
ROUTES = {"think": "Let's think step by step.", "guess": "Let's guess."}

# the route word, right after "Compute <question>. Let's "
_ROUTE = re.compile(r"Compute [^.]*\. Let's (think|guess)\b")
# the written value: the number right after "<route>. <question> = "
_VALUE = re.compile(r"Let's (?:think step by step|guess)\. [^=]*= (-?\d+)")

#: near misses the guess route writes (offsets from the correct value)
NEAR_MISS_OFFSETS = (-2, -1, 1, 2)


def trace(question: str, value: int | str, route: str = "think") -> str:
    """The templated response to ``question`` along ``route`` with written ``value`` (right or wrong)."""
    if route not in ROUTES:
        raise ValueError(f"route={route!r}: must be one of {', '.join(ROUTES)}")
    return TEMPLATE.format(q=question, route=ROUTES[route], value=value)


def warmup_route(q: float, rng: random.Random) -> str:
    """``think`` with probability ``q``, else ``guess``."""
    return "think" if rng.random() < q else "guess"


def warmup_value(answer: int, route: str, rng: random.Random) -> int:
    """The value a warm-up trace writes: ``answer`` after ``think``; after ``guess`` a near miss
    ``answer + d`` (``d`` in :data:`NEAR_MISS_OFFSETS`, kept non-negative: the problems' answers are 0..81)."""
    if route == "think":
        return answer
    return rng.choice([answer + d for d in NEAR_MISS_OFFSETS if answer + d >= 0])


def decision_spans(response: str) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the route word and of the written value in ``response`` (each only
    where the response follows the template there; ``[]`` when it does not at all)."""
    spans = []
    for pattern in (_ROUTE, _VALUE):
        m = pattern.search(response)
        if m:
            spans.append((m.start(1), m.end(1)))
    return spans


def route_of(response: str) -> Optional[str]:
    """``think``, ``guess`` or None (off the template)."""
    m = _ROUTE.search(response)
    return m.group(1) if m else None


def decision_token_mask(token_texts: Sequence[str], response: str) -> list[bool]:
    """Per response token: does it overlap a decision's characters (the route word or the value)?

    ``token_texts`` are the tokens' texts, which concatenate to ``response`` (as
    :func:`verl_tokensel.analysis.page.token_texts` returns them). A response off the template has no
    decision tokens (all False).
    """
    spans = decision_spans(response)
    out, pos = [], 0
    for text in token_texts:
        start, end = pos, pos + len(text)
        pos = end
        out.append(any(start < e and end > s for s, e in spans))
    return out
