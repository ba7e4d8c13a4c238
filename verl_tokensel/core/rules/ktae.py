"""KTAE (Sun et al., "KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation in Mathematical Reasoning",
arXiv 2505.16826; released code xiaolizh1/KTAE, ``compute_ktae_outcome_advantage_and_keytokens`` of its
``core_algos.py`` and ``ComputeKeyTokens`` of ``compute_key_tokens.py``). Pure torch, no verl import.

Per prompt group, each token id ``v`` of its responses gets a bounded score from the contingency table of
(the response is correct, the response contains ``v``): ``a`` / ``b`` correct / wrong responses containing it,
``c`` / ``d`` those not. With ``h`` Cohen's effect size ``asin(sqrt(a / (a + c))) - asin(sqrt(b / (b + d)))``, plus
(``ktae_tf``) the BM25 term-frequency contrast ``tf_c / tf_w - tf_w / tf_c`` of the token's frequency among the
correct and the wrong responses' tokens (k1 = 2, b = 0.5), the Fisher exact test's two-sided p-value as
``exp(-2 p)`` (0 where ``p = 1``) and the information gain ``IG`` of the correctness given the token's presence,

    key(v) = top * 2 * (sigmoid((alpha * exp(-2 p) + beta * IG) * h / (alpha + beta)) - 1/2)  in (-top, top)

is added to the advantage of every token with id ``v`` (the release adds it to GRPO's normalised score; here to the
advantage verl's estimator computed). A response is correct when its outcome reward (``token_level_rewards``
summed) is above ``ktae_correct_above`` (the release: > 0). A group of one response, or whose responses are all
correct or all wrong, gets no bonus. The tokenizer's EOS token gets none (``ktae_exclude_eos``; the release
hard-codes Qwen2.5's ``<|endoftext|>``, 151643).

The group's responses are only all in one place on the driver: the preset runs there (``score_source=rollout``,
``scope=group``), carries the bonus as its score and its loss adds it back (``x.scores`` in its transform).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from verl_tokensel.core.rules.group_shift import GroupShiftRule, group_shift_needs
from verl_tokensel.core.rules.maths import share
from verl_tokensel.rules import Knobs, config_error, knob, register_rule, register_score

NAME = "ktae"
# the release's BM25 constants (compute_tf) and the guards of its divisions
BM25_K1, BM25_B = 2.0, 0.5
TF_EPS, SHARE_EPS = 1e-5, 1e-10


@dataclass(frozen=True)
class KtaeKnobs(Knobs):
    ktae_alpha: float = knob(1.0, "Weight of the Fisher exact test's exp(-2 p) in the key-token statistic.",
                             "1.0 (the released ComputeKeyTokens call)", ge=0)
    ktae_beta: float = knob(1.0, "Weight of the information gain in the key-token statistic.",
                            "1.0 (the released call's beta_ig)", ge=0)
    ktae_tf: bool = knob(True, "Add the BM25 term-frequency contrast of correct and wrong responses to the effect "
                         "size (false: Cohen's h alone).", "true (the released call's gamma_tf=1.0)")
    ktae_top: float = knob(1.0, "Bound of the bonus: key(v) lies in (-top, top).", "1.0 (the released call's top)",
                           gt=0)
    ktae_correct_above: float = knob(0.0, "A response is correct when its outcome reward (token_level_rewards "
                                     "summed) is above this.", "0.0 (the release: reward > 0)")
    ktae_exclude_eos: bool = knob(True, "The tokenizer's eos_token_id gets no bonus.",
                                  "true (the release zeroes id 151643, Qwen2.5's <|endoftext|>)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ktae_alpha + self.ktae_beta > 0:
            raise config_error("token_selection.ktae_beta", self.ktae_beta, "a number > 0 when ktae_alpha is 0",
                               "the statistic is divided by ktae_alpha + ktae_beta. Fix: set one of them > 0.")
        value = self.ktae_correct_above
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise config_error("token_selection.ktae_correct_above", value, "a finite number")


def _log_comb(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def fisher_p_values(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Two-sided Fisher exact p-values of 2x2 tables (float32 rows ``a b / c d``): the sum of the hypergeometric
    probabilities of the tables with the margins of the observed one that are no more likely than it."""
    r1, c1, n = a + b, a + c, a + b + c + d
    k_min = torch.clamp(r1 + c1 - n, min=0.0)
    k_max = torch.minimum(r1, c1)
    k = torch.arange(int(k_max.max()) + 1 if k_max.numel() else 1, dtype=torch.float32, device=a.device)
    k = k.unsqueeze(0).expand(a.shape[0], -1)
    inside = (k >= k_min.unsqueeze(1)) & (k <= k_max.unsqueeze(1))
    c1g, r1g, ng = c1.unsqueeze(1).expand_as(k), r1.unsqueeze(1).expand_as(k), n.unsqueeze(1).expand_as(k)
    p_k = torch.exp(_log_comb(c1g, k) + _log_comb(ng - c1g, r1g - k) - _log_comb(ng, r1g)) * inside.float()
    p_obs = torch.exp(_log_comb(c1, a) + _log_comb(n - c1, r1 - a) - _log_comb(n, r1))
    return torch.where((p_k <= p_obs.unsqueeze(1)) & inside, p_k, 0.0).sum(1)


