"""Per-token scores checked against autograd and against verl's own loss functions (CPU).

- ``logit_grad_norm`` vs the autograd norm of d log_softmax(z)[a] / dz (float64 reference), for
  fp32 and bf16 logits, including peaked distributions (1 - p_a down to ~1e-6);
- ``policy_gradient_weight`` (omega) vs autograd of verl's ``compute_policy_loss_vanilla``;
- ``kl_gradient_weight`` vs autograd of verl's ``kl_penalty``;
- ``seeded_uniform``: deterministic, counter-based, uniform.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.ppo.core_algos import get_policy_loss_fn, kl_penalty
from verl.workers.config import FSDPActorConfig

from verl_tokensel.core.ranking.scores import (
    LOG_RATIO_CLAMP,
    ScoreInputs,
    compute_score,
    kl_gradient_weight,
    logit_grad_norm,
    omega,
    policy_gradient_weight,
    seeded_uniform,
)

SQRT2 = math.sqrt(2.0)


# --------------------------------------------------------------------------------------------
# sum_pi_squared exactly as verl computes it
# --------------------------------------------------------------------------------------------
def _sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """sum_j p_j^2 computed in the logits' dtype, as verl does, then cast to float32."""
    try:
        from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits
    except ImportError:  # older verl
        return torch.softmax(logits, -1).pow(2).sum(-1).float()
    return calculate_sum_pi_squared_from_logits(logits).float()


