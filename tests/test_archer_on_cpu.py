"""Archer (``token_selector=archer``) against restatements of its released code, ArcherCodeR (commit 8a1785b,
``verl/workers/actor/dp_actor.py``), written out here from its formulas:

- per response, the tokens with entropy above its 0.8 ``nanquantile`` (high entropy) are clipped at 0.5 / 0.5, the
  others at the actor's 0.2 / 0.2, dual clip at ``clip_ratio_c``; the policy loss is the token-mean over the valid
  tokens (verl 0.9.1's global token-mean, which for one micro-batch holding the mini-batch is the released one);
- the KL term (``archer_kl_mean=class``, the default): per micro-batch, the token-mean of the k3 KL over each entropy
  class's own tokens (``agg_loss(kld, loss_mask=<class>, token-mean)``), the high-entropy class weighted 0, times the
  KL coefficient; the released gradient accumulation weights each micro-batch by its share of the mini-batch's
  responses (``loss / gradient_accumulation``, or ``* len(data) / ppo_mini_batch_size`` with dynamic batching);
- ``archer_kl_mean=all``, the earlier variant: one token-mean of the KL over every valid token, weight 0 on the high
  class (about 0.8x the released term at the 0.8 quantile).
"""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from verl_tokensel.core.config import TokenSelectionConfigError, resolve_selection
from verl_tokensel.core.rules.archer import class_mean_weights
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded

ACTOR = dict(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl", clip_ratio_c=10.0,
             calculate_entropy=True)


def _run(cfg, mo, data, lp):
    loss, metrics = tokensel_ppo_loss(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _metric(metrics, key):
    m = metrics[key]
    return float(m.aggregate()) if hasattr(m, "aggregate") else float(m)


def _classes(entropy, valid):
    """The released code's high-entropy tokens: above the response's 0.8 nanquantile (strict)."""
    h = entropy.masked_fill(~valid, float("nan"))
    return valid & (h > torch.nanquantile(h, 0.8, dim=-1, keepdim=True))


def _k3(x, ref):
    d = torch.clamp(ref - x, -20, 20)
    return torch.clamp(torch.exp(d) - d - 1, -10, 10)  # verl's low_var_kl


def _pg(x, old, adv, high, c=10.0):
    eps = torch.where(high, 0.5, 0.2).double()
    r = torch.exp(torch.clamp(x - old, -20, 20))
    l1 = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - eps, 1 + eps))
    return torch.where(adv < 0, torch.minimum(l1, -adv * c), l1)


def released_loss(x, old, adv, ref, valid, entropy, kl_coef):
    """The released micro-batch loss (one micro-batch holding the mini-batch): pg token-mean over the valid tokens,
    plus ``kl_coef`` times the token-mean of k3 over the low-entropy tokens only."""
    high = _classes(entropy, valid)
    low = valid & ~high
    pg = torch.where(valid, _pg(x, old, adv, high), 0).sum() / valid.sum()
    kl = torch.where(low, _k3(x, ref), 0).sum() / low.sum()
    return pg + kl_coef * kl, high


def earlier_loss(x, old, adv, ref, valid, entropy, kl_coef):
    """``archer_kl_mean=all``: the KL's token-mean over every valid token, 0 on the high-entropy ones."""
    high = _classes(entropy, valid)
    kl = torch.where(valid & ~high, _k3(x, ref), 0)
    pg = torch.where(valid, _pg(x, old, adv, high), 0)
    return (pg.sum() + kl_coef * kl.sum()) / valid.sum(), high


