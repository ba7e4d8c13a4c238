"""Your own token score, and a preset that selects with it.

A score is a function of the padded per-token inputs (``inp``: a ``ScoreInputs``, its fields in docs/rule-api.md)
returning ``(batch, response_len)`` scores, registered with ``register_score`` from :mod:`verl_tokensel.rules`; a
preset names a score plus the selection rule. Both registries refuse to
overwrite an existing name. This one, ``low_confidence``: ``1 - p(a_t)``, the tokens the policy sampled
with low probability (no entropy needed, so the engine computes nothing extra).

The registration must run in every process that converts the actor config (driver, TaskRunner, actor
workers): list the module in ``VERL_USE_EXTERNAL_MODULES`` or load it from a ``verl.plugins`` entry point
of your own package; ``examples/custom_preset.py`` explains both. From a checkout root::

    VERL_USE_EXTERNAL_MODULES=examples.custom_score TOKENSEL_SELECTOR=low_confidence bash examples/run_dapo.sh

``python examples/custom_score.py`` registers both and selects on a hand-made batch of two responses.
"""

from __future__ import annotations

import torch

from verl_tokensel.rules import register_preset, register_score

NAME = "low_confidence"


@register_score(NAME, needs_entropy=False, needs_omega=False,
                help="1 - p(a_t): tokens the policy sampled with low probability")
def low_confidence(inp) -> torch.Tensor:
    # detached: a score ranks tokens, it never carries gradient; expm1 keeps precision near p = 1
    return -torch.expm1(inp.log_prob.detach().float())


register_preset(NAME, rule="gradient_mask", score=NAME, ratio=0.2, direction="top", scope="micro_batch",
                normaliser="all")


if __name__ == "__main__":
    from verl_tokensel.core.config import resolve_selection
    from verl_tokensel.core.ranking.scores import ScoreInputs
    from verl_tokensel.core.ranking.select import select_tokens

    rule = resolve_selection(NAME)  # what every process derives from token_selector=low_confidence
    print(f"token_selector={NAME} -> {rule}")
    # two responses of 5 and 3 tokens (the second padded): probabilities of the sampled tokens
    p = torch.tensor([[0.99, 0.40, 0.97, 0.05, 0.90],
                      [0.80, 0.30, 0.95, 1.00, 1.00]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    scores = low_confidence(ScoreInputs(log_prob=p.log(), response_mask=valid))
    mask = select_tokens(scores, valid, rule.knobs.ratio, scope=rule.scope, direction=rule.knobs.direction)
    # ceil(0.2 x 8 valid tokens) = 2 kept: the two least likely, p = 0.05 and 0.30
    print("p(a_t) of the selected tokens:", [round(x, 2) for x in p[mask].tolist()])
