"""Token selection through verl's REAL TrainingWorker (FSDP2 engine) on CPU.

For every preset and every engine mode (use_dynamic_bsz x use_remove_padding), one actor update
through ``TrainingWorker.train_mini_batch`` with the selecting loss installed by ``set_loss_fn``:

- the gradient that reaches the LM-head logits of every unselected response token is exactly zero,
  and that of every selected token is not (old log-probs come from the real log-prob pass, so no
  token is clipped and every selected token carries gradient);
- with ``scope=sequence`` the selected positions of each response are identical in all four
  engine modes: dynamic batching re-orders and re-groups rows, so a mask put on the wrong row
  would show up here (the released GMTS code misaligned exactly this);
- the ``tokensel/selected_fraction`` metric reaches the step's metrics.
"""

from __future__ import annotations


import pytest

import torch

from verl_tokensel_cpu import batches as B, tiny_model, worker as H

pytestmark = pytest.mark.requires("verl")

COMBOS = [(False, False), (False, True), (True, False), (True, True)]
COMBO_IDS = [f"dynbsz={d}-rmpad={r}" for d, r in COMBOS]
WORKER_KW = dict(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=40,
                 lr=0.0, clip_grad=1e9)
BATCH_KW = dict(n=8, seed=3, resp_len=(4, 12))
PRESETS = ["forking", "forking_bottom", "random", "gmts", "grad_norm"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_sel") / "qwen2")


_WORKERS: dict = {}


def _worker(model_dir, dyn, rmpad):
    key = (dyn, rmpad)
    if key not in _WORKERS:
        _WORKERS[key] = H.make_training_worker(model_dir, use_dynamic_bsz=dyn, use_remove_padding=rmpad,
                                               **WORKER_KW)
    return _WORKERS[key]


class _Recorder:
    """Captures, per micro-batch, the mask our loss chose and the logits' gradient (same order)."""

    def __init__(self, actor):
        self.masks = []  # (mask, response_mask, prompt_lens, resp_lens, responses)
        self.logit_grads = []
        self.rmpad = actor.use_remove_padding
        head = actor.module.lm_head

        def fwd_hook(module, inputs, output):
            if torch.is_grad_enabled() and output.requires_grad:
                slot = len(self.logit_grads)
                self.logit_grads.append(None)
                output.register_hook(lambda g, slot=slot: self.logit_grads.__setitem__(slot, g.detach().clone()))

        self.handle = head.register_forward_hook(fwd_hook)

    def observe(self, rec):
        data = rec["data"]
        prompts, responses = data["prompts"], data["responses"]
        self.masks.append(dict(
            mask=rec["mask"].clone(),
            response_mask=rec["response_mask"].clone(),
            prompt_lens=prompts.offsets().diff().tolist(),
            resp_lens=responses.offsets().diff().tolist(),
            responses=[tuple(r.tolist()) for r in responses.unbind(0)],
        ))

    def close(self):
        self.handle.remove()


def _run(actor, preset, extra=()):
    from verl_tokensel.verl_glue.loss import SelectingLoss

    # calculate_entropy on for every preset: the batch carries entropy either way
    cfg = H.selecting_actor_config(actor, preset, calculate_entropy=True, **dict(extra))
    batch = B.make_update_batch(actor, calculate_entropy=True, **BATCH_KW)
    H.compute_old_log_probs(actor, batch)  # on-policy: r = 1, nothing clipped
    rec = _Recorder(actor)
    try:
        loss_fn = SelectingLoss(cfg, observer=rec.observe)
        result = H.run_train_step(actor, batch, loss_fn=loss_fn, capture_grads=False, capture_params=False)
    finally:
        rec.close()
    return rec, result


def _token_grad_norms(rec):
    """Per micro-batch: (batch, max_resp) norms of the logits' gradient at each response token."""
    out = []
    assert len(rec.logit_grads) == len(rec.masks), (len(rec.logit_grads), len(rec.masks))
    for grad, m in zip(rec.logit_grads, rec.masks):
        assert grad is not None
        norms = torch.zeros_like(m["mask"], dtype=torch.float64)
        offset = 0
        for i, (pl, rl) in enumerate(zip(m["prompt_lens"], m["resp_lens"])):
            for j in range(rl):
                pos = pl + j - 1  # logits at position t predict token t + 1
                row = grad[0, offset + pos] if rec.rmpad else grad[i, pos]
                norms[i, j] = row.double().norm()
            offset += pl + rl
        out.append(norms)
    return out


@pytest.mark.parametrize("dyn,rmpad", COMBOS, ids=COMBO_IDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_reaches_exactly_the_selected_tokens(tiny_model_dir, preset, dyn, rmpad):
    actor = _worker(tiny_model_dir, dyn, rmpad)
    rec, result = _run(actor, preset)
    assert rec.masks, "the selecting loss was never called"
    n_sel = n_unsel = 0
    for norms, m in zip(_token_grad_norms(rec), rec.masks):
        valid, mask = m["response_mask"], m["mask"]
        assert not (mask & ~valid).any(), "a padding position was selected"
        unsel = valid & ~mask
        assert torch.all(norms[unsel] == 0), f"{preset}: gradient leaked to unselected tokens: {norms[unsel]}"
        assert torch.all(norms[mask] > 0), f"{preset}: a selected token got no gradient"
        n_sel += int(mask.sum())
        n_unsel += int(unsel.sum())
    assert n_sel > 0 and n_unsel > 0
    fraction = result.metrics.get("tokensel/selected_fraction")
    assert fraction is not None, sorted(result.metrics)
    values = fraction if isinstance(fraction, list) else [fraction]
    target = 0.8 if preset == "forking_bottom" else 0.2
    assert all(target - 1e-9 <= float(v) <= target + 0.5 for v in values), values  # ceil over small pools


def test_sequence_scope_mask_is_identical_in_every_engine_mode(tiny_model_dir):
    per_combo = []
    for dyn, rmpad in COMBOS:
        rec, _ = _run(_worker(tiny_model_dir, dyn, rmpad), "forking", {"scope": "sequence"})
        chosen = {}
        for m in rec.masks:
            for i, resp in enumerate(m["responses"]):
                chosen[resp] = tuple(m["mask"][i, : m["resp_lens"][i]].nonzero().flatten().tolist())
        per_combo.append(chosen)
    assert len(per_combo[0]) == BATCH_KW["n"]
    for other in per_combo[1:]:
        assert other == per_combo[0]


# --------------------------------------------------------------------------------------------
# normaliser=selected weights micro-batches as the released 80/20 code does: by their share of responses
# --------------------------------------------------------------------------------------------
SPLITS = [  # (use_dynamic_bsz, ppo_max_token_len_per_gpu): fixed pairs, then two token budgets (unequal rows)
    (False, 40), (True, 40), (True, 72),
]


@pytest.mark.parametrize("dyn,max_tokens", SPLITS, ids=[f"dynbsz={d}-maxtok={t}" for d, t in SPLITS])
def test_normaliser_selected_weights_micro_batches_by_their_share_of_responses(tiny_model_dir, dyn, max_tokens):
    """Through the real engine, the gradient reaching each selected token's log-prob is that of the released code's
    objective, computed here independently: sum over micro-batches of ``rows(mb) / rows(mini-batch)`` times the mean
    over the micro-batch's selected tokens of the vanilla surrogate (on-policy: d/d log p = -A). Dynamic batch size
    makes the micro-batches unequal in rows and tokens, where a token-share weighting would differ."""
    from verl_tokensel.verl_glue.loss import SelectingLoss

    key = ("split", dyn, max_tokens)
    if key not in _WORKERS:
        kw = {**WORKER_KW, "ppo_max_token_len_per_gpu": max_tokens}
        _WORKERS[key] = H.make_training_worker(tiny_model_dir, use_dynamic_bsz=dyn, use_remove_padding=True, **kw)
    actor = _WORKERS[key]
    cfg = H.selecting_actor_config(actor, "forking")
    assert cfg.selection.normaliser == "selected"
    seen = []

    def observe(rec):
        slot = {"mask": rec["mask"].clone(), "adv": rec["advantages"].detach().clone(),
                "valid": rec["response_mask"].clone(), "rows": int(rec["response_mask"].shape[0])}
        rec["log_prob"].register_hook(lambda g, slot=slot: slot.__setitem__("grad", g.detach().clone()))
        seen.append(slot)

    batch = B.make_update_batch(actor, calculate_entropy=True, n=8, seed=11, resp_len=(2, 16))
    H.compute_old_log_probs(actor, batch)  # on-policy: ratio 1, nothing clipped
    H.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg, observer=observe), capture_params=False)

    rows = [s["rows"] for s in seen]
    total_rows = sum(rows)
    assert total_rows == 8 and len(seen) >= 2
    if dyn:
        tokens = [int(s["valid"].sum()) for s in seen]
        shares_rows = [r / total_rows for r in rows]
        shares_tokens = [t / sum(tokens) for t in tokens]
        assert max(abs(a - b) for a, b in zip(shares_rows, shares_tokens)) > 0.02, (rows, tokens)
    for s in seen:
        mask, n_sel = s["mask"], int(s["mask"].sum())
        assert n_sel > 0 and "grad" in s
        expected = torch.where(mask, -s["adv"] * s["rows"] / (total_rows * n_sel), torch.zeros_like(s["adv"]))
        torch.testing.assert_close(s["grad"], expected.to(s["grad"].dtype), rtol=1e-5, atol=1e-9)
