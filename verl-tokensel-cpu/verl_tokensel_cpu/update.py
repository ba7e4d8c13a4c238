"""One update of the CPU actor with a token selector, for examples and quick checks: verl's old-log-prob pass, then
``update_actor`` (``TrainingWorker.train_mini_batch``) with the selecting loss, and its metrics as numbers."""

from __future__ import annotations

from typing import Any

from verl_tokensel_cpu.batches import make_update_batch
from verl_tokensel_cpu.worker import (CpuActor, StepResult, _as_float, compute_old_log_probs, run_train_step,
                                      selecting_actor_config)


def train_with(actor: CpuActor, selector: str, *, seed: int = 0, **knobs) -> tuple[StepResult, Any]:
    """One update of ``actor`` with ``token_selector=selector`` (a preset or a registered rule; ``knobs`` are
    ``token_selection.*`` values): a fresh update batch, verl's old-log-prob pass, then ``update_actor`` with the
    selecting loss. Returns the step's result and the resolved selection."""
    from verl_tokensel.verl_glue.loss import SelectingLoss

    config = selecting_actor_config(actor, selector, **knobs)
    loss = SelectingLoss(config)
    actor.set_loss_fn(loss)  # as verl's trainer: the loss is installed before the old-log-prob pass reads it
    batch = make_update_batch(actor, seed=seed, calculate_entropy=config.calculate_entropy)
    compute_old_log_probs(actor, batch)
    return run_train_step(actor, batch, loss_fn=loss), config.selection


def metric_means(result: StepResult, prefix: str) -> dict[str, float]:
    """The step's metrics under ``prefix``, each the mean of its micro-batches' values."""
    out = {}
    for key in sorted(result.metrics):
        if key.startswith(prefix):
            values = result.metrics[key]
            values = [_as_float(v) for v in (values if isinstance(values, list) else [values])]
            out[key] = sum(values) / len(values)
    return out


__all__ = ["metric_means", "train_with"]
