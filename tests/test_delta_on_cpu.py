"""DelTA (``token_selector=delta``) restated: the released per-token weights (``compute_log_prob_h`` of
RUCBM/DelTA @cf048bd ``verl-DelTA/verl/workers/actor/dp_actor.py``: its K + 3 loops over the micro-batches, its clamps,
``advantages[:, 0]``, ``d = 1``, the final mean-1 scale) written out here, against:

- the rule's streaming passes (:class:`~verl_tokensel.core.rules.delta.DeltaStates`, one micro-batch at a time, O(H)
  sums) on batches where the weights differ from 1: both implementations, K = 0, 1, 3, any micro-batch split, to float32
  rounding;
- the preset's loss and gradient through the selecting loss (1e-6) against the release's loss (verl's dual-clip PPO on
  ``A * w``, clip 0.2 / 0.28, clip_ratio_c 10, token-mean);
- ``delta_stats=global`` on two gloo ranks against one process over the union (1e-6), and ``rank`` against each rank's
  own release weights; on the same two ranks as a Ulysses sequence-parallel group, each rank's slice of the packed
  output-layer input (verl's ``ulysses_pad_and_slice_inputs``) laid out again by the glue's gather (exact);
- the passes inside a real FSDP2 ``TrainingWorker`` update (``train_mini_batch``): with and without remove-padding,
  with dynamic batch sizes and with the hidden states kept between passes (``delta_cache_gib``: one forward), the
  weights the loss received equal the release's computed from the model's own last hidden states (read independently
  through ``output_hidden_states``), the forwards counted, the metrics reported.
"""

from __future__ import annotations

import pytest
import torch

from verl_tokensel.core import fields
from verl_tokensel.core.errors import TokenSelectionConfigError
from verl_tokensel.core.rules.delta import DeltaKnobs, DeltaStates
from verl_tokensel.core.seam.hidden import HiddenBatch
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

from helpers.actor_configs import actor_config, micro_batch, padded
from helpers.distributed import run_distributed

EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 10.0


