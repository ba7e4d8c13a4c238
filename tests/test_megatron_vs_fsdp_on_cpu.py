"""verl's Megatron engine vs its FSDP2 engine on the same weights (CPU test bed, fp32, one process).

Both engines load the same HF checkpoint (the tiny Qwen2 with two KV heads), get the same batch (16
responses of 4..24 tokens, the packed ``thd`` layout on both, micro-batches of 4), learning rate 0:

- the old-log-prob pass: per-token log-probs and entropy agree within ``TOL`` nats (measured on this
  machine: 4.8e-7 and 9.5e-7 over 241 tokens; fp32 sums in another order: Megatron's vocabulary-parallel log-softmax and
  its fused QKV / gate-up projections against HF's separate ones);
- the same selector gives the same mask: ``forking`` per response (update pass), ``forking_paper`` over
  the batch (the driver's, from each engine's old pass) and ``gmts`` (pre-pass, per prompt group). A token
  may differ only as a tie: its score within ``TIE`` of its pool's threshold in both engines (none on this
  model; the test reports the count);
- the selecting loss and the gradient of the LM head and the embedding agree (rtol 1e-4; measured at
  most 2.2e-8 absolute, on entries up to 0.09).
- ``delta``: its passes over the last hidden states (FSDP's ``lm_head`` input, Megatron's packed sequence-first
  ``output_layer`` input) give every response token the same weight (measured: 5.4e-7; weights 0.79..1.17).

So a recipe moves between ``model_engine=dp`` and ``megatron`` with the same selection.
"""

from __future__ import annotations


import pytest
import torch

from verl_tokensel_cpu import tiny_model
from helpers import distributed as D
from helpers.megatron_runs import SAME_PARAMS, assert_grads_agree

pytestmark = pytest.mark.requires("verl", "megatron", "mbridge")

TOL = 1e-5  # nats, per token
TIE = 1e-5  # score units: a mask difference within this of the pool's threshold is a tie
KW = dict(use_dynamic_bsz=False, use_remove_padding=True, ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=4,
          ppo_max_token_len_per_gpu=128, lr=0.0, clip_grad=1e9)
BATCH_KW = dict(n=16, seed=9, resp_len=(4, 24), group_size=4)
#: (name, preset, knobs): what each engine selects
CASES = [("forking_sequence", "forking", {"scope": "sequence"}), ("forking_paper", "forking_paper", {}),
         ("gmts", "gmts", {"scope": "sequence"}), ("delta", "delta", {})]
#: the cases whose rule reads the last hidden states: the per-token weights their passes wrote are compared too
HIDDEN_CASES = ("delta",)
WEIGHT_TOL = 1e-5  # DelTA's weights, per token (measured on this machine: 5.4e-7)


def _per_row(field, batch):
    from helpers.grad_probe import row_ids

    return dict(zip(row_ids(batch), [r.clone() for r in field.unbind(0)]))


def _engine_run(actor) -> dict:
    from verl_tokensel_cpu import batches as B, worker as H
    from verl_tokensel.core import fields
    from verl_tokensel.verl_glue.loss import SelectingLoss

    from helpers.grad_probe import row_ids

    batch = B.make_update_batch(actor, calculate_entropy=True, **BATCH_KW)
    olp, ent = H.compute_old_log_probs(actor, batch)
    out = {"old_log_probs": _per_row(olp, batch), "entropy": _per_row(ent, batch), "cases": {}}
    for name, preset, knobs in CASES:
        cfg = H.selecting_actor_config(actor, preset, **knobs)
        case_batch = batch.copy()
        if preset == "forking_paper":
            B.add_driver_selection(cfg, case_batch)
        masks, scores = {}, {}

        def observe(rec, masks=masks, scores=scores):
            for k, row in enumerate(row_ids(rec["data"])):
                n = int(rec["response_mask"][k].sum())
                masks[row] = rec["mask"][k, :n].clone()
                scores[row] = rec["scores"][k, :n].detach().clone()

        r = H.run_train_step(actor, case_batch, loss_fn=SelectingLoss(cfg, observer=observe), capture_grads=True,
                             capture_params=False)
        out["cases"][name] = dict(masks=masks, scores=scores, loss=r.loss, metrics=r.metrics,
                                  grads={k: v for k, v in r.grads.items() if k in SAME_PARAMS or k in
                                         SAME_PARAMS.values()})
        if name in HIDDEN_CASES:  # the passes' per-token values, written into the update's batch
            out["cases"][name]["weights"] = _per_row(case_batch[fields.HIDDEN], case_batch)
    return out