def _logits(n: int, vocab: int, dtype: torch.dtype, peaked: bool, seed: int):
    """Random logits (n, vocab) in ``dtype`` and a target token per row.

    ``peaked``: z_a is set so that 1 - p_a = delta with delta log-spaced in [1e-6, 10^-0.5]
    (before rounding to ``dtype``; the reference is recomputed from the rounded logits).
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2.0
    a = torch.randint(0, vocab, (n,), generator=g)
    rows = torch.arange(n)
    if peaked:
        delta = torch.logspace(-6, -0.5, n, dtype=torch.float64)
        others = z.clone()
        others[rows, a] = -math.inf
        # p_a = e^{z_a} / (e^{z_a} + sum_{j!=a} e^{z_j}) = 1 - delta
        z[rows, a] = torch.logsumexp(others, -1) + torch.log((1 - delta) / delta)
    return z.to(dtype), a


def _autograd_reference(z: torch.Tensor, a: torch.Tensor):
    """float64 log p_a and ||d log_softmax(z)[a] / dz|| per row, by autograd, from the same logits."""
    z64 = z.detach().double().requires_grad_(True)
    lp = torch.log_softmax(z64, -1)[torch.arange(z.shape[0]), a]
    lp.sum().backward()  # rows are independent: row i of the grad is d lp_i / d z_i
    return lp.detach(), z64.grad.norm(dim=-1)


CASES = [
    (dtype, vocab, peaked)
    for dtype in (torch.float32, torch.bfloat16)
    for vocab in (50, 1000)
    for peaked in (False, True)
]


@pytest.mark.parametrize("dtype,vocab,peaked", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_logit_grad_norm_matches_autograd(dtype, vocab, peaked):
    n = 400
    z, a = _logits(n, vocab, dtype, peaked, seed=vocab + int(peaked))
    lp64, ref = _autograd_reference(z, a)
    # the log-prob tensor the loss sees is float32; its (exact) value is the float64 one rounded
    lp = lp64.float()
    S = _sum_pi_squared(z)
    out = logit_grad_norm(lp, S)
    assert out.dtype == torch.float32 and out.shape == (n,)
    out64 = out.double()

    # 1) always inside the exact range of ||e_a - p||, for the p_a the input log-prob encodes
    one_minus_pa = -torch.expm1(lp.double())
    assert (out64 >= one_minus_pa * (1 - 1e-6)).all()  # 1e-6: the float32 output rounding
    assert (out64 <= SQRT2 * one_minus_pa * (1 + 1e-6)).all()

    # 2) close to autograd. ||e_a-p||^2 = (1-p_a)^2 + (S - p_a^2); the only error sources are the
    # error of S (computed in the logits' dtype) and of p_a^2 (log-prob rounded to float32), and
    # the clamp of the second term into [0, (1-p_a)^2] never increases that error, so
    #   rel.err <= min(sqrt2 - 1, (|dS| + |d p_a^2|) / (2 (1-p_a)^2)) + float32 output rounding.
    rel = (out64 - ref).abs() / ref
    S_true = torch.softmax(z.double(), -1).pow(2).sum(-1)
    d_pa2 = (torch.exp(2 * lp.double()) - torch.exp(2 * lp64)).abs()
    err_budget = ((S.double() - S_true).abs() + d_pa2) / (2 * one_minus_pa.square())
    assert (rel <= torch.clamp(err_budget, max=SQRT2 - 1) * 1.01 + 1e-6).all(), (
        f"max excess {(rel - err_budget.clamp(max=SQRT2 - 1)).max().item()}"
    )

    if not peaked:
        # 3) tight tolerances for ordinary distributions (measured max: fp32 1.4e-5, bf16 1.6e-2)
        assert one_minus_pa.min() > 0.1
        assert rel.max() <= (5e-5 if dtype == torch.float32 else 3e-2)
    else:
        # near p_a -> 1 the second term drowns in the rounding of S: the result is then anywhere
        # in the exact range, i.e. within sqrt(2)-1 of the truth, never beyond
        assert rel.max() <= SQRT2 - 1 + 1e-6
        assert one_minus_pa.min() < 2e-6  # the sweep really reaches 1 - p_a ~ 1e-6
        if dtype == torch.float32:
            # fp32 S is accurate to ~1e-7: tokens with 1 - p_a >= 0.1 stay within 1e-4
            # (budget 1e-7 / (2 * 0.1^2) = 5e-6; measured <= 2e-5)
            assert rel[one_minus_pa >= 0.1].max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_naive_formula_fails_the_bound_near_pa_one(dtype):
    """Contrast: sqrt(1 - 2 p_a + sum p^2) evaluated in float32 cancels catastrophically."""
    z, a = _logits(400, 1000, dtype, peaked=True, seed=7)
    lp64, _ = _autograd_reference(z, a)
    lp = lp64.float()
    S = _sum_pi_squared(z)
    one_minus_pa = -torch.expm1(lp.double())
    near_one = one_minus_pa < 1e-4
    assert near_one.sum() >= 100

    p = torch.exp(lp)
    naive = torch.sqrt(1 - 2 * p + S).double()  # float32; NaN when the difference goes negative
    naive_ok = (naive >= one_minus_pa * (1 - 1e-3)) & (naive <= SQRT2 * one_minus_pa * (1 + 1e-3))
    # measured: ~95% of these tokens violate the bound (NaN or orders of magnitude too large)
    assert (~naive_ok[near_one]).float().mean() > 0.8
    # ... while the cancellation-safe form honours it on every one of them
    safe = logit_grad_norm(lp, S).double()
    assert ((safe >= one_minus_pa * (1 - 1e-6)) & (safe <= SQRT2 * one_minus_pa * (1 + 1e-6)))[near_one].all()


def test_logit_grad_norm_without_sum_pi_squared_is_lower_bound():
    lp = torch.tensor([-1e-6, -0.1, -1.0, -5.0, 0.0])
    out = logit_grad_norm(lp, None)
    # 1 - p_a = -expm1(lp): 1e-6 (to 5e-13), 0.0951626, 0.6321206, 0.9932621, 0
    expected = torch.tensor([9.999995e-07, 0.09516258, 0.63212056, 0.99326205, 0.0])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


def test_grad_norm_score_is_the_logit_gradient_norm_of_the_token_loss():
    """grad_norm = |omega| * ||e_a - p||: the norm of d(token PPO loss)/d logits, end to end (T=1)."""
    n, vocab = 64, 200
    z, a = _logits(n, vocab, torch.float32, peaked=False, seed=11)
    g = torch.Generator().manual_seed(3)
    z64 = z.double().requires_grad_(True)
    lp64 = torch.log_softmax(z64, -1)[torch.arange(n), a]
    old = (lp64.detach() + torch.randn(n, generator=g, dtype=torch.float64) * 0.3).float()
    adv = torch.randn(n, generator=g).float()
    cfg = _vanilla_config(0.2, 0.28, 3.0)
    loss_fn = get_policy_loss_fn("vanilla")
    mask = torch.ones(1, n, dtype=torch.bool)
    # verl's loss in float64 on the float64 log-probs (token-sum: per-token gradients)
    loss, _ = loss_fn(old_log_prob=old.double()[None], log_prob=lp64[None], advantages=adv.double()[None],
                      response_mask=mask, loss_agg_mode="token-sum", config=cfg)
    loss.backward()
    ref = z64.grad.norm(dim=-1)
    inp = ScoreInputs(log_prob=lp64.detach().float()[None], response_mask=mask, old_log_prob=old[None],
                      advantages=adv[None], sum_pi_squared=_sum_pi_squared(z)[None],
                      clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    score = compute_score("grad_norm", inp)[0].double()
    assert (ref == 0).any() and (ref > 0).any()  # clipped and unclipped tokens both present
    assert torch.equal(score == 0, ref == 0)
    torch.testing.assert_close(score, ref, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------
# omega vs verl's compute_policy_loss_vanilla
# --------------------------------------------------------------------------------------------
def _vanilla_config(low: float, high: float, c: float, loss_agg_mode: str = "token-sum") -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
        clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_agg_mode=loss_agg_mode,
    )


# log r values: far below the band, below it, inside, above it, above the dual clip c, and
# beyond verl's +-20 clamp. eps_low=0.2 -> band low 0.8; eps_high=0.28 -> 1.28; c=3.
_LOG_RATIOS = [
    -25.0, -21.0, -19.5, math.log(0.05), math.log(0.5), math.log(0.79),  # r < 1 - eps_low
    math.log(0.81), math.log(0.95), 0.0, math.log(1.1), math.log(1.27),  # inside the band
    math.log(1.29), math.log(2.0), math.log(2.9),  # 1 + eps_high < r < c
    math.log(3.1), math.log(10.0), 19.5, 21.0, 25.0,  # r > c (dual clip for A < 0), clamp
]
_ADVANTAGES = [1.7, 0.3, -0.4, -2.2, 0.0]


def _grid():
    lr = torch.tensor(_LOG_RATIOS, dtype=torch.float32)
    adv = torch.tensor(_ADVANTAGES, dtype=torch.float32)
    lr, adv = torch.meshgrid(lr, adv, indexing="ij")
    lr, adv = lr.reshape(1, -1), adv.reshape(1, -1)
    # keep log-probs <= 0: old = -1 - max(lr, 0), log_prob = old + lr
    old = -1.0 - lr.clamp(min=0)
    lp = old + lr
    return lp, old, adv


def _vanilla_token_grad(lp, old, adv, cfg, rollout_is_weights=None):
    """d loss / d log_prob per token from verl's vanilla loss (token-sum, dp_size 1)."""
    lp = lp.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=torch.ones_like(lp, dtype=torch.bool),
        loss_agg_mode="token-sum", config=cfg, rollout_is_weights=rollout_is_weights,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return grad


