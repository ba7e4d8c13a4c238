"""Your own token rule, registered from user code, and one update through verl's real FSDP2 ``TrainingWorker``.

A rule is one class (:class:`verl_tokensel.core.rules.base.Rule`) registered by name with ``@register_rule``
(refusing to overwrite), its knobs one frozen dataclass extending ``Knobs`` (each field a ``knob`` with its
help text, default and paper value, checked in ``__post_init__``), and a preset naming it
(``register_preset``). What the rule does to verl's loss is one ``LossTransform`` per micro-batch: here only
``advantage_weight``; the policy loss stays verl's configured ``loss_mode``.

This rule, ``surprise_weight``: every valid token keeps its gradient, and its advantage is weighted by how
surprising the sampled token was against the micro-batch's mean surprisal ``s_t = -log pi(a_t)`` (detached)::

    w_t = clamp(1 + surprise_alpha * (s_t - mean_valid(s)), 1 / surprise_max_weight, surprise_max_weight)
    A'_t = w_t * A_t

Its metrics land under ``tokensel/surprise_weight/`` (mean, min and max weight).

In a real run the registration must happen in every process that converts the actor config (driver,
TaskRunner, actor workers): list this module in ``VERL_USE_EXTERNAL_MODULES`` or load it from a
``verl.plugins`` entry point of your own package (``examples/custom_preset.py`` shows both). From a checkout::

    VERL_USE_EXTERNAL_MODULES=examples.custom_rule TOKENSEL_SELECTOR=surprise_weight bash examples/run_dapo.sh

The rule's own knobs are set by the preset (register another preset for other values): the
``token_selection.<knob>`` keys of the command line are the package's rules' and the shared ones, fixed when
the package is imported.

``python examples/custom_rule.py`` registers the rule and its preset, builds the tiny CPU model, and runs one
``update_actor`` (``TrainingWorker.train_mini_batch``) with the selecting loss, printing the rule's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_tokensel.core.config import preset, register_preset
from verl_tokensel.core.errors import check_number
from verl_tokensel.core.rules.base import LossTransform, Knobs, Rule, knob, register_rule

NAME = "surprise_weight"


@dataclass(frozen=True)
class SurpriseKnobs(Knobs):
    surprise_alpha: float = knob(0.5, "Slope of the advantage weight in the token's surprisal -log p above the "
                                 "micro-batch's mean; 0 leaves the advantages as they are.", "n/a (example rule)")
    surprise_max_weight: float = knob(2.0, "Bound of the weight: it stays in [1 / max, max]; must be >= 1.",
                                      "n/a (example rule)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("token_selection.surprise_alpha", self.surprise_alpha, 0.0, None, "a number >= 0")
        check_number("token_selection.surprise_max_weight", self.surprise_max_weight, 1.0, None, "a number >= 1")


def surprise_weights(log_prob: torch.Tensor, tokens: torch.Tensor, alpha: float, max_weight: float) -> torch.Tensor:
    """``w_t`` on ``tokens`` (1 elsewhere), float32, detached."""
    s = -log_prob.detach().float()
    mean = s[tokens].mean() if tokens.any() else s.new_zeros(())
    w = (1.0 + alpha * (s - mean)).clamp(1.0 / max_weight, max_weight)
    return torch.where(tokens, w, torch.ones_like(w))


@register_rule(NAME)
class SurpriseWeight(Rule):
    """Per-token advantage weight from the sampled token's surprisal; no token loses its gradient."""

    Knobs = SurpriseKnobs

    def transform(self, sel, batch, mask, tokens, ctx) -> LossTransform:
        k = sel.knobs
        return LossTransform(advantage_weight=surprise_weights(batch.inputs.log_prob, tokens, k.surprise_alpha,
                                                               k.surprise_max_weight))

    def stats(self, sel, batch, mask, scores, tokens, transform) -> dict[str, float]:
        w = transform.advantage_weight[tokens]
        if w.numel() == 0:
            return {}
        return {f"{NAME}/mean_weight": float(w.mean()), f"{NAME}/min_weight": float(w.min()),
                f"{NAME}/max_weight": float(w.max())}


# score "all" ranks nothing: the rule sees every valid token of the micro-batch, the loss's token-mean over all
register_preset(NAME, preset(NAME, score="all", ratio=1.0, scope="micro_batch", normaliser="all",
                             surprise_alpha=0.5, surprise_max_weight=2.0))


def main() -> None:
    from verl_tokensel.core.config import resolve_selection
    from verl_tokensel_cpu import batches, worker
    from verl_tokensel.verl_glue.loss import SelectingLoss

    print(f"token_selector={NAME} -> {resolve_selection(NAME)}")
    actor = worker.make_training_worker(ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_gpu=2)
    config = worker.selecting_actor_config(actor, NAME)
    batch = batches.make_update_batch(actor)
    worker.compute_old_log_probs(actor, batch)  # the driver's old-log-prob pass
    result = worker.run_train_step(actor, batch, loss_fn=SelectingLoss(config))
    print(f"update_actor: loss {result.loss:.6f}, grad_norm {result.grad_norm:.6f}, "
          f"max |param change| {result.max_abs_param_delta:.3e}")
    for key in sorted(result.metrics):
        if key.startswith(f"tokensel/{NAME}/"):
            values = result.metrics[key]
            values = values if isinstance(values, list) else [values]
            per_micro = [worker._as_float(v) for v in values]
            print(f"{key} = {sum(per_micro) / len(per_micro):.6f} (mean of {len(per_micro)} micro-batches)")


if __name__ == "__main__":
    main()
