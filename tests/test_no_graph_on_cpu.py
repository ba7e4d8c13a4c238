"""The update pass's entropy without an autograd graph (``token_selection.no_grad_scores``), through verl's real
FSDP2 TrainingWorker on CPU, with ``use_remove_padding`` on and off.

- the no-graph functions equal verl's ``entropy_from_logits`` (and its chunking twin) and
  ``calculate_sum_pi_squared_from_logits`` to float rounding, and return values without a graph;
- in a real update with ``entropy_coeff = 0`` the entropy the loss sees has no graph, equals the entropy of
  the same step with verl's graph (``no_grad_scores=false``) to float rounding, the parameter gradients are
  equal to float rounding (with ``use_remove_padding`` the log-prob reuses the entropy pass's logsumexp), and
  the tensors saved for the backward shrink by at least the softmax of every token (tokens x vocab);
- with an entropy bonus (``entropy_coeff != 0``) the graph stays and the gradient is exact: a ratio-1.0
  selector's gradient equals stock verl's ``ppo_loss`` with the same bonus.
"""

from __future__ import annotations


import pytest

import torch

from verl_tokensel_cpu import batches as B, tiny_model, worker as H
from verl_tokensel.verl_glue.loss import SelectingLoss
from verl_tokensel.verl_glue.no_graph import entropy_no_graph, sum_pi_squared_no_graph

pytestmark = pytest.mark.requires("verl")

WORKER_KW = dict(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=64,
                 lr=0.0, clip_grad=1e9)
BATCH_KW = dict(n=4, seed=5, resp_len=(4, 12))


def test_no_graph_functions_equal_verls():
    import verl.utils.torch_functional as verl_F

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 1001, generator=g) * 4).requires_grad_(True)
    ent = entropy_no_graph(logits)
    assert not ent.requires_grad and ent.dtype == logits.dtype and ent.shape == (37,)
    # float32 sums over the vocabulary: both are within ~1e-4 of the float64 value (the tolerance used below)
    torch.testing.assert_close(ent, verl_F.entropy_from_logits(logits).detach(), rtol=1e-4, atol=1e-4)
    truth = verl_F.entropy_from_logits(logits.detach().double())
    assert float((ent.double() - truth).abs().max()) < 1e-4
    chunked = entropy_no_graph(logits, chunk_size=5)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, verl_F.entropy_from_logits_with_chunking(logits, 5).detach(),
                               rtol=1e-4, atol=1e-4)
    three_d = logits.detach().view(1, 37, 1001)
    torch.testing.assert_close(entropy_no_graph(three_d), verl_F.entropy_from_logits(three_d), rtol=1e-4, atol=1e-4)
    sp2 = sum_pi_squared_no_graph(logits)
    assert not sp2.requires_grad
    torch.testing.assert_close(sp2, verl_F.calculate_sum_pi_squared_from_logits(logits).detach(),
                               rtol=1e-5, atol=1e-7)


