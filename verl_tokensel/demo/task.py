"""The demo's reasoning trace: a fixed template around one decision, and where that decision sits.

Every answer to ``What is a op b?`` follows one template (:data:`TEMPLATE`)::

    Compute 3 + 4. Let's think step by step. 3 + 4 = 7. So the answer is \\boxed{7}.

Everything but the first ``7`` is determined by the prompt or by that ``7``: the fixed wording, the
restated operands, and the final answer copied from the decided value. The ``7`` after ``=`` is the
decision: the only place where the trace can go one way or another, and the one that decides the
reward. The supervised warm-up (:mod:`.warmup`) draws that value from a noisy label distribution
(:func:`noisy_value`: the correct value with probability ``q``, else a near miss), so the warmed
model is near-deterministic on the template and spread at the decision: the structure the 80/20
paper measures in real chains of thought (most tokens < 0.01 nats, a few forking tokens).

:func:`decision_span` finds the decided value's characters in any response that follows the
template, and :func:`decision_token_mask` maps them onto response tokens, so the demo can say which
share of the selected tokens sits on decisions.
"""

from __future__ import annotations

import random
import re
from typing import Optional, Sequence

TEMPLATE = "Compute {q}. Let's think step by step. {q} = {value}. So the answer is \\boxed{{{value}}}."

# the decided value: the number right after "step by step. <question> = "
_DECISION = re.compile(r"step by step\. [^=]*= (-?\d+)")

#: near misses the warm-up draws when it does not write the correct value (offsets from it)
NEAR_MISS_OFFSETS = (-2, -1, 1, 2)


def trace(question: str, value: int | str) -> str:
    """The templated response to ``question`` with decided ``value`` (right or wrong)."""
    return TEMPLATE.format(q=question, value=value)


def noisy_value(answer: int, q: float, rng: random.Random) -> int:
    """``answer`` with probability ``q``, else a near miss ``answer + d`` (``d`` in
    :data:`NEAR_MISS_OFFSETS`, kept non-negative: the problems' answers are 0..81)."""
    if rng.random() < q:
        return answer
    misses = [answer + d for d in NEAR_MISS_OFFSETS if answer + d >= 0]
    return rng.choice(misses)


def decision_span(response: str) -> Optional[tuple[int, int]]:
    """Character span ``(start, end)`` of the decided value in ``response``, or None when the response
    does not follow the template there."""
    m = _DECISION.search(response)
    return (m.start(1), m.end(1)) if m else None


def decision_token_mask(token_texts: Sequence[str], response: str) -> list[bool]:
    """Per response token: does it overlap the decided value's characters?

    ``token_texts`` are the tokens' texts, which concatenate to ``response`` (as
    :func:`verl_tokensel.analysis.page.token_texts` returns them). A response off the template has no
    decision tokens (all False).
    """
    span = decision_span(response)
    out, pos = [], 0
    for text in token_texts:
        start, end = pos, pos + len(text)
        pos = end
        out.append(span is not None and start < span[1] and end > span[0])
    return out