@pytest.mark.parametrize("kl_mean,restated", [("class", released_loss), ("all", earlier_loss)])
def test_archer_loss_and_gradient_match_the_restatement(kl_mean, restated):
    ours = actor_config("archer", {"archer_kl_mean": kl_mean}, **ACTOR)
    for seed in range(3):
        mo, data, lp = micro_batch(seed, batch=6, resp_len=20, noise=0.5, with_ref=True)
        loss, grad, metrics = _run(ours, mo, data, lp)
        valid = data["response_mask"].bool()
        x = padded(mo["log_probs"], data).detach().double().requires_grad_(True)
        ent = padded(mo["entropy"], data).detach()
        expect, high = restated(x, data["old_log_probs"].double(), data["advantages"].double(),
                                data["ref_log_prob"].double(), valid, ent, 0.001)
        (g,) = torch.autograd.grad(expect, x)
        torch.testing.assert_close(loss.double(), expect.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(padded(grad, data).double(), g, rtol=1e-5, atol=1e-8)
        assert _metric(metrics, "tokensel/selected_tokens") == int(high.sum())


@pytest.mark.parametrize("rows_total,tokens_total", [(6, None), (12, 300), (24, 41)])
def test_the_kl_term_is_each_classs_mean_weighted_by_the_micro_batchs_share(rows_total, tokens_total):
    """In a mini-batch of ``rows_total`` responses (over all ranks) and ``tokens_total`` valid tokens, one micro-batch
    of 6 adds ``6 / rows_total`` of its low-entropy tokens' mean KL: the mini-batch's token count does not enter (the
    released per-class token-mean), the micro-batch's share of the responses does (its gradient accumulation)."""
    ours = actor_config("archer", **ACTOR)
    mo, data, lp = micro_batch(4, batch=6, resp_len=20, noise=0.5, with_ref=True)
    n_valid = int(data["response_mask"].sum())
    tu.assign_non_tensor(data, global_batch_size=rows_total, batch_num_tokens=tokens_total or n_valid)
    _, _, metrics = _run(ours, mo, data, lp)
    valid = data["response_mask"].bool()
    x = padded(mo["log_probs"], data).detach().double()
    low = valid & ~_classes(padded(mo["entropy"], data).detach(), valid)
    expect = 6 / rows_total * float(torch.where(low, _k3(x, data["ref_log_prob"].double()), 0).sum() / low.sum())
    assert _metric(metrics, "kl_loss") == pytest.approx(expect, rel=1e-5)


def test_class_weights_make_a_token_mean_per_class():
    mask = torch.tensor([[1, 0, 0, 1], [0, 0, 1, 0]], dtype=torch.bool)
    tokens = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    w = class_mean_weights(mask, tokens, selected_weight=0.5, denominator=10.0, global_rows=4)
    # D * rows / G = 10 * 2 / 4 = 5: the 3 selected tokens get 0.5 * 5 / 3, the 4 others 5 / 4, padding 0
    want = torch.tensor([[2.5 / 3, 1.25, 1.25, 2.5 / 3], [1.25, 1.25, 2.5 / 3, 0.0]])
    torch.testing.assert_close(w, want)


def test_with_seq_mean_token_mean_the_kl_is_each_responses_class_mean_averaged():
    """The recipes' aggregation (the released script's micro-batches of one response): per response, the mean of
    the KL over its own low-entropy tokens, averaged over the mini-batch's responses."""
    ours = actor_config("archer", loss_agg_mode="seq-mean-token-mean", **ACTOR)
    mo, data, lp = micro_batch(3, batch=6, resp_len=20, noise=0.5, with_ref=True)
    _, _, metrics = _run(ours, mo, data, lp)
    valid = data["response_mask"].bool()
    x = padded(mo["log_probs"], data).detach().double()
    low = valid & ~_classes(padded(mo["entropy"], data).detach(), valid)
    kld = torch.where(low, _k3(x, data["ref_log_prob"].double()), 0)
    expect = float((kld.sum(-1) / low.sum(-1).clamp_min(1)).mean())
    assert _metric(metrics, "kl_loss") == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"])
def test_with_a_token_sum_aggregation_the_class_sums_are_the_earlier_weights(agg):
    """The token-sum modes: the released ``agg_loss(kld, loss_mask=<class>, agg)`` is a sum over the class's tokens
    over a denominator free of the class (the responses, the horizon), so the two classes add up to weight 0 on the
    high-entropy tokens and 1 on the others, under verl's own aggregation; ``class`` and ``all`` agree."""
    mo, data, lp = micro_batch(5, batch=6, resp_len=20, noise=0.5, with_ref=True)
    valid = data["response_mask"].bool()
    x = padded(mo["log_probs"], data).detach().double()
    low = valid & ~_classes(padded(mo["entropy"], data).detach(), valid)
    kld = torch.where(low, _k3(x, data["ref_log_prob"].double()), 0)
    per_row = kld.sum(-1)
    expect = {"token-sum": per_row.sum(), "seq-mean-token-sum": per_row.mean(),
              "seq-mean-token-sum-norm": per_row.mean() / valid.shape[-1]}[agg]  # verl 0.9.1's
    runs = {}
    for kl_mean in ("class", "all"):
        loss, grad, metrics = _run(actor_config("archer", {"archer_kl_mean": kl_mean}, loss_agg_mode=agg, **ACTOR),
                                   mo, data, lp)
        assert _metric(metrics, "kl_loss") == pytest.approx(float(expect), rel=1e-5)
        runs[kl_mean] = (loss, grad)
    torch.testing.assert_close(runs["class"][0], runs["all"][0], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(runs["class"][1], runs["all"][1], rtol=1e-6, atol=1e-10)


def test_archer_runs_with_every_aggregation():
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"):
        assert resolve_selection("archer", use_kl_loss=True, loss_agg_mode=agg).knobs.archer_kl_mean == "class"
    with pytest.raises(TokenSelectionConfigError, match=r"archer_kl_mean.*class, all"):
        from verl_tokensel.core.config import TokenSelectionConfig

        resolve_selection("archer", TokenSelectionConfig(archer_kl_mean="both"), use_kl_loss=True)
