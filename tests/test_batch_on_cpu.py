"""The one score-input builder (``core.ranking.batch``): row keys, group ids, and training vs analysis agreement."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from helpers.loss_inputs import make_micro_batch

from verl_tokensel.analysis.scorer import TokenScores
from verl_tokensel.analysis.training_masks import scored_batch, select_preset
from verl_tokensel.analysis.stats import exact_grad_norms, gmts_scores
from verl_tokensel.core.ranking.batch import group_ids, pad_rows, row_keys, score_batch
from verl_tokensel.core.config import PRESETS, override, preset
from verl_tokensel.core.ranking.scores import logit_grad_norm
from verl_tokensel.core.driver_select import select_on_driver
from verl_tokensel.verl_glue.micro_batch import unpack_micro_batch

PACKAGE = Path(__file__).resolve().parents[1] / "verl_tokensel"


def test_row_keys_agree_for_nested_padded_and_list_rows():
    rows = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([1, 2, 3, 4])]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    padded = torch.zeros(3, 6, dtype=torch.long)
    attn = torch.zeros(3, 6, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding, as verl's prompts
        padded[i, 6 - r.numel():] = r
        attn[i, 6 - r.numel():] = 1
    k = row_keys(rows)
    assert k.dtype == torch.int64 and len(set(k.tolist())) == 3
    assert torch.equal(row_keys(nested), k)
    assert torch.equal(row_keys(padded, attn), k)
    assert torch.equal(row_keys([r.tolist() for r in rows]), k)
    # position matters: the same tokens in another order are another response
    assert row_keys([torch.tensor([7, 6, 5])])[0] != k[0]


def test_group_ids_are_blake2b_of_the_uid_text_and_pass_int_ids_through():
    ids = group_ids(["p", "q", "p"])
    assert ids[0] == ids[2] != ids[1]
    assert ids[0].item() == int.from_bytes(hashlib.blake2b(b"p", digest_size=8).digest(), "little", signed=True)
    assert torch.equal(group_ids(torch.tensor([3, 3, 1], dtype=torch.int32)), torch.tensor([3, 3, 1]))


def test_score_batch_applies_row_valid_weights_and_keys_only_when_needed():
    lp = -torch.rand(3, 4)
    rm = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.randn(3, 4)
    w = torch.rand(3, 4)
    b = score_batch("gmts", {"response_mask": rm, "log_probs": lp, "advantages": adv, "entropy": torch.rand(3, 4),
                             "rollout_is_weights": w}, row_valid=torch.tensor([True, False, True]),
                    input_ids=[[1, 2], [3], [4, 5]], uids=["a", "b", "a"], scope="group")
    assert torch.equal(b.valid[1], torch.zeros(4, dtype=torch.bool)) and b.valid[0].all()
    assert torch.allclose(b.inputs.advantages, adv * w)
    assert b.inputs.row_keys is None  # gmts needs none: nothing hashed
    assert torch.equal(b.group_ids, group_ids(["a", "b", "a"]))
    assert (b.score("gmts")[1] == 0).all()
    r = score_batch("random", {"response_mask": rm, "log_probs": lp}, input_ids=[[1, 2], [3], [4, 5]])
    assert torch.equal(r.inputs.row_keys, row_keys([[1, 2], [3], [4, 5]]))
    assert r.group_ids is None  # no group scope: no ids
    with pytest.raises(ValueError, match="unknown score 'nope'"):
        score_batch("nope", {"response_mask": rm, "log_probs": lp})


def _analysis_view_of(model_output, data):
    """The micro-batch as the analysis tools see responses: TokenScores + (prompt, response) ids."""
    from verl.workers.utils.padding import no_padding_2_padding

    lp = no_padding_2_padding(model_output["log_probs"], data).detach()
    ent = no_padding_2_padding(model_output["entropy"], data)
    sp2 = no_padding_2_padding(model_output["sum_pi_squared"], data)
    padded = data.select("response_mask", "advantages").to_padded_tensor()
    rm = padded["response_mask"].bool()
    scored, pairs, adv = [], [], []
    for i in range(rm.shape[0]):
        n = int(rm[i].sum())
        scored.append(TokenScores(token_ids=data["responses"][i][:n], logp=lp[i, :n], entropy=ent[i, :n],
                                  sum_p2=sp2[i, :n], grad_norm=logit_grad_norm(lp[i, :n], sp2[i, :n])))
        pairs.append((data["prompts"][i].tolist(), data["responses"][i][:n].tolist()))
        adv.append(float(padded["advantages"][i, 0]))
    return scored, pairs, adv, lp, ent, sp2, padded


@pytest.mark.parametrize("score", ["entropy", "random"])
def test_the_loss_and_the_analysis_score_a_micro_batch_alike(score):
    """Scores without omega read only per-token values and row keys: the loss's and view's must be equal."""
    model_output, data, _ = make_micro_batch(batch=5, seed=3, with_sum_pi_squared=True)
    sel = preset("gradient_mask", score=score, ratio=0.2, direction="top", scope="micro_batch", normaliser="all",
                 seed=11)
    cfg = type("Cfg", (), {"clip_ratio": 0.2, "use_kl_loss": False})()
    trained, _ = unpack_micro_batch(cfg, sel, model_output, data)
    scored, pairs, adv, *_ = _analysis_view_of(model_output, data)
    analysed = scored_batch(scored, adv, score, pairs=pairs, seed=11)
    assert torch.equal(trained.valid, analysed.valid)
    assert torch.equal(trained.score(score), analysed.score(score))


@pytest.mark.parametrize("preset", ["forking", "gmts", "grad_norm", "random"])
def test_the_driver_and_the_analysis_select_alike_on_policy(preset):
    model_output, data, _ = make_micro_batch(batch=6, seed=4, with_sum_pi_squared=True)
    scored, pairs, adv, lp, ent, sp2, padded = _analysis_view_of(model_output, data)
    sel = PRESETS[preset]
    on_driver = select_on_driver(
        override(sel, scope="batch", normaliser="all", score_source="rollout"),
        {"response_mask": padded["response_mask"], "old_log_probs": lp, "advantages": padded["advantages"],
         "entropy": ent, "sum_pi_squared": sp2},
        keys=row_keys([p + r for p, r in pairs]))
    chosen = select_preset(scored_batch(scored, adv, sel.score, pairs=pairs, seed=sel.seed), sel,
                           scope="micro_batch")
    torch.testing.assert_close(chosen.scores, on_driver.scores, rtol=1e-6, atol=1e-7)
    assert torch.equal(chosen.mask, on_driver.mask)


def test_analysis_report_scores_are_the_registry_scores():
    model_output, data, _ = make_micro_batch(batch=4, seed=5, with_sum_pi_squared=True)
    scored, pairs, adv, lp, ent, sp2, padded = _analysis_view_of(model_output, data)
    valid = padded["response_mask"].bool()
    a = padded["advantages"].abs()
    cases = ((gmts_scores(scored, adv), ent * a), (exact_grad_norms(scored, adv), logit_grad_norm(lp, sp2) * a))
    for got, want in cases:
        flat = torch.cat(got)
        torch.testing.assert_close(flat, want[valid].double(), rtol=1e-6, atol=1e-7)


def test_pad_rows():
    out, valid = pad_rows([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert out.tolist() == [[1.0, 2.0], [3.0, 0.0]] and valid.tolist() == [[True, True], [True, False]]


def test_score_inputs_are_built_in_one_place():
    """Every ScoreInputs of the package comes from core.ranking.batch.score_batch (no second assembly to drift)."""
    builders = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                if re.search(r"\bScoreInputs\(", p.read_text(encoding="utf-8"))]
    assert sorted(builders) == ["core/ranking/batch.py"], builders
