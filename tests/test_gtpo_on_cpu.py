"""GTPO (``token_selector=gtpo``) restated: the released ``build_conflict_mask`` (winstonsmith1897/GTPO's
``gtpo_training.py``: position-id keys counted with ``bincount``, the leading run by ``cumprod``, the trailing run on
responses rotated to end-align) and its loss (the entropy filter and ``A - 0.1 H``, ``-(ratio * A * delta)``
token-mean per response, divided by its conflict count; the release sums these over the responses, here their mean,
the release's loss / N), written out here, against the preset: the driver (verl's v0 layout through ``select_v0``)
measures the new advantages, the selecting loss applies them (``loss_agg_mode=seq-mean-token-mean``: the release's
per-response weighting, 1 / N of its scale); loss and gradient 1e-6 at ratio 1 (the release's
single on-policy step), on groups with shared prefixes and suffixes, both advantage signs and a filtered response."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl_tokensel.core import fields
from verl_tokensel.verl_glue import v0 as glue_v0
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss
from verl_tokensel.verl_glue.rollout_source import DriverSelector

from helpers.actor_configs import actor_config, micro_batch, padded

PAD_ID = 0
W_RAW, ENT_THRESHOLD, ENT_SCALE = 2.0, 0.7, 0.1


def released_conflict_mask(ids, mask, pos_flags, neg_flags, vocab_size, w_raw=W_RAW):
    """build_conflict_mask of the release (its debug prints left out): (delta, total_conflict, n_conflict)."""
    G, L = ids.shape
    active_idx = (pos_flags | neg_flags).nonzero(as_tuple=True)[0]
    if active_idx.numel() == 0:
        return mask.float(), torch.zeros_like(mask, dtype=torch.float), torch.zeros(G, dtype=torch.long)
    ids_use, mask_use = ids[active_idx], mask[active_idx]
    pos_use, neg_use = pos_flags[active_idx], neg_flags[active_idx]
    G_act = active_idx.numel()
    step_idx = torch.arange(L).unsqueeze(0)
    keys = (step_idx * vocab_size + ids_use).view(-1)
    rpt_pos, rpt_neg = pos_use.repeat_interleave(L), neg_use.repeat_interleave(L)
    freq_pos = torch.bincount(keys[rpt_pos], minlength=vocab_size * L).clamp_max(1)
    freq_neg = torch.bincount(keys[rpt_neg], minlength=vocab_size * L).clamp_max(1)
    conflict_raw = (freq_pos.bool() & freq_neg.bool())[keys].view(G_act, L)
    valid_mask = ids_use != PAD_ID
    conflict_fwd = torch.cumprod(conflict_raw.to(torch.int), dim=1).bool() & valid_mask
    w_conf_fwd = torch.where(conflict_fwd, torch.tensor(w_raw), torch.ones(()))
    delta_fwd = torch.where(~conflict_fwd, 1.0, torch.where(pos_use.unsqueeze(1), w_conf_fwd, 0.0)) * mask_use
    seq_len = mask_use.sum(-1)
    pad_len = L - seq_len
    ids_rev = ids_use.flip(-1).gather(1, (step_idx + pad_len.unsqueeze(1)) % L)
    keys_rev = (torch.arange(L).flip(0).unsqueeze(0) * vocab_size + ids_rev).view(-1)
    freq_pos_r = torch.bincount(keys_rev[rpt_pos], minlength=vocab_size * L).clamp_max(1)
    freq_neg_r = torch.bincount(keys_rev[rpt_neg], minlength=vocab_size * L).clamp_max(1)
    conflict_raw_rev = (freq_pos_r.bool() & freq_neg_r.bool())[keys_rev].view(G_act, L)
    conflict_rev = torch.cumprod(conflict_raw_rev.to(torch.int), dim=1).bool() & (ids_rev != PAD_ID)
    w_conf_rev = torch.where(conflict_rev, torch.tensor(w_raw), torch.ones(()))
    delta_bw_rev = torch.where(~conflict_rev, 1.0, torch.where(pos_use.unsqueeze(1), w_conf_rev, 0.0))
    delta_bw_use = delta_bw_rev.gather(1, (step_idx - pad_len.unsqueeze(1)) % L).flip(-1) * mask_use
    delta_final = mask.float().clone()
    delta_final[active_idx] = delta_fwd * delta_bw_use
    # as released: the trailing run in its end-aligned frame ORed with the leading run
    n_conflict = torch.zeros(G, dtype=torch.long)
    n_conflict[active_idx] = ((conflict_fwd | conflict_rev) & mask_use.bool()).sum(-1).long().clamp_min(1)
    return delta_final, n_conflict


def released_loss(log_prob, ids, mask, adv, entropy_c, vocab_size):
    """The release's loss of one group: entropy shaping, delta, per-response token-mean / n_conflict, mean."""
    delta, n_conf = released_conflict_mask(ids, mask, adv > 0, adv < 0, vocab_size)
    low_ent = entropy_c <= ENT_THRESHOLD
    adv = torch.where(low_ent, adv - ENT_SCALE * entropy_c, torch.zeros_like(adv))
    losses = []
    for g in range(ids.shape[0]):
        mask_f = mask[g].float()
        ratio = torch.exp(log_prob[g] - log_prob[g].detach())
        loss_disp = (-(ratio * adv[g] * delta[g]) * mask_f).sum() / mask_f.sum().clamp(min=1.0)
        losses.append(loss_disp / n_conf[g].clamp(min=1))
    return torch.stack(losses).mean(), delta, n_conf


