"""A rule written as a function, registered once, is a ``token_selector``: no preset line, every valid token kept but
its gate, and the selection metrics count what the gate let through.

The rule below is five lines of user code importing only ``verl_tokensel.rules``. It trains through verl's real FSDP2
``TrainingWorker`` (one update on the tiny model): the selection keeps every valid token (the rule ranks nothing), the
gradient flows only through the gate (equal, parameter by parameter, to the gradient of the same update with the
advantages zeroed off the gate), and ``tokensel/selected_fraction`` is the gate's share of the valid tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_tokensel.core.resolve.presets import PRESETS
from verl_tokensel.core.rules import RULE_REGISTRY

GATE, WEIGHT = "test_low_confidence_gate", "test_low_confidence_weight"


@pytest.fixture
def user_rules():
    from verl_tokensel.rules import LossTransform, register_rule

    shares = []

    @register_rule(GATE)
    def low_confidence_gate(x) -> LossTransform:  # the five lines a user writes
        gate = x.tokens & (x.log_prob < x.log_prob[x.tokens].median())
        shares.append(float(gate.sum()) / float(x.tokens.sum()))
        return LossTransform(gate=gate)

    @register_rule(WEIGHT)
    def low_confidence_weight(x) -> LossTransform:  # the same tokens, by a zero advantage elsewhere
        gate = x.tokens & (x.log_prob < x.log_prob[x.tokens].median())
        return LossTransform(advantage_weight=gate.float())

    try:
        yield shares
    finally:
        RULE_REGISTRY.pop(GATE, None)
        RULE_REGISTRY.pop(WEIGHT, None)


def test_a_five_line_function_rule_is_one_registration(user_rules):
    from verl_tokensel.core.config import resolve_selection
    from verl_tokensel.core.resolve.describe import describe_preset

    assert GATE not in PRESETS
    sel = resolve_selection(GATE)
    assert (sel.rule, sel.score, sel.ratio, sel.scope, sel.normaliser) == (GATE, "all", 1.0, "micro_batch", "all")
    assert GATE in describe_preset(GATE)


def test_a_function_rule_trains_through_fsdp2_and_the_metrics_report_its_gate(user_rules):
    from verl_tokensel_cpu import worker as W
    from verl_tokensel_cpu.batches import make_update_batch
    from verl_tokensel.verl_glue.loss import SelectingLoss

    actor = W.make_training_worker(lr=0.0, clip_grad=1e6, ppo_micro_batch_size_per_gpu=2)
    runs = {}
    for name in (GATE, WEIGHT):
        seen = []
        cfg = W.selecting_actor_config(actor, name)
        batch = make_update_batch(actor, seed=5)
        W.compute_old_log_probs(actor, batch)
        observer = lambda o, seen=seen: seen.append((o["mask"].clone(), o["response_mask"].clone()))  # noqa: E731
        result = W.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg, observer=observer), capture_grads=True,
                                  capture_params=False)
        runs[name] = (seen, result)
    seen, result = runs[GATE]
    assert seen and all(torch.equal(mask, valid.bool()) for mask, valid in seen), "every valid token is kept"
    shares = user_rules
    assert shares and max(shares) < 0.9, shares
    reported = float(np.mean(result.metrics["tokensel/selected_fraction"]))
    assert reported == pytest.approx(float(np.mean(shares)), abs=1e-6), (reported, shares)
    gate_grads, weight_grads = result.grads_per_step[-1], runs[WEIGHT][1].grads_per_step[-1]
    assert gate_grads.keys() == weight_grads.keys() and gate_grads
    for name, grad in gate_grads.items():
        torch.testing.assert_close(grad, weight_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in gate_grads.values())


def test_a_rule_that_declares_a_need_and_does_not_get_it_fails_naming_it():
    """A rule with ``Needs(entropy=True)`` on a batch whose pass computed no entropy fails with a message naming the
    need (not a ``'NoneType' object has no attribute`` deep in the rule)."""
    from verl_tokensel.core.ranking.batch import score_batch
    from verl_tokensel.core.config import resolve_selection
    from verl_tokensel.core.step import apply_rule
    from verl_tokensel.rules import LossTransform, Needs, register_rule

    name = "test_needs_entropy"

    @register_rule(name, needs=Needs(entropy=True))
    def entropy_gate(x) -> LossTransform:
        return LossTransform(gate=x.tokens & (x.entropy > 0.5))

    try:
        sel = resolve_selection(name)
        valid = torch.ones(2, 4, dtype=torch.bool)
        batch = score_batch(sel.scores, {"response_mask": valid, "old_log_probs": torch.full((2, 4), -1.0)})
        with pytest.raises(RuntimeError, match=r"rule test_needs_entropy declares Needs\(entropy=True\)"):
            apply_rule(sel, batch)
        entropy = torch.tensor([[0.1, 0.9, 0.2, 0.8], [1.0, 0.0, 0.7, 0.3]])
        batch = score_batch(sel.scores, {"response_mask": valid, "old_log_probs": torch.full((2, 4), -1.0),
                                         "entropy": entropy})
        out = apply_rule(sel, batch)
        assert torch.equal(out.mask, valid) and out.stats["selected_fraction"] == 0.5
    finally:
        RULE_REGISTRY.pop(name, None)