def information_gain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """IG (bits) of correctness given the token's presence, per table."""
    n = a + b + c + d

    def h(p):
        return -p * torch.where(p > 0, torch.log2(p), 0.0)

    def h2(x1, x2):
        total = x1 + x2
        return torch.where(total > 0, h(x1 / total) + h(x2 / total), 0.0)

    h_y = h((a + c) / n) + h((b + d) / n)
    ig = h_y - ((a + b) / n * h2(a, b) + (c + d) / n * h2(c, d))
    return torch.where(n == 0, 0.0, ig)


def group_key_tokens(ids: torch.Tensor, valid: torch.Tensor, correct: torch.Tensor, knobs: KtaeKnobs
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids, key)``: the key-token score of each distinct token id among one group's valid tokens.

    ``ids`` / ``valid``: ``(n, response_len)`` int64 token ids and bool valid mask of the group's responses;
    ``correct``: ``(n,)`` bool. All zeros unless the group has a correct and a wrong response.
    """
    vocab, inverse = torch.unique(ids[valid], return_inverse=True)
    key = torch.zeros(vocab.shape, dtype=torch.float32, device=ids.device)
    n_correct, n_wrong = int(correct.sum()), int((~correct).sum())
    if n_correct == 0 or n_wrong == 0 or vocab.numel() == 0:
        return vocab, key
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)[valid]
    contains = torch.zeros(ids.shape[0], vocab.numel(), dtype=torch.bool, device=ids.device)
    contains[rows, inverse] = True
    a = contains[correct].sum(0).float()
    b = contains[~correct].sum(0).float()
    c, d = n_correct - a, n_wrong - b
    ig = information_gain(a, b, c, d) if knobs.ktae_beta else torch.zeros_like(a)
    p = fisher_p_values(a, b, c, d) if knobs.ktae_alpha else torch.ones_like(a)
    fisher = torch.where(p != 1.0, torch.exp(-2 * p), 0.0)
    h = (torch.asin(torch.sqrt(torch.clamp(a / (a + c + SHARE_EPS), 0, 1)))
         - torch.asin(torch.sqrt(torch.clamp(b / (b + d + SHARE_EPS), 0, 1))))
    if knobs.ktae_tf:
        in_correct = correct.unsqueeze(1).expand_as(ids)[valid]
        freq_c = torch.bincount(inverse[in_correct], minlength=vocab.numel()).float()
        freq_w = torch.bincount(inverse[~in_correct], minlength=vocab.numel()).float()
        total_c, total_w = float(in_correct.sum()), float((~in_correct).sum())
        if total_c > 0 and total_w > 0:  # the release divides by both (a group of empty responses: no tf term)
            avg = (total_c + total_w) / 2
            k_c = BM25_K1 * (1 - BM25_B + BM25_B * (total_c / avg))
            k_w = BM25_K1 * (1 - BM25_B + BM25_B * (total_w / avg))
            tf_c = (freq_c / total_c) * (BM25_K1 + 1) / ((freq_c / total_c) + k_c)
            tf_w = (freq_w / total_w) * (BM25_K1 + 1) / ((freq_w / total_w) + k_w)
            h = h + tf_c / (tf_w + TF_EPS) - tf_w / (tf_c + TF_EPS)
    stat = (knobs.ktae_alpha * fisher + knobs.ktae_beta * ig) * h / (knobs.ktae_alpha + knobs.ktae_beta)
    return vocab, (torch.sigmoid(stat) - 0.5) * 2 * knobs.ktae_top


def key_token_bonus(ids: torch.Tensor, valid: torch.Tensor, reward: torch.Tensor, group_ids: Optional[torch.Tensor],
                    knobs: KtaeKnobs, eos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(batch, response_len)`` float32: each valid token's key-token score within its prompt group.

    ``reward``: ``(batch,)`` outcome rewards; ``group_ids``: ``(batch,)`` int64 (None: one group);
    ``eos``: bool, the tokens that get no bonus (``ktae_exclude_eos``).
    """
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    groups = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device) if group_ids is None else group_ids
    correct = reward > knobs.ktae_correct_above
    for g in torch.unique(groups[valid.any(1)]):
        rows = (groups == g).nonzero(as_tuple=True)[0]
        if rows.numel() < 2:
            continue
        gids, gvalid = ids[rows], valid[rows]
        vocab, key = group_key_tokens(gids, gvalid, correct[rows], knobs)
        if vocab.numel() == 0:
            continue
        lookup = torch.searchsorted(vocab, gids.clamp(min=int(vocab[0]))).clamp(max=vocab.numel() - 1)
        out[rows] = torch.where(gvalid, key[lookup], 0.0)
    if knobs.ktae_exclude_eos and eos is not None:
        out = torch.where(eos.to(torch.bool), 0.0, out)
    return out


