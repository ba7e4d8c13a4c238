"""Hostile data through the REAL selecting loss and verl's REAL FSDP2 engine (``TrainingWorker``, CPU).

Every case: the loss and every parameter gradient are finite, nothing hangs, the selection is the documented
one, and ``tokensel/nan_scores`` counts the tokens that were dropped. The cases (docs/reliability.md):

- a masked vocabulary (``-inf`` logits on part of the vocabulary, as a logits processor or a padded vocabulary
  writes them): verl's own entropy is NaN there (``0 x -inf``, asserted below, so the claim stays true); the
  entropy every selector ranks by is the masked distribution's, finite, in the update and in the forward-only
  passes (old log-probs, pre-pass);
- non-finite inputs (NaN / inf old log-probs, advantages and old-pass entropy on a few tokens): those tokens are
  dropped (never selected, no gradient, no loss term) and counted; the others are selected as usual;
- all advantages zero (a batch of identical rewards): ``gmts`` scores are all 0 and ties go by position;
  zero gradient, finite loss;
- responses of length 1 and at the full length (truncated, no EOS) next to ordinary ones;
- a ratio so small that every pool keeps exactly one token, per scope;
- groups of one response (``scope=group``): each keeps ``ceil(ratio * n)`` of its own tokens;
- a data-parallel rank whose micro-batch has no valid token while the other rank has many (two gloo ranks,
  ``micro_batch_dp`` and ``group``): no hang, the budget over the union;
- a property sweep at the loss level over random shapes, ratios, presets and injected NaN/inf.

Responses of length 0 are not a case: verl's drivers never produce one (vLLM returns at least the EOS token),
and verl's own padding helpers reject a zero-length response before any loss is called.
"""

from __future__ import annotations

import math
import random

import pytest

import torch

from verl_tokensel.core.ranking.scopes import budget
from verl_tokensel_cpu import batches as B, tiny_model, worker as H
from verl_tokensel.verl_glue.loss import SelectingLoss, tokensel_ppo_loss
from verl_tokensel.verl_glue.no_graph import entropy_no_graph

from helpers.actor_configs import actor_config, micro_batch, padded
from helpers.grad_probe import capture_logit_grads, prompt_lengths, response_lengths, token_grad_norms

pytestmark = pytest.mark.requires("verl")

WORKER_KW = dict(use_remove_padding=True, use_dynamic_bsz=False, ppo_mini_batch_size=8,
                 ppo_micro_batch_size_per_gpu=4, lr=0.0, clip_grad=1e9)
N = 8
PRESETS = ["forking", "forking_bottom", "random", "grad_norm", "gmts", "forking_paper"]


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    model_dir = tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("hostile") / "qwen2")
    return H.make_training_worker(model_dir, **WORKER_KW)


class _Run:
    """One real update: per micro-batch masks (observer), logit gradients, parameter gradients, metrics."""

    def __init__(self):
        self.micro: list[dict] = []
        self.logit_grads: list = []
        self.result = None

    def observe(self, rec):
        data = rec["data"]
        self.micro.append(dict(mask=rec["mask"].clone(), response_mask=rec["response_mask"].clone(),
                               scores=rec["scores"].clone(), prompt_lens=prompt_lengths(data),
                               resp_lens=response_lengths(data)))

    def metric(self, key) -> list[float]:
        v = self.result.metrics[key]
        return [float(x) for x in (v if isinstance(v, list) else [v])]

    def check_finite(self):
        r = self.result
        assert math.isfinite(r.loss), r.metrics
        assert r.grads, "no gradient was captured"
        bad = [k for k, g in r.grads.items() if not torch.isfinite(g).all()]
        assert not bad, f"non-finite gradients in {bad}"
        for g in self.logit_grads:
            assert g is not None and torch.isfinite(g).all()
        for k, v in r.metrics.items():
            if k.startswith("tokensel/") or k.startswith("actor/"):
                vals = v if isinstance(v, list) else [v]
                assert all(math.isfinite(float(x)) for x in vals), (k, v)

    def check_gradient_only_on_mask(self, rmpad=True, nonzero=True):
        for norms, m in zip(token_grad_norms(self.logit_grads, self.micro, rmpad), self.micro):
            valid, mask = m["response_mask"], m["mask"]
            assert not (mask & ~valid).any()
            assert torch.all(norms[valid & ~mask] == 0), "gradient reached an unselected token"
            if nonzero:
                assert torch.all(norms[mask] > 0), "a selected token got no gradient"


