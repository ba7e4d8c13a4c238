"""Each preset against its reference's documented semantics, restated here (our own statement of each rule, not
the references' code), on the same inputs; and the ``token_selection.pool`` knob.

The rows of the tables of docs/fidelity.md, "Coming from another implementation" and "How each preset differs
from its reference":

- the 80/20 released code's mask (``entropy_top_ratio``): top ``int(N * r + 0.9999)`` entropies of each
  micro-batch's valid tokens = ``forking``;
- TRL's ``top_entropy_quantile=rho``: keep ``H >= quantile(H_valid, 1 - rho)`` over the micro-batch of all
  processes = ``forking`` with ``scope=micro_batch_dp``: the same tokens at rho = 0.2 for every pool size on
  distinct entropies; at other rho TRL can keep one token fewer; on ties TRL keeps every tied token;
- the released GMTS code: per prompt group, ``delta = H * |r A 1[not clipped]|`` over the tokens with a
  non-zero delta, top ``ceil(rho * n)`` = ``gmts`` with ``pool=nonzero``, except tokens in verl's dual-clip
  branch (A < 0, r > clip_ratio_c), which verl's loss gives no gradient and ``gmts`` therefore scores 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_tokensel.core.ranking.batch import score_batch
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.config import TokenSelectionConfig, TokenSelectionConfigError, resolve_selection
from verl_tokensel.core.ranking.select import select_tokens


def _rows(seed: int, batch: int = 8, length: int = 24):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, length + 1, (batch,), generator=g)
    valid = torch.arange(length).unsqueeze(0) < lens.unsqueeze(1)
    return g, valid


def _ours(preset: str, inputs: dict, uids=None, params=None, **knobs) -> torch.Tensor:
    """The preset's mask as the loss / pre-pass / driver computes it: the rule step on the score inputs."""
    sel = resolve_selection(preset, TokenSelectionConfig(**knobs))
    sb = score_batch(sel.score, inputs, uids=uids, scope=sel.scope, params=params)
    return apply_rule(sel, sb, stats=False).mask


# --------------------------------------------------------------------------------------------
# the pool knob
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["micro_batch", "sequence"])
def test_pool_nonzero_takes_its_budget_from_the_scored_tokens_only(scope):
    g, valid = _rows(0)
    scores = torch.rand(valid.shape, generator=g) + 0.01
    zero = (torch.rand(valid.shape, generator=g) < 0.4) & valid
    scores[zero] = 0.0
    for ratio in (0.2, 0.5, 0.9):
        nz = select_tokens(scores, valid, ratio, scope=scope, pool="nonzero")
        al = select_tokens(scores, valid, ratio, scope=scope, pool="valid")
        assert not (nz & zero).any(), "pool=nonzero selected a zero score"
        pools = [(valid & ~zero)] if scope == "micro_batch" else [(valid & ~zero)[i] for i in range(valid.shape[0])]
        sels = [nz] if scope == "micro_batch" else [nz[i] for i in range(valid.shape[0])]
        for pool, sel in zip(pools, sels):
            n = int(pool.sum())
            assert int(sel.sum()) == (max(1, math.ceil(ratio * n - 1e-9)) if n else 0)
        # pool=valid counts every valid token, so its budget is at least as large and holds the other's picks
        assert int(al.sum()) >= int(nz.sum()) and not (nz & ~al).any()
    with pytest.raises(ValueError, match=r"unknown pool 'scored'; valid: \['valid', 'nonzero'\]"):
        select_tokens(scores, valid, 0.2, pool="scored")


def test_pool_knob_is_validated_with_its_key_and_values():
    with pytest.raises(TokenSelectionConfigError,
                       match=r"actor_rollout_ref.actor.token_selection.pool='scored' is invalid; valid values: "
                             r"valid, nonzero"):
        resolve_selection("gmts", TokenSelectionConfig(pool="scored"))
    assert resolve_selection("gmts").knobs.pool == "valid"
    assert resolve_selection("gmts", TokenSelectionConfig(pool="nonzero")).knobs.pool == "nonzero"