@register_score(NAME, needs_entropy=False, needs_omega=False, ranks=False, rule=NAME,
                needs_external=("response_ids", "sequence_reward", "eos_token"),
                help="KTAE's key-token score of each token's id within its prompt group (the rows given: one group), "
                     "added to its advantage")
def ktae_score(inp) -> torch.Tensor:
    ext = inp.external
    return key_token_bonus(ext["response_ids"], inp.response_mask.to(torch.bool), ext["sequence_reward"][:, 0], None,
                           KtaeKnobs(), ext.get("eos_token"))


@register_rule(NAME, knobs=KtaeKnobs, needs=group_shift_needs(NAME))
class Ktae(GroupShiftRule):
    """Every token keeps its gradient; its advantage gets the key-token score of its id in its prompt group."""

    def score(self, x) -> torch.Tensor:
        ext = x.external
        reward = ext["sequence_reward"]
        rows = torch.arange(reward.shape[0], device=reward.device)
        first = x.valid.float().argmax(1)  # the reward is the same on every token of a response
        return key_token_bonus(ext["response_ids"], x.valid, reward[rows, first], x.group_ids, x.knobs,
                               ext.get("eos_token"))

    def stats(self, x) -> dict[str, float]:
        bonus, tokens = x.transform.advantage_shift, x.tokens
        n = int(tokens.sum())
        if bonus is None or n == 0:
            return {}
        b = bonus[tokens]
        return {"bonus_mean": float(b.mean()), "bonus_abs_max": float(b.abs().max()),
                "positive_share": share(int((b > 0).sum()), n), "negative_share": share(int((b < 0).sum()), n)}


__all__ = ["Ktae", "KtaeKnobs", "fisher_p_values", "group_key_tokens", "information_gain", "key_token_bonus"]