def _update(actor, preset, *, batch=None, after_old_pass=None, batch_kw=None, **knobs) -> _Run:
    """``preset``'s update of ``batch`` (default: a fresh synthetic mini-batch), old log-probs from the real
    pass with the selecting loss installed (as in a run); ``after_old_pass(batch)`` edits the batch then."""
    cfg = H.selecting_actor_config(actor, preset, **knobs)
    run = _Run()
    loss_fn = SelectingLoss(cfg, observer=run.observe)
    actor.set_loss_fn(loss_fn)
    if batch is None:
        batch = B.make_update_batch(actor, n=N, seed=3, calculate_entropy=bool(cfg.calculate_entropy),
                                    **(batch_kw or {}))
    H.compute_old_log_probs(actor, batch)
    if after_old_pass is not None:
        after_old_pass(batch)
    if cfg.selection.score_source == "rollout":
        B.add_driver_selection(cfg, batch)
    with capture_logit_grads(actor) as grads:
        run.result = H.run_train_step(actor, batch, loss_fn=loss_fn, capture_grads=True, capture_params=False)
    run.logit_grads = grads
    return run


# ------------------------------------------------------------------------------------------------------------------
# a masked vocabulary: -inf logits
# ------------------------------------------------------------------------------------------------------------------
def _mask_vocab_hook(actor, batch):
    """A forward hook writing -inf on the top quarter of the vocabulary, except ids the batch uses."""
    vocab = actor.module.lm_head.out_features
    masked = torch.zeros(vocab, dtype=torch.bool)
    masked[vocab - vocab // 4:] = True
    masked[batch["input_ids"].values().unique()] = False

    def hook(module, inputs, output):
        return output.masked_fill(masked.to(output.device), float("-inf"))

    return actor.module.lm_head.register_forward_hook(hook), masked


def test_no_graph_entropy_of_a_masked_vocabulary_is_the_masked_distributions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 50, generator=g) * 3
    x[:, 30:] = float("-inf")
    x[3, 1:30] = float("-inf")  # one live entry: entropy 0
    ref = torch.special.entr(torch.softmax(x.double(), -1)).sum(-1)
    import verl.utils.torch_functional as verl_F

    assert torch.isnan(verl_F.entropy_from_logits(x)).all(), "verl's entropy is finite on -inf logits now"
    got = entropy_no_graph(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    finite = torch.randn(5, 50, generator=g)  # no -inf: verl's value
    torch.testing.assert_close(entropy_no_graph(finite), verl_F.entropy_from_logits(finite), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", PRESETS)
def test_masked_vocabulary(actor, preset):
    batch = B.make_update_batch(actor, n=N, seed=3, calculate_entropy=True)
    handle, masked = _mask_vocab_hook(actor, batch)
    try:
        run = _update(actor, preset, batch=batch)
        # the old pass's entropy (the driver's and the pre-pass's source) is finite too
        assert torch.isfinite(batch["entropy"].values()).all()
    finally:
        handle.remove()
    assert masked.sum() > 0
    run.check_finite()
    run.check_gradient_only_on_mask()
    assert run.metric("tokensel/nan_scores") == [0.0] * len(run.metric("tokensel/nan_scores"))
    for m in run.micro:
        assert m["mask"].any()


def test_stock_verl_entropy_is_nan_on_a_masked_vocabulary(actor):
    """What docs/reliability.md says of stock verl: its old-pass entropy on -inf logits is NaN (claim checked)."""
    actor.set_loss_fn(H.default_loss_fn(actor.actor_config))
    batch = B.make_update_batch(actor, n=N, seed=3, calculate_entropy=True)
    handle, _ = _mask_vocab_hook(actor, batch)
    try:
        _, ent = H.compute_old_log_probs(actor, batch, write=False)
    finally:
        handle.remove()
    assert torch.isnan(ent.values()).all()


# ------------------------------------------------------------------------------------------------------------------
# non-finite inputs
# ------------------------------------------------------------------------------------------------------------------
#: (row, response position, field, value) injected after the old-log-prob pass
POISON = [(0, 1, "old_log_probs", float("nan")), (2, 0, "advantages", float("inf")),
          (5, 2, "old_log_probs", float("-inf")), (6, 1, "entropy", float("nan"))]


def _poison(batch):
    for row, pos, field, value in POISON:  # in place: the nested fields keep their layout
        nested = batch[field]
        nested.values()[int(nested.offsets()[row]) + pos] = value


@pytest.mark.parametrize("preset", PRESETS)
def test_non_finite_inputs_are_dropped_and_counted(actor, preset):
    run = _update(actor, preset, after_old_pass=_poison, batch_kw=dict(resp_len=(4, 10)))
    run.check_finite()
    run.check_gradient_only_on_mask()
    uses_entropy_field = preset in ("forking_paper", "gmts")  # the old pass's entropy feeds their scores
    poisoned = {(r, p) for r, p, f, _ in POISON if f != "entropy" or uses_entropy_field}
    n_rows = [len(m["resp_lens"]) for m in run.micro]
    dropped, row0 = 0, 0
    for m, rows in zip(run.micro, n_rows):
        for r, p in poisoned:
            if row0 <= r < row0 + rows:
                assert not m["mask"][r - row0, p], f"{preset}: a token with a non-finite input was selected"
                dropped += 1
        row0 += rows
    # per micro-batch counts, averaged over micro-batches by verl's metric aggregation
    assert sum(run.metric("tokensel/nan_scores")) * (1 if len(run.metric("tokensel/nan_scores")) > 1 else
                                                     len(run.micro)) == pytest.approx(dropped), run.result.metrics


# ------------------------------------------------------------------------------------------------------------------
# degenerate advantages, lengths, ratios and groups
# ------------------------------------------------------------------------------------------------------------------
def _zero_advantages(batch):
    batch["advantages"].values().zero_()


@pytest.mark.parametrize("preset", ["forking", "gmts", "grad_norm"])
def test_all_advantages_zero(actor, preset):
    run = _update(actor, preset, after_old_pass=_zero_advantages)
    run.check_finite()
    run.check_gradient_only_on_mask(nonzero=False)
    assert all(g.abs().max() == 0 for g in run.result.grads.values()), "a zero-advantage batch moved a weight"
    for m in run.micro:
        if preset in ("gmts", "grad_norm"):  # scores all 0 (|A| = 0): the earliest tokens win the ties
            assert torch.all(m["scores"][m["response_mask"]] == 0)
        assert m["mask"].any()


def test_lengths_one_and_full(actor):
    """Responses of 1 token and of the full width (truncated, no EOS) next to ordinary ones."""
    lens = [1, 12, 1, 5, 12, 1, 7, 12]
    run = _update(actor, "forking", batch_kw=dict(resp_len=lens))
    run.check_finite()
    run.check_gradient_only_on_mask()
    got = [n for m in run.micro for n in m["resp_lens"]]
    assert got == lens
    for m in run.micro:
        assert int(m["mask"].sum()) == budget(0.2, int(m["response_mask"].sum()))


TINY = [("forking", "micro_batch"), ("forking", "sequence"), ("gmts", "group"), ("gmts", "mini_batch"),
        ("forking_paper", "batch")]


@pytest.mark.parametrize("preset,scope", TINY, ids=[f"{p}-{s}" for p, s in TINY])
def test_tiny_ratio_keeps_one_token_per_pool(actor, preset, scope):
    run = _update(actor, preset, ratio=1e-9, scope=scope, batch_kw=dict(group_size=2))
    run.check_finite()
    run.check_gradient_only_on_mask(nonzero=preset == "forking")  # gmts/paper: their pick may be clipped (A != 0)
    selected = sum(int(m["mask"].sum()) for m in run.micro)
    if scope == "sequence":
        for m in run.micro:
            assert torch.all(m["mask"].sum(1) == (m["response_mask"].sum(1) > 0).long())
    elif scope == "micro_batch":
        assert all(int(m["mask"].sum()) == 1 for m in run.micro)
    elif scope == "group":  # 4 prompts of 2 responses: one token per prompt over its two rows
        assert selected == N // 2
    else:  # one pool: the mini-batch / the batch
        assert selected == 1


def test_groups_of_one(actor):
    run = _update(actor, "gmts", batch_kw=dict(group_size=1))  # scope=group: every response its own group
    run.check_finite()
    run.check_gradient_only_on_mask(nonzero=False)
    for m in run.micro:
        n = m["response_mask"].sum(1)
        assert m["mask"].sum(1).tolist() == [budget(0.2, int(k)) for k in n]


# ------------------------------------------------------------------------------------------------------------------
# a rank with no valid token (two gloo ranks, the real loss and its collectives)
# ------------------------------------------------------------------------------------------------------------------
def _empty_rank(rank, world_size):
    import torch.distributed as dist

    from verl_tokensel.core.ranking.select import select_tokens

    cfg = actor_config("forking", {"scope": "micro_batch_dp"})
    mo, data, lp = micro_batch(seed=rank, batch=4, resp_len=10, dp_size=world_size)
    if rank == 1:  # every response token masked out on this rank
        data["response_mask"].zero_()
    seen = []
    loss, metrics = tokensel_ppo_loss(cfg, mo, data, dist.group.WORLD, observer=lambda r: seen.append(r))
    (grad,) = torch.autograd.grad(loss, lp)
    rm = seen[0]["response_mask"]
    # the group scope's collective (what the pre-pass calls) with this rank's pool empty: prompts split over ranks
    groups = torch.tensor([0, 0, 1, 1]) + 2 * rank
    group_mask = select_tokens(seen[0]["scores"], rm, 0.2, scope="group", dp_group=dist.group.WORLD,
                               group_ids=groups)
    return dict(loss=float(loss.detach()), grad_finite=bool(torch.isfinite(grad).all()), n_valid=int(rm.sum()),
                n_sel=int(seen[0]["mask"].sum()), group_sel=group_mask.sum(1).tolist(),
                group_valid=rm.sum(1).tolist())


def test_a_rank_without_valid_tokens():
    from helpers import distributed as D

    out = D.run_distributed(_empty_rank, world_size=2, timeout=180)
    assert out[1]["n_valid"] == 0 and out[1]["n_sel"] == 0 and sum(out[1]["group_sel"]) == 0
    assert all(math.isfinite(o["loss"]) and o["grad_finite"] for o in out)
    assert out[0]["n_sel"] == budget(0.2, out[0]["n_valid"])  # the budget over the union
    v, g = out[0]["group_valid"], out[0]["group_sel"]
    assert g[0] + g[1] == budget(0.2, v[0] + v[1]) and g[2] + g[3] == budget(0.2, v[2] + v[3])


# ------------------------------------------------------------------------------------------------------------------
# property sweep at the loss level
# ------------------------------------------------------------------------------------------------------------------
SWEEP_PRESETS = ["forking", "forking_bottom", "random", "grad_norm"]


@pytest.mark.parametrize("draw", range(40))
def test_property_sweep(draw):
    rng = random.Random(draw)
    preset = rng.choice(SWEEP_PRESETS)
    scope = rng.choice(["micro_batch", "sequence"])
    ratio = rng.choice([1e-6, 0.05, 0.2, 0.5, 1.0, rng.random() or 0.3])
    cfg = actor_config(preset, {"scope": scope, "ratio": ratio, "normaliser": rng.choice(["all", "selected"])})
    batch = rng.randint(1, 6)
    mo, data, lp = micro_batch(seed=draw, batch=batch, resp_len=rng.randint(2, 12), with_sum_pi_squared=True)
    rm = data["response_mask"].bool()
    valid = rm.nonzero().tolist()
    poisoned = set()
    for _ in range(rng.randint(0, 3)):
        r, p = rng.choice(valid)
        field = rng.choice(["old_log_probs", "advantages"])
        data[field][r, p] = rng.choice([float("nan"), float("inf"), float("-inf")])
        poisoned.add((r, p))
    seen = []
    loss, metrics = tokensel_ppo_loss(cfg, mo, data, observer=lambda rec: seen.append(rec))
    (grad,) = torch.autograd.grad(loss, lp)
    assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
    mask = seen[0]["mask"]
    assert not (mask & ~rm).any()
    assert not any(bool(mask[r, p]) for r, p in poisoned)
    pool = rm.clone()
    for r, p in poisoned:
        pool[r, p] = False
    if scope == "micro_batch":
        n = int(pool.sum())
        assert int(mask.sum()) == budget(ratio, n)
    else:
        for i in range(batch):
            assert int(mask[i].sum()) == budget(ratio, int(pool[i].sum()))
    g = padded(grad, data)
    assert torch.all(g[rm & ~mask] == 0)
    nan_metric = float(metrics["tokensel/nan_scores"].aggregate()) if hasattr(
        metrics["tokensel/nan_scores"], "aggregate") else float(metrics["tokensel/nan_scores"])
    assert nan_metric == len(poisoned)


# ------------------------------------------------------------------------------------------------------------------
# determinism: the same config, seed and batch give the same masks on rerun
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_rerun_gives_the_same_masks(actor, preset):
    """Two updates of the same batch with the same settings (learning rate 0: the same weights) select the same
    tokens, ``random`` included (its draws are keyed by the seed, the row's tokens and the position)."""
    first = _update(actor, preset, batch_kw=dict(group_size=2))
    again = _update(actor, preset, batch_kw=dict(group_size=2))
    assert len(first.micro) == len(again.micro)
    for a, b in zip(first.micro, again.micro):
        assert torch.equal(a["mask"], b["mask"])
    other_seed = _update(actor, "random", seed=7, batch_kw=dict(group_size=2)) if preset == "random" else None
    if other_seed is not None:  # the seed is what fixes the draws
        assert any(not torch.equal(a["mask"], b["mask"]) for a, b in zip(first.micro, other_seed.micro))