def _group_batch(seed, n=8, resp_len=14, vocab=9):
    """One prompt group: shared opening and closing tokens (the release's format tokens), random middles."""
    mo, data, lp = micro_batch(seed, batch=n, resp_len=resp_len, noise=0.0)
    mask = data["response_mask"].bool()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, mask.shape, generator=g)
    lengths = mask.sum(1)
    for i in range(n):
        ids[i, :2] = torch.tensor([3, 4])  # a shared opening
        k = int(lengths[i])
        ids[i, k - 2:k] = torch.tensor([5, 6])  # a shared closing
        if i % 3 == 0:
            ids[i, 2] = 7  # the run goes on for some
    ids = ids * mask  # padding: id 0
    adv_row = torch.randn(n, generator=g)
    adv_row[0], adv_row[1] = 1.0, -1.0  # both signs present
    adv_row[2] = 0.0  # and an inactive response
    data["advantages"] = adv_row.unsqueeze(1) * mask
    entropy = torch.rand(mask.shape, generator=g) * 1.0
    entropy[3] += 0.9  # one response over the threshold (filtered)
    return mo, data, lp, ids, entropy * mask, adv_row


def _driver(sel, data, ids, entropy, uid):
    from tensordict import TensorDict

    td = TensorDict({fields.RESPONSE_MASK: data["response_mask"], fields.OLD_LOG_PROBS: data["old_log_probs"],
                     fields.ADVANTAGES: data["advantages"], fields.RESPONSES: ids,
                     glue_v0.V0_ENTROPY_FIELD: entropy}, batch_size=[ids.shape[0]])
    proto = SimpleNamespace(batch=td, non_tensor_batch={fields.UID: np.array(uid, dtype=object)})
    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"token_selector": "gtpo"}, "model": {"path": "unused"},
                                                  "rollout": {"temperature": 1.0}}})
    metrics = glue_v0.select_v0(DriverSelector(cfg, sel, trainer=SimpleNamespace(tokenizer=None)), proto)
    return td[fields.MASK], td[fields.SCORE], metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gtpo_is_the_released_loss(seed):
    cfg = actor_config("gtpo", loss_agg_mode="seq-mean-token-mean")
    mo, data, lp, ids, entropy, adv_row = _group_batch(seed)
    mask = data["response_mask"].bool()
    data["old_log_probs"] = padded(mo["log_probs"], data).detach() * mask  # ratio 1: the release's on-policy step
    sent_mask, scores, metrics = _driver(cfg.selection, data, ids, entropy, ["p"] * ids.shape[0])
    assert torch.equal(sent_mask, mask)
    entropy_c = (entropy * mask).sum(1) / mask.sum(1)
    lp_pad = padded(mo["log_probs"], data)
    want, delta, n_conf = released_loss(lp_pad, ids, mask.long(), adv_row, entropy_c, vocab_size=10)
    assert (delta == W_RAW).any() and (delta == 0.0).any() and (n_conf > 1).any(), "conflicts must act"
    assert bool((entropy_c > ENT_THRESHOLD).any()), "a response must be filtered"
    (want_grad,) = torch.autograd.grad(want, lp)
    data[fields.MASK], data[fields.SCORE] = sent_mask, scores
    loss, out = tokensel_ppo_loss(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    assert 0 < metrics["tokensel/driver_gtpo/conflict_share"] < 1
    assert metrics["tokensel/driver_gtpo/filtered_response_share"] == pytest.approx(
        float((entropy_c > ENT_THRESHOLD).float().mean()))


def test_gtpo_groups_are_separate():
    """Two groups side by side: each row's advantage is the one its group alone gives (no conflict across groups)."""
    cfg = actor_config("gtpo")
    parts = [_group_batch(s) for s in (0, 1)]
    _, scores_a, _ = _driver(cfg.selection, parts[0][1], parts[0][3], parts[0][4], ["a"] * 8)
    _, scores_b, _ = _driver(cfg.selection, parts[1][1], parts[1][3], parts[1][4], ["b"] * 8)
    mo, data, _ = micro_batch(0, batch=16, resp_len=14, noise=0.0)
    width = max(parts[0][1]["response_mask"].shape[1], parts[1][1]["response_mask"].shape[1])

    def cat(key):
        return torch.cat([torch.nn.functional.pad(p[1][key], (0, width - p[1][key].shape[1])) for p in parts])

    both = {k: cat(k) for k in (fields.RESPONSE_MASK, fields.OLD_LOG_PROBS, fields.ADVANTAGES)}
    ids = torch.cat([torch.nn.functional.pad(p[3], (0, width - p[3].shape[1])) for p in parts])
    ent = torch.cat([torch.nn.functional.pad(p[4], (0, width - p[4].shape[1])) for p in parts])
    _, scores, _ = _driver(cfg.selection, both, ids, ent, ["a"] * 8 + ["b"] * 8)
    torch.testing.assert_close(scores[:8, :scores_a.shape[1]], scores_a)
    torch.testing.assert_close(scores[8:, :scores_b.shape[1]], scores_b)


def test_gtpo_refuses_bad_knobs():
    with pytest.raises(Exception, match=r"token_selection.gtpo_conflict_weight=-1.0 is invalid; valid values: a numb"):
        actor_config("gtpo", {"gtpo_conflict_weight": -1.0}, fresh=True)
    with pytest.raises(Exception, match=r"token_selection.gtpo_entropy_threshold=0.0 is invalid"):
        actor_config("gtpo", {"gtpo_entropy_threshold": 0.0}, fresh=True)
    with pytest.raises(Exception, match=r"token_selection.score_source='prepass' is invalid; valid values: rollout"):
        actor_config("gtpo", {"score_source": "prepass"}, fresh=True)
