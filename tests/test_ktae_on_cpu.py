"""KTAE (``token_selector=ktae``) restated: the released key-token statistic (``ComputeKeyTokens`` of xiaolizh1/KTAE's
``compute_key_tokens.py``, with its per-prompt dictionaries and its vocabulary-sized table), written out here, and the
released advantage (GRPO's normalised score plus the key-token score of each token), against the preset: the driver
(verl's v0 batch layout through ``select_v0``) measures the scores and the selecting loss adds them to verl's
advantages; loss and gradient 1e-6 against verl's stock loss run on the released advantages, on groups where
the bonus acts (mixed correct and wrong responses, shared and distinct tokens, EOS excluded)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core import fields
from verl_tokensel.core.resolve.presets import PRESETS
from verl_tokensel.verl_glue import v0 as glue_v0
from verl_tokensel.verl_glue.loss import tokensel_ppo_loss
from verl_tokensel.verl_glue.rollout_source import DriverSelector

from helpers.actor_configs import actor_config, micro_batch

EOS = 2
VOCAB = 13  # small: tokens repeat across responses


# ---------------------------------------------------------------- the released statistic, as the release writes it
def _cohen(a, b):
    a, b = torch.clamp(a, min=0, max=1), torch.clamp(b, min=0, max=1)
    return torch.asin(torch.sqrt(a)) - torch.asin(torch.sqrt(b))


def _fisher(t):
    a, b, c, d = torch.unbind(t, dim=1)
    r1, r2, c1 = a + b, c + d, a + c
    n = r1 + r2
    k_min = torch.max(torch.tensor(0, dtype=torch.float32), r1 + c1 - n)
    k_max = torch.min(r1, c1)
    k_grid = torch.tile(torch.arange(torch.max(k_max) + 1, dtype=torch.float32), (t.size(0), 1))
    mask = (k_grid >= k_min.unsqueeze(1)) & (k_grid <= k_max.unsqueeze(1))

    def log_comb(n, k):
        return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)

    c1g, r1g, ng = (x.unsqueeze(1).expand_as(k_grid) for x in (c1, r1, n))
    p_k = torch.exp(log_comb(c1g, k_grid) + log_comb(ng - c1g, r1g - k_grid) - log_comb(ng, r1g)) * mask.float()
    p_obs = torch.exp(log_comb(c1, a) + log_comb(n - c1, r1 - a) - log_comb(n, r1))
    return torch.sum(torch.where((p_k <= p_obs.unsqueeze(1)) & mask, p_k, 0.), dim=1)


def _ig(t):
    t_a, t_b, t_c, t_d = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    t_n = t_a + t_b + t_c + t_d

    def safe_log(x):
        return torch.where(x > 0, torch.log2(x), torch.tensor(0.0))

    def entropy(p):
        return -p * safe_log(p)

    h_y = entropy((t_a + t_c) / t_n) + entropy((t_b + t_d) / t_n)

    def cond(x1, x2):
        total = x1 + x2
        return torch.where(total > 0, entropy(x1 / total) + entropy(x2 / total), torch.tensor(0.0))

    ig = h_y - (((t_a + t_b) / t_n) * cond(t_a, t_b) + ((t_c + t_d) / t_n) * cond(t_c, t_d))
    ig[t_n == 0] = 0
    return ig


def _tf(correct, correct_mask, wrong, wrong_mask, size):
    k1, b = 2.0, 0.5
    cu, wu = correct[correct_mask == 1], wrong[wrong_mask == 1]
    total_c, total_w = cu.numel(), wu.numel()
    avg = (total_c + total_w) / 2
    kc, kw = k1 * (1 - b + b * (total_c / avg)), k1 * (1 - b + b * (total_w / avg))
    hc, hw = torch.bincount(cu, minlength=size).float(), torch.bincount(wu, minlength=size).float()
    return torch.stack([(hc / total_c) * (k1 + 1) / ((hc / total_c) + kc),
                        (hw / total_w) * (k1 + 1) / ((hw / total_w) + kw)], dim=1)


def released_key_tokens(ids, mask, rewards, max_token_num, alpha=1.0, beta=1.0, tf=True, top=1.0, eos=EOS):
    """ComputeKeyTokens(...).get_key_tokens() of one group, the excluded id a parameter."""
    key = torch.zeros(max_token_num + 1)
    correct, wrong = ids[rewards > 0.0], ids[rewards <= 0.0]
    cmask, wmask = mask[rewards > 0.0], mask[rewards <= 0.0]
    if correct.size(0) == 0 or wrong.size(0) == 0:
        return key

    def dist(t, m):
        out = {}
        for v in torch.unique(t[m == 1]).tolist():
            out[v] = len(torch.unique(torch.nonzero((t == v) & (m == 1))[:, 0]))
        return out

    cd, wd = dist(correct, cmask), dist(wrong, wmask)
    table = torch.zeros((max_token_num + 1, 4))
    for v in set(ids.flatten().tolist()):
        cc, wc = cd.get(v, 0), wd.get(v, 0)
        if cc + wc != 0:
            table[v] = torch.tensor([cc, wc, correct.size(0) - cc, wrong.size(0) - wc], dtype=torch.float32)
    ig = _ig(table) if beta else torch.zeros(max_token_num + 1)
    fisher = torch.where(_fisher(table) != 1.0, torch.exp(-2 * _fisher(table)), torch.tensor(0.0)) if alpha \
        else torch.zeros(max_token_num + 1)
    x = _cohen(table[:, 0] / (table[:, 0] + table[:, 2] + 1e-10), table[:, 1] / (table[:, 1] + table[:, 3] + 1e-10))
    if tf:
        t = _tf(correct, cmask, wrong, wmask, max_token_num + 1)
        x += t[:, 0] / (t[:, 1] + 1e-5) - t[:, 1] / (t[:, 0] + 1e-5)
    key = ((alpha * fisher + beta * ig) * x) / (alpha + beta)
    key = (torch.sigmoid(key) - 0.5) * 2 * top
    if eos is not None:
        key[eos] = 0.
    return key


def released_advantages(ids, mask, scores, index, **kw):
    """compute_ktae_outcome_advantage_and_keytokens: GRPO's normalised score plus the token's key-token score."""
    id2score, id2rows = defaultdict(list), defaultdict(list)
    for i in range(ids.shape[0]):
        id2score[index[i]].append(scores[i])
        id2rows[index[i]].append(i)
    grpo, keys = torch.zeros(ids.shape[0]), torch.zeros(ids.shape)
    for idx, rows in id2rows.items():
        s = torch.tensor(id2score[idx])
        mean, std = (torch.mean(s), torch.std(s)) if len(rows) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        key = released_key_tokens(ids[rows], mask[rows], s, int(ids.max()), **kw) if len(rows) > 1 else None
        for r in rows:
            grpo[r] = (scores[r] - mean) / (std + 1e-6)
            if key is not None:
                keys[r] = key[ids[r]]
    return grpo, keys * mask


# ---------------------------------------------------------------- batches
def _batch(seed, rewards, group_size=4, resp_len=20):
    """A micro-batch (verl's engine layout) and the driver's v0 fields: token ids from a small vocabulary with EOS
    ending most responses, outcome rewards on it, GRPO advantages (the release's normalisation)."""
    n = len(rewards)
    mo, data, lp = micro_batch(seed, batch=n, resp_len=resp_len, noise=0.05)
    mask = data["response_mask"].bool()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, mask.shape, generator=g) * mask
    last = mask.long().cumsum(1).argmax(1)
    ended = torch.arange(n) % 3 != 0  # the others were cut at the length limit: no EOS
    ids[torch.arange(n)[ended], last[ended]] = EOS
    scores = torch.tensor(rewards, dtype=torch.float32)
    level = torch.zeros(mask.shape)
    level[torch.arange(n), last] = scores
    index = [f"p{i // group_size}" for i in range(n)]
    grpo, keys = released_advantages(ids, mask.long(), scores, index)
    data["advantages"] = grpo.unsqueeze(1) * mask
    return mo, data, lp, dict(ids=ids, level=level, index=index, keys=keys)


def _driver_scores(sel, data, extra, eos=EOS):
    """The v0 driver's selection on the batch (select_v0 with the trainer's tokenizer's EOS)."""
    from tensordict import TensorDict

    td = TensorDict({fields.RESPONSE_MASK: data["response_mask"], fields.OLD_LOG_PROBS: data["old_log_probs"],
                     fields.ADVANTAGES: data["advantages"], fields.RESPONSES: extra["ids"],
                     fields.TOKEN_LEVEL_REWARDS: extra["level"]}, batch_size=[extra["ids"].shape[0]])
    proto = SimpleNamespace(batch=td, non_tensor_batch={fields.UID: np.array(extra["index"], dtype=object)})
    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"token_selector": "ktae"}, "model": {"path": "unused"},
                                                  "rollout": {"temperature": 1.0}}})
    trainer = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=eos))
    metrics = glue_v0.select_v0(DriverSelector(cfg, sel, trainer=trainer), proto)
    return td[fields.MASK], td[fields.SCORE], metrics


