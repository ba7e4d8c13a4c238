"""The chunked (streaming-softmax) token scorer against float64 full-softmax references (CPU, fast).

* ``streaming_token_stats`` vs a float64 ``log_softmax`` over the whole vocabulary: random logits
  (float32 matmul) and exact crafted logits (one-hot hidden states make ``hidden @ weight.T`` exact),
  peaked / near-one-hot / very large logits, temperature != 1, a bias, targets in the first and last
  chunk, chunk sizes 1, not dividing V, == V, > V, and 0 / 1 tokens.
* Closed forms: uniform over k tokens has H = ln k; a one-hot-ish row has H ~ 0, sum p^2 ~ 1, grad norm ~ 0
  (and its tiny values keep their relative precision).
* ``score_responses`` on the tiny Qwen2 equals a direct full forward of the HF model.
* Errors: token id >= vocab, empty prompt, chunk_size <= 0, temperature <= 0, soft-capped logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_tokensel.analysis.scorer import (
    DEFAULT_CHUNK,
    lm_head_of,
    naive_token_stats,
    score_responses,
    streaming_token_stats,
)
from verl_tokensel.core.ranking.scores import logit_grad_norm

V = 1000  # small vocabulary: every chunking case stays fast
D = 32


def ref64(hidden, weight, targets, bias=None, temperature=1.0):
    """float64 full softmax: (logp_a, entropy, sum_p2)."""
    return naive_token_stats(hidden, weight, targets, bias=bias, temperature=temperature, dtype=torch.float64)


def assert_stats(got, want, rtol=1e-5, atol=1e-9):
    names = ("logp", "entropy", "sum_p2")
    for name, g, w in zip(names, got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def exact_inputs(logits: torch.Tensor):
    """(hidden, weight) with ``hidden @ weight.T == logits`` exactly (one-hot hidden states)."""
    n = logits.shape[0]
    return torch.eye(n), logits.T.contiguous()


def crafted_logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    rows.append(torch.randn(4, V, generator=g) * 3)  # ordinary
    rows.append(torch.randn(4, V, generator=g) * 600)  # very peaked
    nh = torch.randn(4, V, generator=g)
    nh[torch.arange(4), torch.tensor([0, 1, V - 2, V - 1])] += torch.tensor([25.0, 40.0, 60.0, 90.0])  # near one-hot
    rows.append(nh)
    rows.append(torch.randn(4, V, generator=g) + 1.0e4)  # very large logits, modest spread
    rows.append(torch.randn(4, V, generator=g) * 0.01 - 3.0e4)  # very large negative, almost flat
    rows.append(torch.randn(4, V, generator=g) * 50 + 2000)  # large and peaked
    logits = torch.cat(rows)
    targets = torch.randint(0, V, (logits.shape[0],), generator=g)
    targets[8:12] = torch.tensor([0, 1, V - 2, V - 1])  # the near-certain tokens themselves
    targets[0], targets[1] = 0, V - 1  # first / last id (first / last chunk)
    targets[4] = logits[4].argmax()
    return logits, targets


@pytest.mark.parametrize("chunk_size", [1, 7, 256, V, V + 1, 4096, DEFAULT_CHUNK])
@pytest.mark.parametrize("temperature", [1.0, 0.3, 2.5])
def test_exact_logits_match_float64(chunk_size, temperature):
    logits, targets = crafted_logits()
    h, w = exact_inputs(logits)
    got = streaming_token_stats(h, w, targets, temperature=temperature, chunk_size=chunk_size)
    assert_stats(got, ref64(h, w, targets, temperature=temperature))


@pytest.mark.parametrize("chunk_size", [1, 7, 300, V, 5000])
@pytest.mark.parametrize("with_bias,temperature", [(False, 1.0), (True, 1.0), (True, 0.7), (False, 1.6)])
def test_random_logits_match_float64(chunk_size, with_bias, temperature):
    g = torch.Generator().manual_seed(chunk_size)
    n = 48
    h = torch.randn(n, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.8
    bias = torch.randn(V, generator=g) * 2 if with_bias else None
    t = torch.randint(0, V, (n,), generator=g)
    t[:3] = torch.tensor([0, V - 1, chunk_size % V])
    got = streaming_token_stats(h, w, t, bias=bias, temperature=temperature, chunk_size=chunk_size)
    # float32 matmul (~1e-7 relative on the logits) is the only difference from the reference
    assert_stats(got, ref64(h, w, t, bias=bias, temperature=temperature), rtol=2e-5, atol=1e-8)


def test_other_input_dtypes_and_shapes():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g).bfloat16()
    t = torch.randint(0, V, (5,), generator=g)
    got = streaming_token_stats(h, w, t, chunk_size=333)
    assert_stats(got, ref64(h.float(), w.float(), t), rtol=2e-5, atol=1e-8)


@pytest.mark.parametrize("n", [0, 1])
def test_zero_and_one_token(n):
    g = torch.Generator().manual_seed(n)
    h, w = torch.randn(n, D, generator=g), torch.randn(V, D, generator=g)
    t = torch.randint(0, V, (n,), generator=g)
    for chunk_size in (1, 300, 4096):
        got = streaming_token_stats(h, w, t, chunk_size=chunk_size)
        assert [x.shape for x in got] == [(n,)] * 3
        assert_stats(got, ref64(h, w, t), rtol=2e-5, atol=1e-8)


def test_naive_reference_agrees():
    logits, targets = crafted_logits(seed=1)
    logits = logits[:4]  # ordinary rows (naive float32 sums lose precision on extreme rows)
    h, w = exact_inputs(logits)
    assert_stats(naive_token_stats(h, w, targets[:4]), ref64(h, w, targets[:4]), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 7, 300, V])
@pytest.mark.parametrize("chunk_size", [1, 64, 999, 4096])
def test_uniform_over_k_tokens_has_entropy_ln_k(k, chunk_size):
    g = torch.Generator().manual_seed(k)
    rows = []
    for shift in (0.0, 5.0e3, -7.0):
        row = torch.full((V,), shift - 1.0e5)  # exp underflows to exactly 0, finite (no -inf * 0)
        support = torch.randperm(V, generator=g)[:k]
        row[support] = shift
        rows.append(row)
    logits = torch.stack(rows)
    targets = torch.stack([torch.nonzero(r == r.max())[0, 0] for r in logits])
    h, w = exact_inputs(logits)
    logp, ent, sp2 = streaming_token_stats(h, w, targets, chunk_size=chunk_size)
    assert torch.allclose(ent.double(), torch.full((3,), math.log(k), dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert torch.allclose(logp.double(), torch.full((3,), -math.log(k), dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert torch.allclose(sp2.double(), torch.full((3,), 1.0 / k, dtype=torch.float64), rtol=1e-6)
    # a token outside the support has p = exp(-1e5) / k
    if k < V:
        outside = torch.stack([torch.nonzero(r < r.max())[0, 0] for r in logits])
        lp_out = streaming_token_stats(h, w, outside, chunk_size=chunk_size)[0]
        assert torch.allclose(lp_out.double(), torch.full((3,), -1.0e5 - math.log(k), dtype=torch.float64), rtol=1e-6)


@pytest.mark.parametrize("gap", [12.0, 20.0, 30.0, 60.0])
@pytest.mark.parametrize("chunk_size", [1, 100, 4096])
def test_one_hot_ish_rows_keep_relative_precision(gap, chunk_size):
    """z_a = gap, the V - 1 others 0: closed forms, with eps = (V - 1) e^-gap down to ~1e-23."""
    logits = torch.zeros(3, V)
    a = torch.tensor([0, V // 2, V - 1])
    logits[torch.arange(3), a] = gap
    h, w = exact_inputs(logits)
    logp, ent, sp2 = streaming_token_stats(h, w, a, chunk_size=chunk_size)
    eps = (V - 1) * math.exp(-gap)
    s = 1.0 + eps
    want_h = math.log1p(eps) + gap * eps / s
    want_logp = -math.log1p(eps)
    want_sp2 = (1.0 + (V - 1) * math.exp(-2 * gap)) / s**2
    for x, want in ((ent, want_h), (logp, want_logp), (sp2, want_sp2)):
        assert torch.allclose(x.double(), torch.full((3,), want, dtype=torch.float64), rtol=1e-5, atol=0.0), (x, want)
    assert float(ent.max()) <= (gap + 1) * eps * (1 + 1e-6) and float(sp2.min()) >= 1 - 2 * eps  # H ~ 0, sum p^2 ~ 1
    gn = logit_grad_norm(logp, sp2)
    # ||e_a - p|| is in [1 - p_a, sqrt(2) (1 - p_a)] with 1 - p_a ~ eps
    assert float(gn.max()) <= math.sqrt(2) * eps * (1 + 1e-5) and float(gn.min()) >= eps / s * (1 - 1e-5)


# ---------------------------------------------------------------------------------------------
# score_responses on the tiny model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    path = build_tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny_qwen2_seed0")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    return model


def _pairs(vocab):
    g = torch.Generator().manual_seed(7)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [(ids(5), ids(9)), (ids(1), ids(17)), (ids(12), ids(1)), (ids(3), []), (ids(30), ids(40))]


@pytest.mark.parametrize("temperature,chunk_size", [(1.0, DEFAULT_CHUNK), (1.0, 100), (0.8, 37)])
def test_score_responses_equals_full_forward(tiny_model, temperature, chunk_size):
    vocab = tiny_model.get_output_embeddings().weight.shape[0]
    pairs = _pairs(vocab)
    done = []
    scores = score_responses(tiny_model, pairs, temperature=temperature, chunk_size=chunk_size, progress=done.append)
    assert done == list(range(1, len(pairs) + 1)) and len(scores) == len(pairs)
    for (prompt, response), sc in zip(pairs, scores):
        assert sc.token_ids.tolist() == list(response)
        n = len(response)
        assert [x.shape for x in (sc.logp, sc.entropy, sc.sum_p2, sc.grad_norm)] == [(n,)] * 4
        if n == 0:
            continue
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logits = tiny_model(input_ids=ids).logits[0].double() / temperature
        # response token t is predicted from the position before it
        z = logits[len(prompt) - 1 : len(prompt) + n - 1]
        logp_all = torch.log_softmax(z, -1)
        p = logp_all.exp()
        t = torch.tensor(response)
        want = (logp_all.gather(-1, t.view(-1, 1)).squeeze(-1), -(p * logp_all).sum(-1), p.square().sum(-1))
        assert_stats((sc.logp, sc.entropy, sc.sum_p2), want, rtol=2e-5, atol=1e-6)
        grad_norm = (torch.nn.functional.one_hot(t, vocab).double() - p).norm(dim=-1)
        torch.testing.assert_close(sc.grad_norm.double(), grad_norm, rtol=1e-4, atol=1e-6)


def test_score_responses_errors(tiny_model):
    vocab = tiny_model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match="tokenizer and model do not match"):
        score_responses(tiny_model, [([1, 2], [3, vocab])])
    with pytest.raises(ValueError, match="tokenizer and model do not match"):
        score_responses(tiny_model, [([vocab + 5], [3])])
    with pytest.raises(ValueError, match="empty prompt"):
        score_responses(tiny_model, [([], [3, 4])])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chunk_size must be > 0"):
            score_responses(tiny_model, [([1, 2], [3, 4])], chunk_size=bad)


def test_soft_capped_model_is_refused(tiny_model):
    cfg = tiny_model.config
    old = getattr(cfg, "final_logit_softcapping", None)
    cfg.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            lm_head_of(tiny_model)
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            score_responses(tiny_model, [([1, 2], [3, 4])])
    finally:
        cfg.final_logit_softcapping = old
    weight, bias = lm_head_of(tiny_model)
    assert weight is tiny_model.get_output_embeddings().weight


def test_streaming_argument_errors():
    h, w = torch.randn(3, D), torch.randn(V, D)
    t = torch.tensor([0, 1, 2])
    for bad in (0, -5):
        with pytest.raises(ValueError, match="chunk_size must be > 0"):
            streaming_token_stats(h, w, t, chunk_size=bad)
    for bad_t in (torch.tensor([0, 1, V]), torch.tensor([-1, 0, 1])):
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            streaming_token_stats(h, w, bad_t)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            streaming_token_stats(h, w, t, temperature=bad)


def test_no_autograd_graph_and_inputs_untouched():
    h = torch.randn(4, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    h0, w0 = h.detach().clone(), w.detach().clone()
    out = streaming_token_stats(h, w, torch.tensor([1, 2, 3, 4]), temperature=0.5, chunk_size=128)
    assert not any(x.requires_grad for x in out)
    assert torch.equal(h.detach(), h0) and torch.equal(w.detach(), w0)