# --------------------------------------------------------------------------------------------
# the 80/20 released code
# --------------------------------------------------------------------------------------------
def released_8020_mask(entropy: torch.Tensor, valid: torch.Tensor, ratio: float) -> torch.Tensor:
    """The 80/20 code's mask, restated: over one micro-batch's valid tokens, the top ``int(N * r + 0.9999)``."""
    flat = entropy[valid]
    k = int(flat.numel() * ratio + 0.9999)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[torch.topk(flat, k).indices] = True
    out = torch.zeros_like(valid)
    out[valid] = keep
    return out


@pytest.mark.parametrize("seed", range(5))
def test_forking_is_the_released_8020_mask(seed):
    g, valid = _rows(seed)
    entropy = torch.rand(valid.shape, generator=g) * 3  # distinct values (ties: ours by position, theirs arbitrary)
    lp = -torch.rand(valid.shape, generator=g)
    ours = _ours("forking", dict(response_mask=valid, log_probs=lp, entropy=entropy))
    assert torch.equal(ours, released_8020_mask(entropy, valid, 0.2))


# --------------------------------------------------------------------------------------------
# TRL top_entropy_quantile
# --------------------------------------------------------------------------------------------
def trl_high_entropy_mask(entropy: torch.Tensor, valid: torch.Tensor, rho: float) -> torch.Tensor:
    """TRL's ``top_entropy_quantile=rho``, restated: threshold = ``torch.quantile`` (linear) of the valid
    entropies at ``1 - rho``; keep every valid token at or above it."""
    threshold = torch.quantile(entropy[valid].double(), 1.0 - rho)
    return valid & (entropy.double() >= threshold)


@pytest.mark.parametrize("rho", [0.2, 0.3, 0.5])
def test_trl_top_entropy_quantile_is_forking_on_the_dp_micro_batch(rho):
    knobs = dict(ratio=rho, scope="micro_batch_dp", normaliser="all", mask_entropy_bonus=True)
    sel = resolve_selection("forking", TokenSelectionConfig(**knobs))
    assert (sel.score, sel.normaliser, sel.mask_entropy_bonus, sel.mask_kl_loss) == (
        "entropy", "all", True, False)
    fewer = 0
    for seed in range(12):
        g, valid = _rows(100 + seed, batch=6, length=20)
        entropy = torch.rand(valid.shape, generator=g) * 3
        lp = -torch.rand(valid.shape, generator=g)
        ours = _ours("forking", dict(response_mask=valid, log_probs=lp, entropy=entropy), **knobs)
        theirs = trl_high_entropy_mask(entropy, valid, rho)
        assert not (theirs & ~ours).any(), "both are top sets: TRL's must be inside ours"
        diff = int(ours.sum()) - int(theirs.sum())
        n = int(valid.sum())
        # TRL keeps floor(rho * N + 1 - rho) tokens, we keep ceil(rho * N): equal unless 0 < frac(rho N) < rho
        frac = rho * n - math.floor(rho * n + 1e-9)
        assert diff == (1 if 1e-9 < frac < rho - 1e-9 else 0), (n, rho, diff)
        fewer += diff
    if rho == 0.2:
        assert fewer == 0, "at rho = 0.2 the two agree for every pool size"
    # ties at the threshold: TRL keeps every tied token, we keep exactly ceil(rho N) (first by position)
    valid = torch.ones(1, 10, dtype=torch.bool)
    entropy = torch.tensor([[0.0] * 6 + [1.0] * 4])
    ours = _ours("forking", dict(response_mask=valid, log_probs=-entropy, entropy=entropy), **knobs)
    assert int(trl_high_entropy_mask(entropy, valid, rho).sum()) >= 4
    assert int(ours.sum()) == max(1, math.ceil(rho * 10 - 1e-9))


