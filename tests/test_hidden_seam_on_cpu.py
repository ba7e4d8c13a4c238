"""The hidden-state seam is open to a rule written outside the product, and costs nothing to a rule that does not ask.

A rule built from ``verl_tokensel.rules`` alone (a four-line :class:`HiddenStates`: one pass returning each token's
hidden-state norm) trains through verl's real FSDP2 ``TrainingWorker``: the loss receives, as ``x.hidden``, exactly the
norms of the model's own last hidden states (read independently through ``output_hidden_states``), and the output layer
runs once more per micro-batch (its one pass). ``forking`` in the same worker runs the output layer only in its update
forward: no pass, no field.
"""

from __future__ import annotations

import pytest
import torch

from verl_tokensel.core import fields
from verl_tokensel.core.rules import RULE_REGISTRY

NAME = "test_hidden_norm"


@pytest.fixture
def user_rule():
    from verl_tokensel.rules import HiddenStates, LossTransform, Needs, register_rule

    class NormStates(HiddenStates):
        sweeps = 1

        def sweep(self, i, batch):
            return batch.hidden.float().norm(dim=-1)

    seen = []

    @register_rule(NAME, needs=Needs(normalisers=("all",), hidden_states=NormStates))
    def hidden_norm(x) -> LossTransform:
        seen.append(x.hidden.clone())
        return LossTransform(gate=x.mask, metrics={"norm_mean": x.hidden[x.tokens].mean()})

    try:
        yield seen
    finally:
        RULE_REGISTRY.pop(NAME, None)


def _hidden_norms(actor, batch, width):
    rows = []
    with torch.no_grad():
        for i in range(batch["prompts"].shape[0]):
            p, r = batch["prompts"][i], batch["responses"][i]
            out = actor.module(input_ids=torch.cat([p, r]).unsqueeze(0), output_hidden_states=True, use_cache=False)
            h = out.hidden_states[-1][0, p.numel() - 1: p.numel() + r.numel() - 1].float().norm(dim=-1)
            rows.append(torch.nn.functional.pad(h, (0, width - h.numel())))
    return torch.stack(rows)


def _count_output_layer_calls(actor):
    from verl_tokensel.verl_glue.hidden import output_layer

    calls = []
    handle = output_layer(actor.engine).register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    return calls, handle.remove


def test_a_user_rule_reads_hidden_states_and_others_pay_nothing(user_rule):
    from verl_tokensel_cpu import worker as W
    from verl_tokensel_cpu.batches import make_update_batch
    from verl_tokensel.verl_glue.loss import SelectingLoss

    actor = W.make_training_worker(lr=0.0, ppo_micro_batch_size_per_gpu=2)
    runs = {}
    for preset in (NAME, "forking"):
        cfg = W.selecting_actor_config(actor, preset)
        batch = make_update_batch(actor, seed=5, calculate_entropy=preset == "forking")
        W.compute_old_log_probs(actor, batch)
        calls, remove = _count_output_layer_calls(actor)
        try:
            result = W.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg), capture_params=False)
        finally:
            remove()
        runs[preset] = (batch, len(calls), result.metrics)
    batch, user_calls, metrics = runs[NAME]
    width = int(batch["responses"].offsets().diff().max())
    mask = batch["response_mask"].to_padded_tensor(0)[:, :width].bool()
    got = batch[fields.HIDDEN].to_padded_tensor(0.0)[:, :width]
    torch.testing.assert_close(got[mask], _hidden_norms(actor, batch, width)[mask], rtol=1e-5, atol=1e-5)
    assert user_rule and all(h.shape[0] > 0 for h in user_rule), "the loss steps read x.hidden"
    assert f"tokensel/{NAME}/norm_mean" in metrics and metrics[f"tokensel/{NAME}/forwards"] == [1.0]
    fork_batch, fork_calls, fork_metrics = runs["forking"]
    micro = -(-batch.batch_size[0] // 2)  # the update's micro-batches of 2 responses: the pass runs the same count
    assert fork_calls == micro and user_calls == 2 * micro, (fork_calls, user_calls)
    assert fields.HIDDEN not in fork_batch.keys() and not any("forwards" in k for k in fork_metrics)