# --------------------------------------------------------------------------------------------
# the release, written out (one rank; each micro-batch (h [b, S, H], log_probs [b, S], token_mask, advantages [b, S]))
# --------------------------------------------------------------------------------------------
def released_delta_weights(micro_batches, K=1, lam_min=0.8, lam_max=1.2, impl="Normal"):
    """The release's ``weights`` (the mean-1 scale applied), concatenated over the micro-batches: ``(B, S)``."""
    eps, lam_w, gamma_time = 1e-8, 1.0, 1

    def v_of(h, log_probs):
        return (1.0 - torch.exp(log_probs)).unsqueeze(-1) * h

    def dists(v, mu_pos, mu_neg, d):
        if impl == "Normal":
            return (((v - mu_pos.view(1, 1, -1)) ** 2) / d.view(1, 1, -1)).sum(-1), \
                (((v - mu_neg.view(1, 1, -1)) ** 2) / d.view(1, 1, -1)).sum(-1)
        v2 = ((v ** 2) / d.view(1, 1, -1)).sum(dim=-1)
        d_pos = (v2 - 2.0 * torch.matmul(v, mu_pos / d) + (mu_pos * (mu_pos / d)).sum()).clamp_min(0.0)
        d_neg = (v2 - 2.0 * torch.matmul(v, mu_neg / d) + (mu_neg * (mu_neg / d)).sum()).clamp_min(0.0)
        return d_pos, d_neg

    sum_v_pos = sum_v_neg = 0.0
    S_p = S_n = 0.0
    for h, lp, tm, advs in micro_batches:
        adv = advs[:, 0].float()
        v = v_of(h, lp)
        tm3 = tm.float().unsqueeze(-1)
        w_pos0 = torch.clamp(adv, min=0.0)[:, None, None] * tm3
        w_neg0 = torch.clamp(-adv, min=0.0)[:, None, None] * tm3
        sum_v_pos = sum_v_pos + (w_pos0 * v).sum(dim=(0, 1))
        sum_v_neg = sum_v_neg + (w_neg0 * v).sum(dim=(0, 1))
        S_p, S_n = S_p + w_pos0.sum(), S_n + w_neg0.sum()
    mu_pos = sum_v_pos / torch.clamp(torch.as_tensor(S_p), min=eps)
    mu_neg = sum_v_neg / torch.clamp(torch.as_tensor(S_n), min=eps)
    d = torch.ones_like(mu_pos)

    def margin_stats(mu_p, mu_n, gammas=None):
        sums = torch.zeros(6)
        num_pos, num_neg = torch.zeros_like(mu_pos), torch.zeros_like(mu_neg)
        den_pos = den_neg = torch.zeros(())
        for h, lp, tm, advs in micro_batches:
            adv = advs[:, 0].float()
            v = v_of(h, lp)
            d_pos, d_neg = dists(v, mu_p, mu_n, d)
            vp = (adv > 0).float().unsqueeze(1) * tm.float()
            vn = (adv < 0).float().unsqueeze(1) * tm.float()
            m_pos, m_neg = lam_w * d_neg - d_pos, lam_w * d_pos - d_neg
            sums += torch.stack([(m_pos * vp).sum(), (m_pos ** 2 * vp).sum(), vp.sum(),
                                 (m_neg * vn).sum(), (m_neg ** 2 * vn).sum(), vn.sum()])
            if gammas is not None:
                w_pos = torch.sigmoid(m_pos / gammas[0]) * torch.clamp(adv, min=0.0).unsqueeze(1) * vp
                w_neg = torch.sigmoid(m_neg / gammas[1]) * torch.clamp(-adv, min=0.0).unsqueeze(1) * vn
                num_pos = num_pos + (w_pos.unsqueeze(-1) * v).sum(dim=(0, 1))
                num_neg = num_neg + (w_neg.unsqueeze(-1) * v).sum(dim=(0, 1))
                den_pos, den_neg = den_pos + w_pos.sum(), den_neg + w_neg.sum()

        def gamma(s, ss, c):
            c = torch.clamp(c, min=1.0)
            return gamma_time * torch.sqrt(torch.clamp(ss / c - (s / c) ** 2, min=eps))

        g = (gamma(*sums[:3]), gamma(*sums[3:]))
        return g, (num_pos, num_neg, den_pos, den_neg)

    gammas, _ = margin_stats(mu_pos, mu_neg)
    mu_pos_star, mu_neg_star = mu_pos.clone(), mu_neg.clone()
    for _ in range(K):
        next_gammas, (num_pos, num_neg, den_pos, den_neg) = margin_stats(mu_pos_star, mu_neg_star, gammas)
        mu_pos_star = num_pos / torch.clamp(den_pos, min=eps)
        mu_neg_star = num_neg / torch.clamp(den_neg, min=eps)
        gammas = next_gammas
    weights, tk_sum, wht_sum = [], torch.zeros(()), torch.zeros(())
    for h, lp, tm, advs in micro_batches:
        adv = advs[:, 0].float()
        v = v_of(h, lp)
        d_pos, d_neg = dists(v, mu_pos_star, mu_neg_star, d)
        w_pos_final = lam_min + (lam_max - lam_min) * torch.sigmoid((lam_w * d_neg - d_pos) / gammas[0])
        w_neg_final = lam_min + (lam_max - lam_min) * torch.sigmoid((lam_w * d_pos - d_neg) / gammas[1])
        pos = (adv > 0).float().unsqueeze(1)
        neg = (adv < 0).float().unsqueeze(1)
        weight = (w_pos_final * pos + w_neg_final * neg + lam_min * (1.0 - pos - neg)) * tm.float()
        tk_sum, wht_sum = tk_sum + tm.float().sum(), wht_sum + weight.sum()
        weights.append(weight)
    return torch.cat(weights) * (tk_sum / wht_sum.clamp_min(1e-8))