@pytest.mark.parametrize("low,high,c", [(0.2, 0.28, 3.0), (0.2, 0.2, 8.0), (0.1, 0.5, 1.5)])
def test_omega_matches_vanilla_loss_gradient(low, high, c):
    lp, old, adv = _grid()
    cfg = _vanilla_config(low, high, c)
    grad = _vanilla_token_grad(lp, old, adv, cfg)
    w = policy_gradient_weight(lp, old, adv, low, high, c)
    assert not w.requires_grad
    zero = grad == 0
    # the grid covers both regimes, and each kind of clipping
    assert zero.any() and (~zero).any()
    assert torch.equal(w == 0, zero), (
        f"omega zero at {(w == 0).nonzero().tolist()}, grad zero at {zero.nonzero().tolist()}"
    )
    # elsewhere omega = r * A = -dl/dlogp; same float32 ops -> equal up to an ulp
    torch.testing.assert_close(w[~zero], -grad[~zero], rtol=1e-6, atol=0)

    # spot checks of the regimes (eps_low=0.2, eps_high=0.28, c=3); c=8 avoids the tie r = 10 = c
    if (low, high, c) == (0.2, 0.28, 3.0):
        def at(log_r, a):
            i = _LOG_RATIOS.index(log_r) * len(_ADVANTAGES) + _ADVANTAGES.index(a)
            return float(w[0, i]), float(grad[0, i])

        assert at(math.log(2.0), 1.7) == (0.0, 0.0)  # A>0 above the band: clipped
        assert at(math.log(0.5), -0.4) == (0.0, 0.0)  # A<0 below the band: clipped
        assert at(math.log(10.0), -2.2) == (0.0, 0.0)  # A<0, r > c: dual clip
        assert at(25.0, 0.3) == (0.0, 0.0) and at(-25.0, 0.3) == (0.0, 0.0)  # |log r| > 20: clamp
        assert at(0.0, 0.0) == (0.0, 0.0)  # A = 0
        # unclipped: omega = r*A
        assert at(math.log(0.5), 1.7)[0] == pytest.approx(0.5 * 1.7, rel=1e-6)  # A>0 below the band
        assert at(math.log(2.0), -2.2)[0] == pytest.approx(2.0 * -2.2, rel=1e-6)  # A<0, band < r < c
        assert at(-19.5, 0.3)[0] == pytest.approx(math.exp(-19.5) * 0.3, rel=1e-5)  # tiny but nonzero
        assert at(-19.5, 0.3)[1] != 0


