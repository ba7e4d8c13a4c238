"""`verl-tokensel analyze`: statistics checked by hand, the scorer path on hand-set logits, the CLI end to end,
and the bad-input matrix (clear error naming the file, nothing written)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_tokensel.analysis import io as aio
from verl_tokensel.analysis import report as areport
from verl_tokensel.analysis import stats
from verl_tokensel.analysis.scorer import TokenScores, score_responses
from verl_tokensel.cli.main import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ts(entropy, grad_norm=None, token_ids=None) -> TokenScores:
    h = torch.tensor(entropy, dtype=torch.float32)
    g = torch.tensor(grad_norm if grad_norm is not None else [1.0] * len(entropy), dtype=torch.float32)
    ids = torch.tensor(token_ids if token_ids is not None else list(range(len(entropy))), dtype=torch.long)
    zeros = torch.zeros_like(h)
    return TokenScores(token_ids=ids, logp=zeros, entropy=h, sum_p2=zeros, grad_norm=g)


# ------------------------------------------------------------------------------------------------
# stats on hand-crafted TokenScores


def test_percentiles_share_below_and_threshold_by_hand():
    # pooled sorted: 0, .001, .005, .009, .02, .5, 1, 2, 3, 4  (N = 10)
    scores = [ts([0.0, 0.005, 0.02, 1.0, 2.0]), ts([0.001, 0.5, 3.0, 0.009, 4.0])]
    r = stats.build_report(scores)
    p = r["entropy"]["percentiles"]
    # P_q = smallest of the ceil((100-q)/100 * 10) largest
    assert p["50"] == pytest.approx(0.5)  # 5 largest: .5 1 2 3 4
    assert p["80"] == pytest.approx(3.0)  # 2 largest: 3 4
    assert p["90"] == pytest.approx(4.0) and p["99"] == pytest.approx(4.0)
    assert r["entropy"]["share_below_0.01"] == pytest.approx(0.4)
    assert r["entropy"]["share_zero"] == pytest.approx(0.1)
    assert r["entropy"]["top_threshold"] == p["80"]
    assert r["token_count"] == 10 and r["responses"] == 2
    assert r["gmts"] is None and "advantage" in r["gmts_omitted_reason"]


def test_exact_percentiles_is_the_selection_threshold_beyond_small_n():
    x = torch.arange(1000, dtype=torch.float64).flip(0)
    p = stats.exact_percentiles(x, (50, 80, 90, 99))
    assert p == {"50": 500.0, "80": 800.0, "90": 900.0, "99": 990.0}
    sel = stats.top_mask(x, 0.2)
    assert int(sel.sum()) == 200 and float(x[sel].min()) == p["80"]


def test_forking_token_counts_by_hand():
    # 20 tokens -> top-20% = 4 tokens: the entropies 9, 8, 7, 6 -> token ids 7, 7, 5, 7
    h = [0.1] * 20
    ids = list(range(100, 120))
    for pos, (val, tok) in {2: (9.0, 7), 5: (8.0, 7), 11: (7.0, 5), 17: (6.0, 7)}.items():
        h[pos], ids[pos] = val, tok
    ids[0] = 5  # one more, low-entropy, occurrence of token 5
    r = stats.build_report([ts(h[:10], token_ids=ids[:10]), ts(h[10:], token_ids=ids[10:])],
                           decode=lambda t: f"<{t}>")
    ft = r["forking_tokens"]
    assert [(t["token_id"], t["count"], t["occurrences"], t["text"]) for t in ft] == [
        (7, 3, 3, "<7>"), (5, 1, 2, "<5>")]
    assert ft[1]["forking_rate"] == pytest.approx(0.5)
    assert r["entropy"]["top_threshold"] == pytest.approx(6.0)


def test_rankdata_and_spearman_by_hand_with_ties():
    assert stats.rankdata([10, 20, 20, 30]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert stats.rankdata([3, 3, 3]).tolist() == [2.0, 2.0, 2.0]
    assert stats.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    # y ranks (ties): 1, 2, 3.5, 5, 3.5 -> 8 / sqrt(10 * 9.5)
    assert stats.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert stats.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert stats.spearman([1, 2, 3], [0.1, 5, 100]) == pytest.approx(1.0)  # ranks, not values
    assert math.isnan(stats.spearman([1, 2, 3], [4, 4, 4]))
    assert math.isnan(stats.spearman([1], [2]))


def test_within_answer_plus_one_but_across_answers_negative():
    # entropy tracks the gradient inside each answer, but the advantages differ per answer
    scores = [ts([1.0, 2.0, 3.0], [0.1, 0.2, 0.3]), ts([4.0, 5.0, 6.0], [0.1, 0.2, 0.3])]
    r = stats.build_report(scores, [10.0, -0.1], advantage_source="given")
    c = r["gmts"]["entropy_vs_exact_grad_norm"]
    assert c["within_answer_mean"] == pytest.approx(1.0) and c["within_answers_used"] == 2
    # pooled: H ranks 1..6, G = 1, 2, 3, .01, .02, .03 -> ranks 4 5 6 1 2 3: 1 - 6*54/(6*35)
    assert c["across_answers"] == pytest.approx(1 - 6 * 54 / 210)
    assert c["across_answers"] < 0
    # advantage-free ||e_a - p||: g ranks with ties 1.5 3.5 5.5 1.5 3.5 5.5 -> 8 / sqrt(17.5 * 16)
    lg = r["entropy_vs_logit_grad_norm"]
    assert lg["within_answer_mean"] == pytest.approx(1.0)
    assert lg["across_answers"] == pytest.approx(8 / math.sqrt(280))


def test_within_answer_eligibility():
    scores = [ts([1.0, 2.0, 3.0], [0.3, 0.2, 0.1]),   # -1
              ts([1.0, 2.0], [0.1, 0.2]),              # < 3 tokens: skipped
              ts([1.0, 1.0, 1.0], [0.1, 0.2, 0.3]),    # constant entropy: skipped
              ts([1.0, 2.0, 3.0], [0.1, 0.2, 0.3])]    # +1, but A = 0 -> exact norm constant 0
    r = stats.build_report(scores, [1.0, 1.0, 1.0, 0.0], advantage_source="given")
    c = r["gmts"]["entropy_vs_exact_grad_norm"]
    assert c["within_answers_used"] == 1 and c["answers_total"] == 4
    assert c["within_answer_mean"] == pytest.approx(-1.0)
    lg = r["entropy_vs_logit_grad_norm"]
    assert lg["within_answers_used"] == 2 and lg["within_answer_mean"] == pytest.approx(0.0)


def test_jaccard_entropy_top_vs_gmts_top_and_grad_mass_by_hand():
    # 10 tokens -> 2 per top set. entropy top: pos 0 (H 5) and 5 (H 4.5);
    # GMTS = H|A|: answer 1 x0.1 -> .5 .4 .1..; answer 2 x1 -> 4.5 2 .5..  -> top: pos 5, 6
    scores = [ts([5.0, 4.0, 1.0, 1.0, 1.0]), ts([4.5, 2.0, 0.5, 0.5, 0.5])]
    r = stats.build_report(scores, [0.1, -1.0], advantage_source="given")
    g = r["gmts"]
    assert g["jaccard_entropy_top_vs_gmts_top"] == pytest.approx(1 / 3)
    # exact grad = |A| * 1: total 5 * .1 + 5 * 1 = 5.5; entropy top keeps .1 + 1; GMTS top keeps 1 + 1
    assert g["grad_mass_kept"]["entropy_top"] == pytest.approx(1.1 / 5.5)
    assert g["grad_mass_kept"]["gmts_top"] == pytest.approx(2 / 5.5)
    e = stats.top_mask(torch.tensor([5.0, 4, 1, 1, 1, 4.5, 2, .5, .5, .5]))
    assert e.nonzero().flatten().tolist() == [0, 5]
    assert stats.jaccard(torch.tensor([1, 1, 0, 0], dtype=torch.bool), torch.tensor([0, 1, 1, 0], dtype=torch.bool)) \
        == pytest.approx(1 / 3)


def test_grpo_advantages_from_rewards_by_group():
    adv = stats.grpo_advantages([1.0, 0.0, 5.0, 1.0, 1.0, 5.0, 2.0], ["a", "a", "b", "a", "a", "b", "c"])
    sd = math.sqrt(0.75 / 3)  # unbiased std of 1 0 1 1: squared deviations sum to 0.75, over 4 - 1
    assert adv[0] == pytest.approx(0.25 / (sd + 1e-6)) and adv[3] == adv[4] == adv[0]
    assert adv[1] == pytest.approx(-0.75 / (sd + 1e-6))
    assert adv[2] == 0.0 and adv[5] == 0.0  # all-equal group: no signal
    assert adv[6] == pytest.approx(2.0 / (1.0 + 1e-6))  # a group of one: mean 0, std 1 (verl's rule)
    rec = lambda reward, adv, g: aio.ResponseRecord("p", "r", reward, adv, g, "x")  # noqa: E731
    a, src = stats.resolve_advantages([rec(1.0, None, "a"), rec(0.0, None, "a")])
    sd2 = math.sqrt(0.5)  # unbiased std of 1 0
    assert a == pytest.approx([0.5 / (sd2 + 1e-6), -0.5 / (sd2 + 1e-6)]) and "GRPO" in src
    a, src = stats.resolve_advantages([rec(1.0, 0.3, "a"), rec(0.0, -2.0, "a")])
    assert a == [0.3, -2.0] and "advantage" in src
    a, src = stats.resolve_advantages([rec(None, None, "a")])
    assert a is None and "neither" in src


# ------------------------------------------------------------------------------------------------
# the scorer path on hand-set logits (entropy = ln k for a uniform distribution over k tokens)


class _OneHotBase(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        with torch.no_grad():
            self.emb.weight.copy_(torch.eye(vocab))

    def forward(self, input_ids):
        return SimpleNamespace(last_hidden_state=self.emb(input_ids))


class HandSetLM(torch.nn.Module):
    """hidden = one-hot of the current token, so column t of the LM head is the next-token logits after t."""

    base_model_prefix = "model"

    def __init__(self, next_logits: torch.Tensor):
        super().__init__()
        vocab = next_logits.shape[0]
        self.config = SimpleNamespace(vocab_size=vocab)
        self.model = _OneHotBase(vocab)
        self.lm_head = torch.nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(next_logits.T)

    def get_output_embeddings(self):
        return self.lm_head


def _uniform(vocab: int, support) -> torch.Tensor:
    z = torch.full((vocab,), -1e4)
    z[list(support)] = 0.0
    return z


def test_scorer_on_hand_set_logits_feeds_the_report():
    V = 8
    nxt = torch.stack([
        _uniform(V, range(4)),   # after token 0: uniform over 4 -> ln 4
        _uniform(V, [1, 2]),     # after 1: ln 2
        _uniform(V, [3]),        # after 2: certain -> 0
        _uniform(V, range(8)),   # after 3: ln 8
    ] + [_uniform(V, range(8))] * 4)
    model = HandSetLM(nxt).eval()
    pairs = [([3], [0, 1, 2, 3, 0]), ([5, 2], [3, 1, 0])]
    out = score_responses(model, pairs, chunk_size=3)
    l2, l4, l8 = math.log(2), math.log(4), math.log(8)
    assert out[0].entropy.tolist() == pytest.approx([l8, l4, l2, 0.0, l8], abs=1e-6)
    assert out[1].entropy.tolist() == pytest.approx([0.0, l8, l2], abs=1e-6)
    # log p of a token inside a uniform-k support is -ln k; ||e_a - p||^2 = (1 - 1/k)^2 + (k - 1)/k^2
    assert out[0].logp.tolist() == pytest.approx([-l8, -l4, -l2, 0.0, -l8], abs=1e-6)
    assert out[0].grad_norm[0].item() == pytest.approx(math.sqrt(1 - 1 / 8), rel=1e-5)
    assert out[0].grad_norm[3].item() == pytest.approx(0.0, abs=1e-6)
    same = score_responses(model, pairs, chunk_size=8192)
    assert torch.allclose(same[0].entropy, out[0].entropy, atol=1e-6)

    r = stats.build_report(out, [1.0, 2.0], decode=str, advantage_source="given")
    # pooled entropies (N = 8): 0 0 ln2 ln2 ln4 ln8 ln8 ln8
    p = r["entropy"]["percentiles"]
    assert p["50"] == pytest.approx(l4, abs=1e-6)   # 4 largest: ln4 ln8 ln8 ln8
    assert p["80"] == pytest.approx(l8, abs=1e-6)   # 2 largest
    assert r["entropy"]["share_below_0.01"] == pytest.approx(2 / 8)
    assert r["entropy"]["mean"] == pytest.approx((2 * l2 + l4 + 3 * l8) / 8, abs=1e-6)
    # top 2 by entropy (ties by position): positions 0 and 4 of answer 0 -> token ids 0 and 0
    assert [(t["token_id"], t["count"]) for t in r["forking_tokens"]] == [(0, 2)]
    assert r["token_count"] == 8


# ------------------------------------------------------------------------------------------------
# input reading


def _write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_dump_groups_by_uid_sample_within_a_step_and_by_input_without_uid(tmp_path):
    d = tmp_path / "dump"
    _write_jsonl(d / "2.jsonl", [
        {"input": "q1", "output": "a", "score": 1.0, "step": 2, "gts": "x", "uid": "aa-1_0_0"},
        {"input": "q1", "output": "b", "score": 0.0, "step": 2, "gts": "x", "uid": "aa-1_1_0"},
        {"input": "q2", "output": "c", "score": 0.0, "step": 2, "gts": "y", "uid": "bb-2_0_0"},
    ])
    _write_jsonl(d / "10.jsonl", [  # v0 driver: no uid -> group by input text
        {"input": "q1", "output": "d", "score": 1.0, "step": 10, "gts": "x"},
        {"input": "q1", "output": "e", "score": 1.0, "step": 10, "gts": "x"},
        {"input": "q3", "output": "f", "score": 0.0, "step": 10, "gts": "z"},
    ])
    recs = aio.load_records(d)
    assert [r.response for r in recs] == list("abcdef")  # steps in numeric order (2 before 10)
    g = [r.group for r in recs]
    assert g[0] == g[1] != g[2] and g[3] == g[4] != g[5] and g[0] != g[3]
    assert [r.reward for r in recs] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert recs[0].source.endswith("2.jsonl:line 1")


def test_table_inputs_parquet_and_jsonl_with_aliases(tmp_path):
    import pandas as pd

    pq = tmp_path / "t.parquet"
    pd.DataFrame({"prompt": ["p", "p"], "response": ["x", "y"], "reward": [1.0, 0.0],
                  "advantage": [0.5, -0.5], "group": ["g", "g"]}).to_parquet(pq)
    recs = aio.load_records(pq)
    assert [(r.reward, r.advantage, r.group) for r in recs] == [(1.0, 0.5, "g"), (0.0, -0.5, "g")]
    js = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "response": "x", "score": 2},
                                             {"prompt": "q", "response": "y", "score": 3}])
    recs = aio.load_records(js)
    assert [(r.reward, r.advantage) for r in recs] == [(2.0, None), (3.0, None)]
    assert recs[0].group != recs[1].group  # grouped by prompt text


# ------------------------------------------------------------------------------------------------
# end to end through the CLI


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny_qwen2_seed0")


def _dump_rows(n_prompts=3, n_rollouts=4, step=1):
    import random

    rng = random.Random(step)
    rows = []
    for s in range(n_prompts):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        for k in range(n_rollouts):
            c = a + b + (0 if k % 2 == 0 else rng.choice([1, -1, 10]))
            rows.append({"input": f"user\nWhat is {a} plus {b}?\nassistant\n",
                         "output": f"Let's think step by step. {a} + {b} = {c}. The answer is \\boxed{{{c}}}.",
                         "score": float(c == a + b), "step": step, "gts": str(a + b),
                         "uid": f"{s:04d}-uuid_{k}_0"})
    return rows


def _assert_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path
    from PIL import Image

    with Image.open(path) as im:
        im.verify()


def test_analyze_end_to_end_subprocess(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    dump = tmp_path / "rollout_data"
    rows = _dump_rows(step=1) + _dump_rows(step=2)
    _write_jsonl(dump / "1.jsonl", rows[:12])
    _write_jsonl(dump / "2.jsonl", rows[12:])
    out = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", "analyze", "--model", tiny_model,
                          "--data", str(dump), "--out", str(out), "--chunk-size", "100"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"report: {out / 'report.json'}" in res.stdout
    assert "Spearman(entropy, exact grad norm)" in res.stdout and "top-20% entropy threshold" in res.stdout

    r = json.loads((out / "report.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_model)
    lengths = [len(tok(x["output"], add_special_tokens=False)["input_ids"]) for x in rows]
    assert r["responses"] == len(rows) == 24
    assert r["token_count"] == sum(lengths)
    e = r["entropy"]
    assert e["top_threshold"] == e["percentiles"]["80"]
    assert e["percentiles"]["50"] <= e["percentiles"]["80"] <= e["percentiles"]["90"] <= e["percentiles"]["99"]
    assert 0.0 <= e["share_below_0.01"] <= 1.0
    # a random 384-token model is near-uniform: entropies just under ln 384
    assert 5.0 < e["percentiles"]["50"] <= math.log(384) + 1e-4
    assert r["advantages"]["source"].startswith("GRPO")
    g = r["gmts"]
    c = g["entropy_vs_exact_grad_norm"]
    assert 1 <= c["within_answers_used"] <= c["answers_total"] == 24
    assert -1.0 <= c["within_answer_mean"] <= 1.0 and -1.0 <= c["across_answers"] <= 1.0
    assert 0.0 <= g["jaccard_entropy_top_vs_gmts_top"] <= 1.0
    ft = r["forking_tokens"]
    assert 1 <= len(ft) <= 20 and all(isinstance(t["text"], str) for t in ft)
    k = math.ceil(0.2 * r["token_count"])
    assert sum(t["count"] for t in ft) <= k
    assert ft == sorted(ft, key=lambda t: (-t["count"], t["token_id"]))
    for name in r["plots"]:
        _assert_png(out / name)
    assert sorted(p.name for p in out.iterdir()) == sorted(r["plots"] + ["report.json", "report.md"])
    md = (out / "report.md").read_text()
    assert "Top forking tokens" in md and "| response tokens | %d |" % r["token_count"] in md
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_analyze_without_rewards_omits_gmts_and_max_responses(tmp_path, tiny_model, capsys):
    data = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 1 plus 2?", "response": "1 + 2 = 3."},
                                              {"prompt": "Compute 4 * 5.", "response": "4 * 5 = 20."},
                                              {"prompt": "Compute 7 - 5.", "response": ""}])
    out = tmp_path / "out"
    assert cli_main(["analyze", "--model", tiny_model, "--data", str(data), "--out", str(out),
                     "--max-responses", "2"]) == 0
    r = json.loads((out / "report.json").read_text())
    assert r["responses"] == 2 and r["gmts"] is None and "reward" in r["gmts_omitted_reason"]
    assert "GMTS statistics omitted" in capsys.readouterr().out
    assert "omitted" in (out / "report.md").read_text()
    _assert_png(out / "entropy_vs_grad.png")


def test_analyze_help_has_worked_examples(capsys):
    with pytest.raises(SystemExit) as ex:
        cli_main(["analyze", "--help"])
    assert ex.value.code == 0
    text = capsys.readouterr().out
    assert "verl-tokensel analyze --model" in text and "verl-tokensel tiny-model --out" in text
    assert "--out report/ \\\n        --device cuda" in text  # the continued command keeps its line break


# ------------------------------------------------------------------------------------------------
# bad inputs: clear error naming the file and the problem, nothing written


def _bad(tmp_path, name, rows=None, parquet=None):
    p = tmp_path / name
    if parquet is not None:
        parquet.to_parquet(p)
    elif rows is not None:
        _write_jsonl(p, rows)
    return p


def _cases(tmp_path):
    import pandas as pd

    return [
        (tmp_path / "nope.jsonl", ["no such file"]),
        (_bad(tmp_path, "empty.jsonl", rows=[]), ["empty file"]),
        (_bad(tmp_path, "empty.parquet", parquet=pd.DataFrame({"prompt": [], "response": []})), ["empty file"]),
        (_bad(tmp_path, "nocol.jsonl", rows=[{"prompt": "p", "text": "t"}]),
         ["missing required columns", "'prompt'", "'response'", "found ['prompt', 'text']"]),
        (_bad(tmp_path, "nocol.parquet", parquet=pd.DataFrame({"prompt": ["p"], "answer": ["a"]})),
         ["missing required columns ['response']", "found ['prompt', 'answer']"]),
        (_bad(tmp_path, "nan.jsonl", rows=[{"prompt": "p", "response": "r", "reward": 1.0},
                                           '{"prompt": "p", "response": "r", "reward": NaN}']),
         ["non-finite", "reward", "line 2"]),
        (_bad(tmp_path, "nan_dump.jsonl", rows=['{"input": "p", "output": "r", "score": Infinity, "step": 1}']),
         ["non-finite", "score", "line 1"]),
        (_bad(tmp_path, "inf_adv.parquet", parquet=pd.DataFrame(
            {"prompt": ["p", "p", "p"], "response": ["a", "b", "c"], "advantage": [0.0, float("inf"), float("nan")]})),
         ["non-finite", "advantage", "row 1", "row 2"]),
        (_bad(tmp_path, "nonstr.jsonl", rows=[{"prompt": "p", "response": 42}]),
         ["'response' must be text", "line 1 (int)"]),
        (_bad(tmp_path, "badjson.jsonl", rows=["{not json"]), ["line 1 is not valid JSON"]),
    ]


def test_bad_input_matrix(tmp_path, tiny_model, capsys):
    for path, needles in _cases(tmp_path):
        out = tmp_path / f"out_{path.name}"
        assert cli_main(["analyze", "--model", tiny_model, "--data", str(path), "--out", str(out)]) == 2, path
        err = capsys.readouterr().err
        assert str(path) in err, err
        for n in needles:
            assert n in err, (path, n, err)
        assert not out.exists()
        with pytest.raises(aio.AnalysisInputError, match=str(path).replace(".", r"\.")):
            aio.load_records(path)
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, tiny_model, capsys):
    from verl_tokensel_cpu.tiny_model import _write_model

    small = tmp_path / "small_vocab_model"
    shutil.copytree(tiny_model, small)
    _write_model(small, 256, eos_id=2, pad_id=0, seed=0)  # tokenizer keeps its 384 tokens, the model has 256
    data = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 1 plus 2?", "response": "3"}])
    out = tmp_path / "out"
    assert cli_main(["analyze", "--model", str(small), "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "vocab mismatch" in err and str(small) in err and "384" in err and "256" in err
    assert not out.exists()
    # a separate tokenizer: both paths named
    assert cli_main(["analyze", "--model", str(small), "--tokenizer", tiny_model, "--data", str(data),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(small) in err and tiny_model in err
    assert not out.exists()


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    scores = [ts([0.5, 1.0, 2.0])]
    report = stats.build_report(scores)

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(areport, "plot_scatter", boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        areport.write_analysis(out, report, scores, None)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # an existing output folder keeps its contents and gets no partial files
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(RuntimeError):
        areport.write_analysis(out, report, scores, None)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and len(list(tmp_path.iterdir())) == 1
