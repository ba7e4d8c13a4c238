"""`verl-tokensel compare`: overlap / entropy-change numbers by hand, a model against itself and against
another seed, and the shared-tokenizer check."""

from __future__ import annotations

import json
import math

import pytest
import torch

from verl_tokensel.analysis import stats
from verl_tokensel.analysis.scorer import TokenScores
from verl_tokensel.cli.main import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ts(entropy, ids=None):
    h = torch.tensor(entropy, dtype=torch.float32)
    ids = torch.tensor(ids if ids is not None else list(range(len(entropy))), dtype=torch.long)
    z = torch.zeros_like(h)
    return TokenScores(ids, z, h, z, z)


def test_compare_entropies_by_hand():
    # 10 tokens, top-20% = 2. A's top: positions 0 (9) and 6 (8); B's top: 0 (7) and 3 (9).
    a = [_ts([9.0, 1.0, 1.0, 1.0, 2.0]), _ts([1.0, 8.0, 0.5, 0.5, 0.5])]
    b = [_ts([7.0, 1.0, 1.0, 9.0, 2.0]), _ts([1.5, 2.0, 0.5, 0.5, 0.0])]
    r = stats.compare_entropies(a, b)
    o = r["overlap"]
    assert o["top_count"] == 2
    assert o["share_of_a_top_in_b_top"] == pytest.approx(0.5)
    assert o["jaccard"] == pytest.approx(1 / 3)
    d = r["entropy_change"]
    # A's top: 7 - 9 = -2 and 2 - 8 = -6
    assert d["a_top"] == {"count": 2, "mean": pytest.approx(-4.0), "median": pytest.approx(-6.0),
                          "share_increased": 0.0}
    # rest: 0 0 8 0 | .5 0 0 -.5  -> mean 8/8 = 1, lower median 0, 2 of 8 increased
    assert d["rest"]["count"] == 8
    assert d["rest"]["mean"] == pytest.approx(1.0)
    assert d["rest"]["median"] == pytest.approx(0.0)
    assert d["rest"]["share_increased"] == pytest.approx(2 / 8)
    assert r["token_count"] == 10 and r["responses"] == 2


def test_compare_entropies_refuses_different_tokens():
    with pytest.raises(ValueError, match="different token ids"):
        stats.compare_entropies([_ts([1.0, 2.0], [1, 2])], [_ts([1.0, 2.0], [1, 3])])


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    base = tmp_path_factory.getbasetemp()
    return build_tiny_model_dir(base / "tiny_qwen2_seed0"), build_tiny_model_dir(base / "tiny_qwen2_seed1", seed=1)


@pytest.fixture()
def data(tmp_path):
    rows = []
    for s, (x, y) in enumerate([(12, 30), (7, 5), (81, 19)]):
        for k in range(3):
            rows.append({"input": f"user\nWhat is {x} plus {y}?\nassistant\n",
                         "output": f"Let's think step by step. {x} + {y} = {x + y + k}. So the result is {x + y + k}.",
                         "score": float(k == 0), "step": 1, "gts": str(x + y), "uid": f"s{s}_{k}_0"})
    p = tmp_path / "1.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_model_against_itself_overlap_one_and_no_change(tmp_path, tiny_models, data, capsys):
    a, _ = tiny_models
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--model-a", a, "--model-b", a, "--data", str(data), "--out", str(out)]) == 0
    assert "also in B's top-20%: 1 " in capsys.readouterr().out
    r = json.loads((out / "report.json").read_text())
    assert r["responses"] == 9 and r["token_count"] > 0
    assert r["overlap"]["share_of_a_top_in_b_top"] == 1.0 and r["overlap"]["jaccard"] == 1.0
    assert r["overlap"]["top_count"] == math.ceil(0.2 * r["token_count"])
    for g in r["entropy_change"].values():
        assert g["mean"] == 0.0 and g["median"] == 0.0 and g["share_increased"] == 0.0
    assert r["entropy_change"]["a_top"]["count"] + r["entropy_change"]["rest"]["count"] == r["token_count"]
    assert r["spearman_entropy_a_b"] == pytest.approx(1.0)
    png = (out / r["plots"][0]).read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 1000
    assert "86%" in (out / "report.md").read_text()


def test_model_against_another_seed_overlap_below_one(tmp_path, tiny_models, data):
    a, b = tiny_models
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--model-a", a, "--model-b", b, "--data", str(data), "--out", str(out)]) == 0
    r = json.loads((out / "report.json").read_text())
    o = r["overlap"]
    assert 0.0 <= o["share_of_a_top_in_b_top"] < 1.0
    assert o["jaccard"] <= o["share_of_a_top_in_b_top"]  # J = |A&B| / |A|B| <= |A&B| / |A| (equal sizes)
    assert r["entropy_change"]["a_top"]["mean"] != 0.0
    assert 0.0 <= r["entropy_change"]["rest"]["share_increased"] <= 1.0


def test_compare_refuses_models_with_different_tokenizers(tmp_path, tiny_models, data, capsys):
    from verl_tokensel_cpu.tiny_model import _write_model, build_tiny_tokenizer

    a, _ = tiny_models
    other = tmp_path / "other_tokenizer_model"
    tok = build_tiny_tokenizer(other, vocab_size=320)
    _write_model(other, len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"),
                 0)
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--model-a", a, "--model-b", str(other), "--data", str(data),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "do not share a tokenizer" in err and a in err and str(other) in err
    assert not out.exists()


def test_compare_help_has_worked_examples(capsys):
    with pytest.raises(SystemExit) as ex:
        cli_main(["compare", "--help"])
    assert ex.value.code == 0
    assert "verl-tokensel compare --model-a" in capsys.readouterr().out


def test_top_level_help_lists_analyze_and_compare(capsys):
    with pytest.raises(SystemExit) as ex:
        cli_main(["--help"])  # argparse %-formats subcommand help: a bare "%" would crash here
    assert ex.value.code == 0
    text = capsys.readouterr().out
    assert "analyze" in text and "compare" in text and "top-20% overlap" in text