def _grad(loss_fn, cfg, mo, data, lp):
    loss, metrics = loss_fn(cfg, mo, data)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


REWARDS = [[1, 0, 0, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 1, 1]]  # the last group of the second: all correct


@pytest.mark.parametrize("seed,rewards", list(enumerate(REWARDS)))
def test_ktae_is_the_released_advantage(seed, rewards):
    cfg = actor_config("ktae")
    mo, data, lp, extra = _batch(seed, rewards)
    mask, scores, metrics = _driver_scores(cfg.selection, data, extra)
    valid = data["response_mask"].bool()
    assert torch.equal(mask, valid)  # every token is trained
    torch.testing.assert_close(scores * valid, extra["keys"], rtol=1e-6, atol=1e-7)
    assert (extra["keys"].abs() > 1e-3).sum() >= 10, "the bonus must act"
    eos = extra["ids"] == EOS
    assert eos.any() and torch.equal(scores[eos], torch.zeros(int(eos.sum())))
    if len(rewards) == 12:  # a group whose responses are all correct gets no bonus
        assert torch.equal(scores[8:], torch.zeros_like(scores[8:]))
    assert metrics["tokensel/driver_ktae/bonus_abs_max"] == pytest.approx(float(extra["keys"].abs().max()), rel=1e-6)

    data[fields.MASK], data[fields.SCORE] = mask, scores
    loss, grad, out = _grad(tokensel_ppo_loss, cfg, mo, data, lp)
    released = data.clone()
    released["advantages"] = data["advantages"] + extra["keys"]
    del released[fields.MASK], released[fields.SCORE]
    want, want_grad, _ = _grad(ppo_loss, actor_config(None), mo, released, lp)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    assert float(np.mean(out["tokensel/ktae/bonus_abs_max"])) > 0