# --------------------------------------------------------------------------------------------
# the rule's passes, driven the way the glue drives them
# --------------------------------------------------------------------------------------------
def stream_weights(micro_batches, knobs: DeltaKnobs, dp_group=None, row0=0):
    """:class:`DeltaStates` over the micro-batches, each handed as its valid tokens; ``(B, S)`` values after
    ``finish`` (1 off the valid tokens), B the rows of these micro-batches."""
    states = DeltaStates(knobs, dp_group=dp_group)
    rows = sum(mb[0].shape[0] for mb in micro_batches)
    width = micro_batches[0][0].shape[1]
    values, valid = torch.zeros(rows, width), torch.zeros(rows, width, dtype=torch.bool)
    batches, start = [], 0
    for h, lp, tm, adv in micro_batches:
        on = tm.bool()
        r, c = on.nonzero(as_tuple=True)
        batches.append(HiddenBatch(hidden=h[on], log_prob=lp[on].float(), advantages=adv[on].float(),
                                   rows=r + start, cols=c))
        valid[start:start + h.shape[0]] = on
        start += h.shape[0]
    for i in range(states.sweeps):
        for b in batches:
            out = states.sweep(i, b)
            if i == states.sweeps - 1:
                values[b.rows, b.cols] = out
        states.end_sweep(i)
    return states.finish(values, valid), valid, states