def test_omega_with_rollout_is_weights_is_the_score_inputs_convention():
    """verl multiplies the token loss by rollout_is_weights; omega of (A * w) is then -dl/dlogp."""
    lp, old, adv = _grid()
    cfg = _vanilla_config(0.2, 0.28, 3.0)
    w_is = torch.linspace(0.5, 2.0, lp.shape[-1]).reshape(1, -1)
    grad = _vanilla_token_grad(lp, old, adv, cfg, rollout_is_weights=w_is)
    w = policy_gradient_weight(lp, old, adv * w_is, 0.2, 0.28, 3.0)
    assert torch.equal(w == 0, grad == 0)
    torch.testing.assert_close(w, -grad, rtol=1e-6, atol=0)


_KL_TYPES = ["kl", "k1", "mse", "k2", "low_var_kl", "k3"]


@pytest.mark.parametrize("kl_type", _KL_TYPES)
def test_kl_gradient_weight_matches_verl_kl_penalty(kl_type):
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(1, 200, generator=g) * 3
    # ref - logp in [-2, 2]: low_var_kl = e^d - d - 1 <= e^2 - 3 = 4.39 < its clamp at 10
    ref = lp + (torch.rand(1, 200, generator=g) * 4 - 2)
    lp_leaf = lp.clone().requires_grad_(True)
    kld = kl_penalty(logprob=lp_leaf, ref_logprob=ref, kl_penalty=kl_type)
    (grad,) = torch.autograd.grad(kld.sum(), lp_leaf)
    w = kl_gradient_weight(lp, ref, kl_type)
    torch.testing.assert_close(w, -grad, rtol=1e-5, atol=1e-6)
    if kl_type in ("kl", "k1"):
        assert torch.equal(w, -torch.ones_like(w))  # d(logp - ref)/dlogp = 1