# --------------------------------------------------------------------------------------------
# the released GMTS code
# --------------------------------------------------------------------------------------------
def released_gmts_mask(entropy, log_prob, old_log_prob, adv, valid, uids, rho, eps_low=0.2, eps_high=0.28):
    """The GMTS code's selection, restated (as intended, without its loop bug): per prompt group,
    ``delta = H * |r * A * 1[not clipped]|`` with the standard PPO clip only (no dual clip), over the group's
    tokens with a non-zero delta, keep the top ``ceil(rho * n)``."""
    r = torch.exp(log_prob - old_log_prob)
    clipped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    delta = entropy * (r * adv * (~clipped)).abs()
    out = torch.zeros_like(valid)
    for uid in sorted(set(uids)):
        rows = torch.tensor([u == uid for u in uids])
        pool = valid & rows.unsqueeze(1) & (delta != 0)
        n = int(pool.sum())
        if n == 0:
            continue
        k = math.ceil(rho * n - 1e-9)
        idx = torch.topk(delta[pool], k).indices
        keep = torch.zeros(n, dtype=torch.bool)
        keep[idx] = True
        out[pool] = keep
    return out, delta


def _gmts_inputs(seed: int, noise: float, dual_clip: bool):
    g, valid = _rows(seed, batch=8, length=20)
    uids = [f"q{i // 4}" for i in range(valid.shape[0])]  # two prompts x four responses
    entropy = torch.rand(valid.shape, generator=g) * 2 + 0.05
    lp = -torch.rand(valid.shape, generator=g) * 2
    old = lp + torch.randn(valid.shape, generator=g) * noise
    adv = torch.randn(valid.shape[0], 1, generator=g).expand(valid.shape).contiguous()
    if not dual_clip:  # keep r <= clip_ratio_c (3.0) where A < 0
        old = torch.where((adv < 0) & (lp - old > math.log(2.9)), lp - math.log(2.9), old)
    inputs = dict(response_mask=valid, log_probs=lp, old_log_probs=old, advantages=adv, entropy=entropy)
    return inputs, uids


GMTS_PARAMS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


@pytest.mark.parametrize("seed", range(4))
def test_gmts_with_pool_nonzero_is_the_released_gmts_selection(seed):
    inputs, uids = _gmts_inputs(seed, noise=0.3, dual_clip=False)
    ours = _ours("gmts", inputs, uids=uids, params=GMTS_PARAMS, pool="nonzero")
    theirs, delta = released_gmts_mask(inputs["entropy"], inputs["log_probs"], inputs["old_log_probs"],
                                       inputs["advantages"], inputs["response_mask"], uids, 0.2)
    assert int((inputs["response_mask"] & (delta == 0)).sum()) > 0, "off-policy inputs must clip some tokens"
    assert torch.equal(ours, theirs)
    # the preset's pool=valid counts the clipped tokens too: a larger budget, a superset of the code's picks
    preset = _ours("gmts", inputs, uids=uids, params=GMTS_PARAMS)
    assert int(preset.sum()) > int(theirs.sum()) and not (theirs & ~preset).any()


def test_gmts_zeroes_the_dual_clip_branch_where_the_released_code_does_not():
    inputs, uids = _gmts_inputs(7, noise=1.5, dual_clip=True)
    lp, old, adv, valid = inputs["log_probs"], inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"]
    dual = valid & (adv < 0) & (torch.exp(lp - old) > 3.0)
    assert dual.any()
    sb = score_batch("gmts", inputs, uids=uids, scope="group", params=GMTS_PARAMS)
    assert torch.all(sb.score("gmts")[dual] == 0), "verl's loss gives these tokens no gradient: score 0"
    _, delta = released_gmts_mask(inputs["entropy"], lp, old, adv, valid, uids, 0.2)
    assert torch.all(delta[dual] > 0), "the released code scores them"