def synthetic(seed, rows=12, width=9, hidden=16, zero_rows=2):
    """Hidden states drawn around two directions by the sign of each response's advantage (so the centroids differ
    and the weights spread), some responses with A = 0, ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(rows, generator=g)
    adv[:zero_rows] = 0.0
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    direction = torch.randn(hidden, generator=g)
    h = torch.randn(rows, width, hidden, generator=g) + 0.8 * torch.sign(adv).view(-1, 1, 1) * direction
    log_probs = -torch.rand(rows, width, generator=g) * 3
    advs = adv.unsqueeze(1).expand(rows, width) * mask
    return h, log_probs, mask, advs.contiguous()


def split(batch, sizes):
    h, lp, tm, adv = batch
    out, start = [], 0
    for s in sizes:
        out.append((h[start:start + s], lp[start:start + s], tm[start:start + s], adv[start:start + s]))
        start += s
    return out


@pytest.mark.parametrize("impl", ["Normal", "Memory_efficient"])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("sizes", [(12,), (5, 4, 3), (1,) * 12])
def test_weights_are_the_released_ones(impl, k, sizes):
    for seed in range(3):
        batch = synthetic(seed)
        want = released_delta_weights(split(batch, sizes), K=k, impl=impl)
        knobs = DeltaKnobs(delta_k=k, delta_impl=impl, delta_stats="rank")
        got, valid, states = stream_weights(split(batch, sizes), knobs)
        torch.testing.assert_close(got[valid], want[valid], rtol=2e-5, atol=2e-6)
        w = got[valid]
        assert float(w.mean()) == pytest.approx(1.0, abs=1e-5)  # the mean-1 scale
        assert float(w.std()) > 0.02 and ((w - 1).abs() > 0.02).sum() >= 10, "the weights must not all be 1"
        assert states.sweeps == k + 3
        # A = 0 responses take lam_min times the scale; every weight lies in the scaled [lam_min, lam_max]
        zero = valid.clone()
        zero[2:] = False
        torch.testing.assert_close(got[zero], torch.full_like(got[zero], 0.8 * states.scale))
        assert float(w.min()) >= 0.8 * states.scale - 1e-6 and float(w.max()) <= 1.2 * states.scale + 1e-6


def test_the_implementations_agree_and_knobs_act():
    batch = synthetic(7)
    mbs = split(batch, (4, 8))
    base = dict(delta_stats="rank")
    normal, valid, _ = stream_weights(mbs, DeltaKnobs(**base))
    efficient, _, _ = stream_weights(mbs, DeltaKnobs(**base, delta_impl="Memory_efficient"))
    torch.testing.assert_close(normal[valid], efficient[valid], rtol=1e-5, atol=1e-6)
    wide, _, _ = stream_weights(mbs, DeltaKnobs(**base, delta_lam_min=0.5, delta_lam_max=1.5))
    assert float(wide[valid].std()) > 1.5 * float(normal[valid].std())
    flat, _, _ = stream_weights(mbs, DeltaKnobs(**base, delta_lam_min=1.0, delta_lam_max=1.0))
    torch.testing.assert_close(flat[valid], torch.ones_like(flat[valid]))


# --------------------------------------------------------------------------------------------
# the loss: the release's dual-clip PPO on A * w against the preset through the selecting loss
# --------------------------------------------------------------------------------------------
def released_loss(old_log_prob, log_prob, weighted_adv, mask):
    """verl's vanilla policy loss (``compute_policy_loss``, dual clip) on the weighted advantages, token-mean."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    pg1 = -weighted_adv * ratio
    pg2 = -weighted_adv * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -weighted_adv * CLIP_C
    pg = torch.where(weighted_adv < 0, torch.minimum(pg3, clip1), clip1)
    return (pg * mask).sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loss_is_the_released_loss(seed):
    cfg = actor_config("delta", clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=CLIP_C)
    mo, data, lp = micro_batch(seed, batch=8, resp_len=12, noise=0.5)
    mask = data["response_mask"].bool()
    adv = data["advantages"]
    g = torch.Generator().manual_seed(50 + seed)
    h = torch.randn(*mask.shape, 24, generator=g) + 0.7 * torch.sign(adv[:, :1]).unsqueeze(-1)
    weights = released_delta_weights([(h, data["old_log_probs"], mask, adv)])
    assert ((weights[mask] - 1).abs() > 0.02).sum() >= 5, "the weights must differ from 1"
    data[fields.HIDDEN] = weights
    loss, metrics = tokensel_ppo_loss(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    want = released_loss(data["old_log_probs"], padded(mo["log_probs"], data), adv * weights * mask, mask.float())
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    assert float(metrics["tokensel/delta/weight_mean"]) == pytest.approx(float(weights[mask].mean()), rel=1e-5)
    # and it is not verl's loss on the raw advantages
    raw = released_loss(data["old_log_probs"], padded(mo["log_probs"], data).detach(), adv, mask.float())
    assert abs(float(raw) - float(loss)) > 1e-4


def test_the_loss_refuses_a_batch_without_the_passes():
    cfg = actor_config("delta")
    mo, data, _ = micro_batch(0)
    with pytest.raises(RuntimeError, match="last hidden states before the update"):
        tokensel_ppo_loss(cfg, mo, data)


@pytest.mark.parametrize("bad, message", [
    ({"delta_lam_min": 1.3}, "token_selection.delta_lam_max=1.2 is invalid; valid values: a number >= "
                             "token_selection.delta_lam_min"),
    ({"delta_k": 1.5}, "token_selection.delta_k=1.5 is invalid; valid values: an integer >= 0"),
    ({"delta_k": -1}, "token_selection.delta_k=-1 is invalid"),
    ({"delta_impl": "fast"}, "token_selection.delta_impl"),
    ({"delta_stats": "node"}, "token_selection.delta_stats"),
])
def test_bad_knobs_name_the_key(bad, message):
    with pytest.raises(Exception) as err:  # Hydra's instantiation error wraps ours
        actor_config("delta", bad, fresh=True)
    assert message in str(err.value) and TokenSelectionConfigError.__name__ in str(err.value)


# --------------------------------------------------------------------------------------------
# global statistics: two gloo ranks equal one process over the union
# --------------------------------------------------------------------------------------------
def _rank_weights(rank: int, world_size: int):
    import torch.distributed as dist

    if not dist.is_initialized():  # the harness sets the rendezvous variables; verl's workers init the group
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    batch = synthetic(11, rows=16)
    mine = split(batch, (8, 8))[rank]
    out = {}
    for stats in ("global", "rank"):
        knobs = DeltaKnobs(delta_stats=stats)
        got, valid, states = stream_weights(split(mine, (3, 5)), knobs, dp_group=dist.group.WORLD)
        out[stats] = {"weights": got, "valid": valid, "metrics": states.metrics}
    out["ulysses"] = _ulysses_layout(rank, world_size)
    return out


def _ulysses_layout(rank: int, world_size: int):
    """The glue's layout of a Ulysses rank's slice of the output layer's input: verl pads the packed sequence to a
    multiple of the SP size and slices it (``ulysses_pad_and_slice_inputs``); ``packed_hidden`` must give back every
    token's state in the log-probs' order, on each rank."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group, ulysses_pad_and_slice_inputs
    from verl_tokensel.verl_glue.hidden import packed_hidden

    lengths = torch.tensor([5, 9, 3])  # 17 tokens: one of padding on the last SP rank
    nnz = int(lengths.sum())
    full = torch.randn(nnz, 6, generator=torch.Generator().manual_seed(3))
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    try:
        ids = torch.arange(nnz).unsqueeze(0)
        local_ids, _, pad = ulysses_pad_and_slice_inputs(ids, None, sp_size=world_size)
        width = local_ids.shape[1]
        padded_full = torch.cat([full, torch.zeros(pad, full.shape[1])])
        local = padded_full[rank * width:(rank + 1) * width].unsqueeze(0)
        assert torch.equal(local_ids[0], torch.cat([ids[0], torch.zeros(pad, dtype=ids.dtype)])[
            rank * width:(rank + 1) * width])  # our slice is verl's
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        micro = TensorDict({"input_ids": torch.nested.nested_tensor_from_jagged(ids[0], offsets)}, batch_size=[3])
        tu.assign_non_tensor(micro, use_remove_padding=True)
        got = packed_hidden(SimpleNamespace(ulysses_sequence_parallel_size=world_size), local, micro)
    finally:
        set_ulysses_sequence_parallel_group(None)
    return {"got": got, "want": full}


def test_global_statistics_over_two_ranks_equal_one_process():
    batch = synthetic(11, rows=16)
    one, valid, states = stream_weights(split(batch, (3, 5, 3, 5)), DeltaKnobs())
    results = run_distributed(_rank_weights, world_size=2, timeout=240)
    ranks = [r["global"] for r in results]
    both = torch.cat([r["weights"] for r in ranks])
    torch.testing.assert_close(both[valid], one[valid], rtol=1e-6, atol=1e-6)
    for r in ranks:
        assert r["metrics"]["scale"] == pytest.approx(states.metrics["scale"], rel=1e-9)
    # per rank (the release): each rank's weights are the release's over its own share, and differ from the global
    per_rank = [r["rank"] for r in results]
    for rank, r in enumerate(per_rank):
        mine = split(batch, (8, 8))[rank]
        want = released_delta_weights(split(mine, (3, 5)))
        torch.testing.assert_close(r["weights"][r["valid"]], want[r["valid"]], rtol=2e-5, atol=2e-6)
    rank_all = torch.cat([r["weights"] for r in per_rank])
    assert float((rank_all[valid] - one[valid]).abs().max()) > 1e-3
    # Ulysses sequence parallel: each rank holds a slice of the packed output-layer input; the glue gathers it
    for r in results:
        torch.testing.assert_close(r["ulysses"]["got"], r["ulysses"]["want"], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# the passes in a real FSDP2 update (verl's TrainingWorker on CPU)
# --------------------------------------------------------------------------------------------
def _independent_release_weights(actor, batch):
    """The release's weights from the tiny model's own last hidden states (``output_hidden_states``, one response at a
    time, no verl code) and the batch's old log-probs and advantages."""
    module = actor.module
    prompts, responses = batch["prompts"], batch["responses"]
    hs, width = [], int(responses.offsets().diff().max())
    with torch.no_grad():
        for i in range(prompts.shape[0]):
            p, r = prompts[i], responses[i]
            ids = torch.cat([p, r]).unsqueeze(0)
            out = module(input_ids=ids, output_hidden_states=True, use_cache=False)
            h = out.hidden_states[-1][0, p.numel() - 1: p.numel() + r.numel() - 1].float()
            hs.append(torch.nn.functional.pad(h, (0, 0, 0, width - h.shape[0])))
    h = torch.stack(hs)
    mask = batch["response_mask"].to_padded_tensor(0)[:, :width].bool()
    old = batch["old_log_probs"].to_padded_tensor(0.0)[:, :width].float()
    adv = batch["advantages"].to_padded_tensor(0.0)[:, :width].float()
    return released_delta_weights([(h, old, mask, adv)]), mask


@pytest.mark.parametrize("rmpad, dyn, cache_gib", [(True, True, 0.0), (False, False, 0.0), (True, False, 0.5)],
                         ids=["rmpad-dynbsz", "padded", "rmpad-cached"])
def test_the_passes_in_a_real_update_give_the_released_weights(rmpad, dyn, cache_gib):
    from verl_tokensel_cpu import worker as W
    from verl_tokensel_cpu.batches import make_update_batch
    from verl_tokensel.verl_glue.loss import SelectingLoss

    actor = W.make_training_worker(use_remove_padding=rmpad, use_dynamic_bsz=dyn, lr=0.0,
                                   ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=64)
    cfg = W.selecting_actor_config(actor, "delta", delta_cache_gib=cache_gib)
    batch = make_update_batch(actor, seed=3)
    W.compute_old_log_probs(actor, batch)
    want, mask = _independent_release_weights(actor, batch)
    seen = []
    result = W.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg, observer=seen.append), capture_params=False)
    got = batch[fields.HIDDEN].to_padded_tensor(0.0)[:, :mask.shape[1]]
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-5)
    assert ((got[mask] - 1).abs() > 1e-3).sum() >= 5, "the weights must differ from 1"
    assert seen and all(fields.HIDDEN in s["data"].keys() for s in seen), "every loss micro-batch carries the weights"
    m = {k: v[-1] if isinstance(v, list) else v for k, v in result.metrics.items()}
    assert m["tokensel/delta/forwards"] == (1.0 if cache_gib else 4.0)  # K + 3, or one with the hidden states kept
    assert m["tokensel/delta/tokens"] == float(mask.sum())
    assert m["tokensel/delta/weight_positive_mean"] != pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("config_name", ["tokensel_trainer", "tokensel_megatron_trainer"])