def test_ktae_knobs_change_the_bonus_as_the_release_does():
    """Without the tf term, with the Fisher term alone, and with EOS kept: each is the release with that setting."""
    rewards = REWARDS[0]
    for knobs, kw in [({"ktae_tf": False}, {"tf": False}), ({"ktae_beta": 0.0}, {"beta": 0.0}),
                      ({"ktae_top": 0.5, "ktae_alpha": 2.0}, {"top": 0.5, "alpha": 2.0}),
                      ({"ktae_exclude_eos": False}, {"eos": None})]:
        cfg = actor_config("ktae", knobs)
        mo, data, lp, extra = _batch(3, rewards)
        mask = data["response_mask"]
        index = extra["index"]
        _, keys = released_advantages(extra["ids"], mask.long(), torch.tensor(rewards, dtype=torch.float32), index,
                                      **kw)
        _, scores, _ = _driver_scores(cfg.selection, data, extra)
        torch.testing.assert_close(scores * mask, keys, rtol=1e-6, atol=1e-7)
        if not cfg.selection.knobs.ktae_exclude_eos:
            assert scores[extra["ids"] == EOS].abs().sum() > 0


def test_ktae_refuses_bad_knobs_and_other_scopes():
    with pytest.raises(Exception, match=r"token_selection.ktae_top=0.0 is invalid; valid values: a number > 0"):
        actor_config("ktae", {"ktae_top": 0.0}, fresh=True)
    with pytest.raises(Exception, match=r"token_selection.ktae_beta=0.0 is invalid"):
        actor_config("ktae", {"ktae_alpha": 0.0, "ktae_beta": 0.0}, fresh=True)
    with pytest.raises(Exception, match=r"token_selection.scope='batch' is invalid"):
        actor_config("ktae", {"scope": "batch"}, fresh=True)
    with pytest.raises(Exception, match=r"token_selection.score_source='current' is invalid; valid values: rollout"):
        actor_config("ktae", {"score_source": "current", "scope": "micro_batch"}, fresh=True)
    assert PRESETS["ktae"].needs_external  # the driver fills them (validate_rollout_config knows them)


@pytest.mark.parametrize("preset", ["ktae", "gtpo"])
@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "remax"])
def test_group_rules_refuse_an_estimator_without_prompt_groups(preset, estimator):
    """KTAE and GTPO compare the responses of each prompt group: an advantage estimator that forms no groups is
    refused on the driver, naming algorithm.adv_estimator and the fix (GRPO, the releases' estimator, passes)."""
    from hydra import compose, initialize_config_module

    from verl_tokensel.core.config import TokenSelectionConfigError, resolve_selection
    from verl_tokensel.verl_glue.install import validate_driver_config

    with pytest.raises(TokenSelectionConfigError, match=rf"algorithm\.adv_estimator='{estimator}' is invalid .*"
                       "Fix: set algorithm.adv_estimator=grpo"):
        resolve_selection(preset, adv_estimator=estimator)
    resolve_selection(preset, adv_estimator="grpo")
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.actor.token_selector={preset}",
            f"algorithm.adv_estimator={estimator}", "trainer.v1.trainer_mode=tokensel_sync"])
    with pytest.raises(TokenSelectionConfigError, match=r"algorithm\.adv_estimator"):
        validate_driver_config(cfg)