def _both_engines(rank, world, model_dir):
    from verl_tokensel_cpu import worker as H

    return {engine: _engine_run(H.make_training_worker(model_dir, engine=engine, **KW))
            for engine in ("megatron", "fsdp")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_mvf") / "qwen2",
                                                **tiny_model.MEGATRON_TINY_CONFIG)
    (out,) = D.run_distributed(_both_engines, world_size=1, args=(str(model_dir),), timeout=400)
    return out


@pytest.mark.parametrize("field", ["old_log_probs", "entropy"])
def test_old_pass_values_agree(runs, field):
    m, f = runs["megatron"][field], runs["fsdp"][field]
    assert m.keys() == f.keys() and len(m) == BATCH_KW["n"]
    worst = max(float((m[row] - f[row]).abs().max()) for row in m)
    print(f"{field}: max |megatron - fsdp| = {worst:.2e} over {sum(v.numel() for v in m.values())} tokens")
    assert worst <= TOL


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_same_selector_same_mask(runs, case):
    m, f = runs["megatron"]["cases"][case], runs["fsdp"]["cases"][case]
    assert m["masks"].keys() == f["masks"].keys() and len(m["masks"]) == BATCH_KW["n"]
    batch_pool = case == "forking_paper"  # one pool: the whole batch; else each response is its pool

    def threshold(run, rows):
        return min(float(run["scores"][r][run["masks"][r]].min()) for r in rows if run["masks"][r].any())

    all_rows = list(m["masks"])
    ties = 0
    for row in all_rows:
        differ = m["masks"][row] != f["masks"][row]
        if not differ.any():
            continue
        pool = all_rows if batch_pool else [row]
        for run in (m, f):
            near = (run["scores"][row][differ] - threshold(run, pool)).abs() <= TIE
            assert near.all(), f"{case}: masks differ on {row} away from the threshold (not a tie)"
        ties += int(differ.sum())
    n_tokens = sum(v.numel() for v in m["masks"].values())
    print(f"{case}: {ties} tie differences over {n_tokens} tokens; selected megatron "
          f"{sum(int(v.sum()) for v in m['masks'].values())}, fsdp {sum(int(v.sum()) for v in f['masks'].values())}")
    assert sum(int(v.sum()) for v in m["masks"].values()) == sum(int(v.sum()) for v in f["masks"].values())


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_loss_and_gradient_agree(runs, case):
    m, f = runs["megatron"]["cases"][case], runs["fsdp"]["cases"][case]
    assert m["loss"] == pytest.approx(f["loss"], rel=1e-5)
    assert_grads_agree(m["grads"], f["grads"], case)


@pytest.mark.parametrize("case", HIDDEN_CASES)
def test_hidden_state_passes_give_the_same_weights(runs, case):
    """The rule's passes over the last hidden states (the output layer's input: HF's ``lm_head``, Megatron's
    ``output_layer`` from its packed sequence-first layout) give every response token the same weight."""
    m, f = runs["megatron"]["cases"][case], runs["fsdp"]["cases"][case]
    assert m["weights"].keys() == f["weights"].keys() and len(m["weights"]) == BATCH_KW["n"]
    worst = max(float((m["weights"][row] - f["weights"][row]).abs().max()) for row in m["weights"])
    w = torch.cat(list(f["weights"].values()))
    print(f"{case}: max |megatron - fsdp| weight = {worst:.2e} over {w.numel()} tokens (weights {float(w.min()):.3f}"
          f"..{float(w.max()):.3f})")
    assert worst <= WEIGHT_TOL
    assert float(w.std()) > 1e-3, "the weights must not all be equal"
    for run in (m, f):
        metrics = {k: v[-1] if isinstance(v, list) else v for k, v in run["metrics"].items()}
        assert metrics[f"tokensel/{case}/forwards"] == 4.0 and metrics[f"tokensel/{case}/tokens"] == w.numel()