def test_kl_gradient_weight_rejects_unknown_type():
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_gradient_weight(torch.zeros(1, 2), torch.zeros(1, 2), "abs")


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_omega_total_matches_policy_plus_kl_loss_gradient(kl_type):
    """omega(inp) with a KL loss = -d/dlogp [vanilla token loss + kl_coef * kl_penalty]."""
    lp, old, adv = _grid()
    # keep ref - logp within [-2, 2] (away from the k3 clamp)
    ref = lp + torch.linspace(-2, 2, lp.shape[-1]).reshape(1, -1)
    coef = 0.3
    cfg = _vanilla_config(0.2, 0.28, 3.0)
    lp_leaf = lp.clone().requires_grad_(True)
    pg, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=lp_leaf, advantages=adv, response_mask=torch.ones_like(lp, dtype=torch.bool),
        loss_agg_mode="token-sum", config=cfg,
    )
    total = pg + coef * kl_penalty(logprob=lp_leaf, ref_logprob=ref, kl_penalty=kl_type).sum()
    (grad,) = torch.autograd.grad(total, lp_leaf)
    inp = ScoreInputs(log_prob=lp, response_mask=torch.ones_like(lp, dtype=torch.bool), old_log_prob=old,
                      advantages=adv, ref_log_prob=ref, clip_ratio_low=0.2, clip_ratio_high=0.28,
                      clip_ratio_c=3.0, kl_coef=coef, kl_type=kl_type)
    torch.testing.assert_close(omega(inp), -grad, rtol=1e-5, atol=1e-6)


def test_log_ratio_clamp_is_verls():
    # verl clamps log r to [-20, 20] in compute_policy_loss_vanilla; just outside it the gradient is 0
    assert LOG_RATIO_CLAMP == 20.0
    cfg = _vanilla_config(0.2, 0.28, 3.0)
    lp = torch.tensor([[-1.0, -1.0]])
    old = torch.tensor([[-21.5, 19.5]])  # log r = 20.5 and -20.5
    adv = torch.tensor([[1.0, 1.0]])
    assert torch.equal(_vanilla_token_grad(lp, old, adv, cfg), torch.zeros(1, 2))
    assert torch.equal(policy_gradient_weight(lp, old, adv, 0.2, 0.28, 3.0), torch.zeros(1, 2))


# --------------------------------------------------------------------------------------------
# seeded_uniform
# --------------------------------------------------------------------------------------------
def test_seeded_uniform_deterministic_and_keyed():
    keys = torch.tensor([3, -7, 2**40 + 5, 0, 123456789], dtype=torch.int64)
    u1 = seeded_uniform(keys, 33, seed=11)
    u2 = seeded_uniform(keys.clone(), 33, seed=11)
    assert u1.dtype == torch.float32 and u1.shape == (5, 33)
    assert torch.equal(u1, u2)

    # depends only on (seed, key, position): permuting rows permutes outputs ...
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(seeded_uniform(keys[perm], 33, seed=11), u1[perm])
    # ... a row alone draws what it draws inside a batch ...
    assert torch.equal(seeded_uniform(keys[2:3], 33, seed=11), u1[2:3])
    # ... and a longer draw extends a shorter one (position is the counter)
    assert torch.equal(seeded_uniform(keys, 50, seed=11)[:, :33], u1)

    # different seeds, keys and positions give different numbers
    u3 = seeded_uniform(keys, 33, seed=12)
    assert (u3 != u1).float().mean() > 0.99
    assert len(set(u1.flatten().tolist())) == u1.numel()


def test_seeded_uniform_range_and_uniformity():
    keys = torch.arange(1000, dtype=torch.int64) * 7919 + 1
    u = seeded_uniform(keys, 100, seed=0).double()  # 1e5 draws
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.02
    # 10 equal bins each hold 10% +- 0.6% (>6 sigma for a binomial with n=1e5, p=0.1)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert ((counts / u.numel() - 0.1).abs() < 0.006).all(), counts.tolist()
    # consecutive positions are uncorrelated
    corr = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(corr.item()) < 0.02


def test_random_score_uses_row_keys_and_seed():
    keys = torch.tensor([10, 20], dtype=torch.int64)
    inp = ScoreInputs(log_prob=torch.zeros(2, 6), response_mask=torch.ones(2, 6, dtype=torch.bool),
                      row_keys=keys, seed=4)
    assert torch.equal(compute_score("random", inp), seeded_uniform(keys, 6, 4))
    inp.row_keys = None
    with pytest.raises(ValueError, match="row_keys"):
        compute_score("random", inp)
