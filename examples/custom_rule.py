"""Your own token rule, registered from user code, its knob set on the command line, and one update through verl's
real FSDP2 ``TrainingWorker``.

A rule is a function of one input ``x`` (the micro-batch's tensors by name) returning what the tokens get in the
loss, registered by name with ``@register_rule`` (refusing to overwrite): that one registration makes it a
``token_selector``. Its knobs are one frozen dataclass extending ``Knobs`` (each field a ``knob`` with its help text,
default, paper value and valid range). It keeps every valid token unless it says otherwise. All of it comes from one
module, :mod:`verl_tokensel.rules`.

This rule, ``surprise_weight``: every valid token keeps its gradient, and its advantage is weighted by how
surprising the sampled token was against the micro-batch's mean surprisal ``s_t = -log pi(a_t)`` (detached)::

    w_t = clamp(1 + surprise_alpha * (s_t - mean_valid(s)), 1 / surprise_max_weight, surprise_max_weight)
    A'_t = w_t * A_t

Its metrics land under ``tokensel/surprise_weight/`` (mean, min and max weight).

In a real run the registration must happen in every process that converts the actor config (driver, TaskRunner,
actor workers): list this module in ``VERL_USE_EXTERNAL_MODULES`` (or load it from a ``verl.plugins`` entry point of
your own package). Its knobs are command-line keys like the built-in ones; from a checkout::

    VERL_USE_EXTERNAL_MODULES=examples.custom_rule python -m verl_tokensel.main_ppo \
        actor_rollout_ref.actor.token_selector=surprise_weight \
        actor_rollout_ref.actor.token_selection.surprise_alpha=0.7 <your usual overrides>

``python examples/custom_rule.py [surprise_alpha]`` registers the rule, builds the tiny CPU model, and runs one
``update_actor`` (``TrainingWorker.train_mini_batch``) with the selecting loss, printing the rule's metrics.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from verl_tokensel.rules import Knobs, LossTransform, knob, register_rule

NAME = "surprise_weight"


@dataclass(frozen=True)
class SurpriseKnobs(Knobs):
    surprise_alpha: float = knob(0.5, "Slope of the advantage weight in the token's surprisal -log p above the "
                                 "micro-batch's mean; 0 leaves the advantages as they are.", "n/a (example rule)", ge=0)
    surprise_max_weight: float = knob(2.0, "Bound of the weight: it stays in [1 / max, max].", "n/a (example rule)",
                                      ge=1)


@register_rule(NAME, knobs=SurpriseKnobs, source="examples/custom_rule.py (an example, no paper)",
               formula="A' = A * clamp(1 + alpha * (-log p - mean(-log p)), 1 / max, max)")
def surprise_weight(x) -> LossTransform:
    """Per-token advantage weight from the sampled token's surprisal; no token loses its gradient."""
    k, tokens = x.knobs, x.tokens
    s = -x.log_prob.float()
    mean = s[tokens].mean() if tokens.any() else s.new_zeros(())
    w = (1.0 + k.surprise_alpha * (s - mean)).clamp(1.0 / k.surprise_max_weight, k.surprise_max_weight)
    w = w.where(tokens, 1.0)
    seen = w[tokens] if tokens.any() else w.new_ones(1)
    return LossTransform(advantage_weight=w, metrics={"mean_weight": seen.mean(), "min_weight": seen.min(),
                                                      "max_weight": seen.max()})


def main(argv: list[str]) -> None:
    from verl_tokensel_cpu import update, worker

    knobs = {"surprise_alpha": float(argv[0])} if argv else {}
    actor = worker.make_training_worker(ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_gpu=2)
    result, selection = update.train_with(actor, NAME, **knobs)  # old-log-prob pass, then one update_actor
    print(f"token_selector={NAME} -> {selection}")
    print(f"update_actor: loss {result.loss:.6f}, grad_norm {result.grad_norm:.6f}, "
          f"max |param change| {result.max_abs_param_delta:.3e}")
    for key, value in update.metric_means(result, "tokensel/").items():
        print(f"{key} = {value:.6f} (mean over the micro-batches)")


if __name__ == "__main__":
    from verl_tokensel_cpu.demo.console import quiet_console

    with quiet_console():  # the known third-party notices (Apex, optional engines, ...) off the console, as the demo
        main(sys.argv[1:])