def test_logprobs_from_lse_value_and_gradient_equal_log_softmax():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(23, 517, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 517, (23,), generator=g)
    w = torch.randn(23, generator=g)
    cache_lse = torch.logsumexp(x.detach(), -1)
    lp = __import__("verl_tokensel.verl_glue.no_graph", fromlist=["x"]).logprobs_from_lse(x, labels, cache_lse)
    (lp * w).sum().backward()
    got = x.grad.clone()
    x.grad = None
    ref = torch.log_softmax(x, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (ref * w).sum().backward()
    torch.testing.assert_close(lp.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-7)


def test_inplace_log_prob_backward_writes_the_gradient_into_the_logits():
    """As flash-attn's cross-entropy with ``inplace_backward=True`` (verl's stock log-prob without entropy): same
    gradient, no tokens x vocab buffer (the logits' own storage holds it afterwards)."""
    from verl_tokensel.verl_glue.no_graph import logprobs_from_lse

    g = torch.Generator().manual_seed(2)
    base = (torch.randn(29, 613, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, 613, (29,), generator=g)
    w = torch.randn(29, generator=g)
    logits = base * 1.0  # a non-leaf, as the engine's logits
    before = logits.detach().clone()
    lp = logprobs_from_lse(logits, labels, torch.logsumexp(before, -1), inplace=True)
    (lp * w).sum().backward()
    ref_x = before.clone().requires_grad_(True)
    ref = torch.log_softmax(ref_x, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (ref * w).sum().backward()
    torch.testing.assert_close(lp.detach(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base.grad, ref_x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logits.detach(), ref_x.grad, rtol=1e-5, atol=1e-7)  # overwritten in place


def test_the_chunk_bound_holds_at_a_real_vocabulary():
    from verl_tokensel.verl_glue.no_graph import CHUNK_ELEMENTS, _rows_per_chunk

    rows = _rows_per_chunk(151_936)
    assert rows * 151_936 <= CHUNK_ELEMENTS and rows >= 64


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_nograph") / "qwen2")


_WORKERS: dict = {}


def _worker(model_dir, rmpad: bool, entropy_coeff: float = 0.0):
    key = (rmpad, entropy_coeff)
    if key not in _WORKERS:
        _WORKERS[key] = H.make_training_worker(model_dir, use_remove_padding=rmpad, entropy_coeff=entropy_coeff,
                                               **WORKER_KW)
    return _WORKERS[key]


class _Spy(SelectingLoss):
    """The selecting loss, recording the entropy it is handed."""

    def __init__(self, config, seen):
        super().__init__(config)
        self.seen = seen

    def __call__(self, model_output, data, dp_group=None):
        ent = model_output.get("entropy")
        shared = _graph_has(model_output["log_probs"].values().grad_fn, "_LogProbFromLseBackward")
        self.seen.append(None if ent is None else (ent.requires_grad, ent.values().detach().clone(), shared))
        return super().__call__(model_output, data, dp_group)


def _graph_has(fn, name: str, depth: int = 8) -> bool:
    """Whether an autograd node called ``name`` is within ``depth`` steps of ``fn``."""
    frontier = [fn]
    for _ in range(depth):
        nxt = []
        for f in frontier:
            if f is None:
                continue
            if type(f).__name__ == name:
                return True
            nxt += [g for g, _ in getattr(f, "next_functions", ())]
        frontier = nxt
    return False


def _step(actor, loss_fn):
    """One real update; returns (parameter gradients, bytes of the tensors autograd saved)."""
    batch = B.make_update_batch(actor, calculate_entropy=True, **BATCH_KW)
    H.compute_old_log_probs(actor, batch)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = H.run_train_step(actor, batch, loss_fn=loss_fn, capture_grads=True, capture_params=False)
    return result.grads, saved[0], batch


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_no_graph_entropy_same_values_same_gradient_less_saved(tiny_model_dir, rmpad):
    actor = _worker(tiny_model_dir, rmpad)
    runs = {}
    for no_grad in (False, True):
        seen: list = []
        cfg = H.selecting_actor_config(actor, "forking", no_grad_scores=no_grad)
        grads, saved, _ = _step(actor, _Spy(cfg, seen))
        runs[no_grad] = (seen, grads, saved)
    (seen_g, grads_g, saved_g), (seen_n, grads_n, saved_n) = runs[False], runs[True]
    assert seen_g and len(seen_g) == len(seen_n)
    assert all(s[0] for s in seen_g), "with no_grad_scores=false verl's graph is kept"
    assert not any(s[0] for s in seen_n), "the entropy the loss sees still carries a graph"
    for (_, a, _), (_, b, _) in zip(seen_g, seen_n):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # with use_remove_padding the log-prob reuses the entropy pass's logsumexp (same value and gradient)
    assert all(s[2] for s in seen_n) == rmpad and not any(s[2] for s in seen_g)
    assert grads_g.keys() == grads_n.keys()
    for name in grads_g:
        torch.testing.assert_close(grads_n[name], grads_g[name], rtol=1e-5, atol=1e-8, msg=f"gradient of {name}")
    # verl's graph keeps at least the softmax of every token of every micro-batch (float32 tokens x vocab)
    vocab = actor.module.config.vocab_size
    tokens = sum(int(s[1].numel()) for s in seen_n)
    assert saved_g - saved_n >= tokens * vocab * 4, (saved_g, saved_n, tokens * vocab * 4)


def test_entropy_bonus_keeps_the_graph_and_its_exact_gradient(tiny_model_dir):
    actor = _worker(tiny_model_dir, True, entropy_coeff=0.01)
    seen: list = []
    # ratio 1.0 with normaliser=all is the full-token objective: the gradient must be stock verl's, bonus included
    cfg = H.selecting_actor_config(actor, "forking", ratio=1.0, normaliser="all")
    grads_sel, _, _ = _step(actor, _Spy(cfg, seen))
    assert seen and all(s[0] for s in seen), "entropy_coeff != 0: the entropy must keep its graph"
    grads_stock, _, _ = _step(actor, H.default_loss_fn(actor.actor_config))
    for name in grads_stock:
        torch.testing.assert_close(grads_sel[name], grads_stock[name], rtol=1e-6, atol=1e-9)


def test_no_grad_scores_must_be_a_bool():
    from verl_tokensel.core.config import TokenSelectionConfig, TokenSelectionConfigError, resolve_selection

    with pytest.raises(TokenSelectionConfigError, match=r"token_selection.no_grad_scores='yes' is invalid; valid "
                                                        r"values: true, false"):
        resolve_selection("forking", TokenSelectionConfig(no_grad_scores="yes"))