def test_the_preset_composes_and_the_driver_refuses_fused_kernels(config_name):
    """``token_selector=delta`` composes for FSDP and Megatron with the release's knobs; fused kernels (which never
    call lm_head) are refused on the driver, before Ray, naming the key."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass
    from verl_tokensel.verl_glue.install import validate_driver_config

    overrides = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.actor.token_selector=delta"]
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose(config_name, overrides=overrides)
        fused = compose(config_name, overrides=[*overrides, "actor_rollout_ref.model.use_fused_kernels=true"])
    sel = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).selection
    assert (sel.rule, sel.knobs.delta_k, sel.knobs.delta_lam_min, sel.knobs.delta_lam_max, sel.knobs.delta_impl,
            sel.knobs.delta_stats, sel.normaliser) == ("delta", 1, 0.8, 1.2, "Normal", "global", "all")
    validate_driver_config(cfg)
    with pytest.raises(TokenSelectionConfigError, match=r"actor_rollout_ref\.model\.use_fused_kernels=True is invalid; "
                       r"valid values: False\. actor_rollout_ref\.actor\.token_selector=delta \(rule delta\)"):
        validate_driver_config(fused)
    assert OmegaConf.select(cfg, "model_engine") == ("megatron" if "megatron" in config_name else "dp")
