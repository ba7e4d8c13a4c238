"""`verl-tokensel demo`: dataset format, reward function, report, CLI arguments and orchestration.

The orchestration tests replace the pipeline launcher (``verl_tokensel_cpu.launch``) with a fake that
writes verl-style ``step:N - key:value`` lines; the real end-to-end runs are the ``slow`` tests at the
bottom: three verl pipelines (~10 min), and one through the Megatron engine (``--engine megatron``, 115 s on 2
cores).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from verl_tokensel_cpu.cli import demo as demo_cli
from verl_tokensel.cli.main import main as cli_main
from verl_tokensel_cpu.demo import report
from verl_tokensel_cpu.demo.dataset import DATA_SOURCE, all_problems, write_dataset
from verl_tokensel_cpu.demo.reward import compute_score, extract_answer


# ---------------------------------------------------------------- dataset

def test_dataset_schema_and_split(tmp_path):
    import pandas as pd

    train, val = write_dataset(tmp_path, n_val=32, seed=0)
    tr, va = pd.read_parquet(train), pd.read_parquet(val)
    assert len(tr) + len(va) == len(all_problems()) == 255 and len(va) == 32
    assert list(tr.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    for df, split in ((tr, "train"), (va, "val")):
        assert set(df["data_source"]) == {DATA_SOURCE} and set(df["ability"]) == {"math"}
        for i, row in enumerate(df.itertuples()):
            (msg,) = list(row.prompt)
            assert msg["role"] == "user" and "\\boxed{}" in msg["content"]
            assert row.reward_model["style"] == "rule"
            assert row.extra_info["split"] == split and row.extra_info["index"] == i
            # the ground truth is the value of the question (hand-checkable: "3 * 4" -> "12")
            assert row.reward_model["ground_truth"] == str(eval(row.extra_info["question"]))  # noqa: S307
            assert row.extra_info["question"] in msg["content"]
    assert not set(tr["extra_info"].map(lambda e: e["question"])) & set(va["extra_info"].map(lambda e: e["question"]))
    # deterministic
    again = write_dataset(tmp_path / "again", n_val=32, seed=0)
    assert pd.read_parquet(again[1]).equals(va)


def test_dataset_rejects_bad_split(tmp_path):
    with pytest.raises(ValueError, match="n_val"):
        write_dataset(tmp_path, n_val=255)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    return AutoTokenizer.from_pretrained(build_tiny_model_dir(tmp_path_factory.mktemp("demo") / "model"))


def test_tokenizer_covers_dataset_and_prompts_fit(tmp_path, tiny_tokenizer):
    """Every prompt and answer round-trips through the tiny tokenizer, and fits max_prompt_length."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train, val = write_dataset(tmp_path)
    for question, answer in all_problems():
        for text in (question, f"\\boxed{{{answer}}}"):
            assert tiny_tokenizer.decode(tiny_tokenizer(text)["input_ids"]) == text
    config = OmegaConf.create({"max_prompt_length": demo_cli.MAX_PROMPT_LENGTH, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "cache")})
    for path, n in ((train, 223), (val, 32)):
        ds = RLHFDataset([path], tiny_tokenizer, config)
        assert len(ds) == n  # nothing filtered as too long
        item = ds[3]
        assert item["raw_prompt"][0]["role"] == "user" and item["reward_model"]["ground_truth"]
        assert item["data_source"] == DATA_SOURCE
        ids = tiny_tokenizer.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=False)
        assert len(tiny_tokenizer(ids)["input_ids"]) <= demo_cli.MAX_PROMPT_LENGTH


# ---------------------------------------------------------------- reward

@pytest.mark.parametrize("solution, truth, expected", [
    ("\\boxed{7}", "7", 1.0),
    ("3 + 4 = 7. The answer is \\boxed{7}.", "7", 1.0),
    ("so 3 + 4 = 7.", "7", 1.0),               # no box: the last number
    ("the answer is 07", "7", 1.0),
    ("\\boxed{ 12 }", "12", 1.0),
    ("\\boxed{\\frac{14}{2}}", "7", 1.0),       # math-verify path (nested braces)
    ("7.0", "7", 1.0),                          # math-verify path
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{8}", "7", 0.0),
    ("\\boxed{7} no wait \\boxed{8}", "7", 0.0),  # the last box counts
    ("7 + 1 = 8", "7", 0.0),
    ("", "7", 0.0),
    ("no digits at all", "7", 0.0),
    ("\\boxed{", "7", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("}}{{\\boxed{{{ \\frac{ \\\\ $$ ^_", "7", 0.0),
])
def test_reward(solution, truth, expected):
    assert compute_score(DATA_SOURCE, solution, truth, extra_info={"split": "train", "index": 0}) == expected


def test_extract_answer():
    assert extract_answer("x \\boxed{1} y \\boxed{\\frac{1}{2}} z 9") == "\\frac{1}{2}"
    assert extract_answer("a 1 b 2.5 c") == "2.5"
    assert extract_answer("nothing") is None


def test_reward_never_raises_on_garbage_and_works_off_the_main_thread():
    """verl calls reward functions from a thread pool, where math-verify's signal timeouts cannot work."""
    rng = random.Random(0)
    alphabet = "0123456789+-*/=\\{}()[]^_$ .,abcxyzboxedfrac\n\x00\u00ff"
    garbage = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 400))) for _ in range(150)]
    garbage += [None, 12, b"\xff\xfe", "\\boxed{" * 50, "1" * 5000]
    results = {}

    def score_all():
        results["thread"] = [compute_score(DATA_SOURCE, g, "7") for g in garbage]

    t = threading.Thread(target=score_all)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive()
    assert all(s in (0.0, 1.0) for s in results["thread"])
    assert compute_score(DATA_SOURCE, "\\boxed{\\frac{21}{3}}", "7") == 1.0  # math-verify, main thread
    out = []
    t = threading.Thread(target=lambda: out.append(compute_score(DATA_SOURCE, "\\boxed{\\frac{21}{3}}", "7")))
    t.start()
    t.join(timeout=60)
    assert out == [1.0]


def test_reward_loads_through_verl_config_path():
    """The exact path/name the demo passes reach the function through verl's own loader."""
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=demo_cli.REWARD_FN, object_name="compute_score")
    assert fn(DATA_SOURCE, "\\boxed{5}", "5", extra_info=None) == 1.0


# ---------------------------------------------------------------- task and warm start

def test_trace_template_and_decision_spans():
    from verl_tokensel_cpu.demo.task import decision_spans, route_of, trace

    text = trace("3 * 4", 12)
    assert text == "Compute 3 * 4. Let's think step by step. 3 * 4 = 12. So the answer is \\boxed{12}."
    (r0, r1), (v0, v1) = decision_spans(text)
    assert text[r0:r1] == "think" and text[v0:v1] == "12" and text[:v0].endswith("3 * 4 = ")
    guess = trace("3 * 4", 13, "guess")
    assert guess == "Compute 3 * 4. Let's guess. 3 * 4 = 13. So the answer is \\boxed{13}."
    assert [guess[a:b] for a, b in decision_spans(guess)] == ["guess", "13"]
    assert route_of(text) == "think" and route_of(guess) == "guess" and route_of("\\boxed{1}") is None
    assert compute_score(DATA_SOURCE, text, "12") == 1.0 and compute_score(DATA_SOURCE, guess, "12") == 0.0
    assert decision_spans("the answer is \\boxed{12}") == []
    with pytest.raises(ValueError, match="route="):
        trace("3 * 4", 12, "hope")


def test_warmup_route_and_value_distribution():
    from verl_tokensel_cpu.demo.task import NEAR_MISS_OFFSETS, warmup_route, warmup_value

    rng = random.Random(0)
    routes = [warmup_route(0.4, rng) for _ in range(20000)]
    assert abs(routes.count("think") / len(routes) - 0.4) < 0.015  # binomial SE 0.0035
    assert set(routes) == {"think", "guess"}
    assert {warmup_value(7, "think", rng) for _ in range(50)} == {7}
    assert {warmup_value(7, "guess", rng) for _ in range(500)} == {7 + d for d in NEAR_MISS_OFFSETS}
    assert {warmup_value(0, "guess", rng) for _ in range(200)} <= {1, 2}  # no negative answers, never right


def test_decision_token_mask(tiny_tokenizer):
    from verl_tokensel.analysis.page import token_texts
    from verl_tokensel_cpu.demo.task import decision_token_mask, trace

    for route, word in (("think", "think"), ("guess", "guess")):
        text = trace("9 * 9", 81, route)
        ids = tiny_tokenizer(text)["input_ids"]
        texts = token_texts(tiny_tokenizer, tiny_tokenizer("x")["input_ids"], ids)
        assert "".join(texts) == text
        mask = decision_token_mask(texts, text)
        picked = [t for t, m in zip(texts, mask) if m]
        # the route word's tokens, then "81" after "=" (digits are single tokens in a Qwen2 tokenizer)
        assert "".join(picked).replace(" ", "") == word + "81" and picked[-2:] == ["8", "1"]
        assert not any(decision_token_mask(texts[:5], "".join(texts[:5])))


def test_warm_up_learns_the_template_and_is_cached(tmp_path):
    """A short warm-up: the template becomes near-deterministic, the cache is keyed by the settings."""
    from verl_tokensel_cpu.demo.warmup import WarmupConfig, warm_model_dir

    cfg = WarmupConfig(steps=150, batch_size=16)
    path, info = warm_model_dir(cfg, cache_dir=tmp_path)
    assert Path(path).name == f"warm-{cfg.key()}" and info["problems"] == 223
    assert info["final_loss"] < 1.0  # from ~6 (uniform over 384 tokens); the noisy-label floor is ~0.04
    assert 0.0 <= info["accuracy"] <= 1.0
    again, info2 = warm_model_dir(cfg, cache_dir=tmp_path)
    assert again == path and info2 == info  # reused, not retrained
    assert WarmupConfig(steps=151, batch_size=16).key() != cfg.key()
    assert WarmupConfig(q=0.3).key() != WarmupConfig().key()
    with pytest.raises(ValueError, match="q="):
        WarmupConfig(q=0.0)


def test_analyse_rollouts_on_a_dump(tmp_path):
    """Shares over a dump of templated answers, under the random tiny model."""
    from verl_tokensel_cpu.demo.rollouts import analyse_rollouts, last_step_file
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    model = build_tiny_model_dir(tmp_path / "tiny")
    _write_fake_dump(tmp_path / "dump", 3)
    _write_fake_dump(tmp_path / "dump", 12)
    dump = last_step_file(tmp_path / "dump")
    assert dump.name == "12.jsonl"
    none = analyse_rollouts(dump, model, "none", tmp_path / "none.html")
    fork = analyse_rollouts(dump, model, "forking", tmp_path / "fork.html")
    bottom = analyse_rollouts(dump, model, "forking_bottom", tmp_path / "bottom.html")
    assert none["responses"] == 8 and none["on_template_share"] == 1.0
    # 8 answers; the decided values of problems 0..3 and their +1 misses are 1-2 digit tokens each
    assert 8 <= none["decision_token_share"] * none["response_tokens"] <= 16
    assert none["selected_on_decision_share"] == none["decision_token_share"] and none["decision_selected_share"] == 1.0
    assert fork["decision_token_share"] == none["decision_token_share"]
    # a random model has entropy ~log(vocab) everywhere: nothing under 0.01 nats
    assert none["entropy_below_0_01_share"] == 0.0 and 5.0 < none["entropy_p80"] < 6.0
    # forking keeps 20%, the bottom control 80%: together they cover each decision token at least once
    assert fork["decision_selected_share"] + bottom["decision_selected_share"] >= 1.0
    assert "<!DOCTYPE html>" in (tmp_path / "fork.html").read_text()


# ---------------------------------------------------------------- report

def _fake_steps(preset: str, n: int = 3) -> list[dict]:
    steps = []
    for i in range(n):
        m = {"critic/score/mean": 0.1 * i, "perf/throughput": 100.0 * (i + 1), "actor/entropy": 5.0,
             "training/global_step": i + 1}
        if preset != "none":
            m.update({"actor/tokensel/selected_fraction": 0.2, "actor/tokensel/entropy_selected": 5.5,
                      "actor/tokensel/entropy_unselected": 4.5})
        steps.append(m)
    return steps


def test_summarise_and_table():
    none = report.summarise("none", _fake_steps("none"), wall_s=100.0)
    fork = report.summarise("forking", _fake_steps("forking"))
    # rewards 0, 0.1, 0.2: first 0, last 0.2, mean 0.1; throughput mean over steps 2..3 = (200 + 300) / 2
    assert fork.reward_first == 0.0 and fork.reward_last == pytest.approx(0.2)
    assert fork.reward_mean == pytest.approx(0.1)
    assert fork.tokens_per_s == pytest.approx(250.0) and fork.steps == 3
    assert (fork.selected_fraction == pytest.approx(0.2) and fork.entropy_selected == 5.5
            and fork.entropy_unselected == 4.5)
    assert none.selected_fraction == 1.0 and none.entropy_selected is None and none.entropy_all == 5.0
    table = report.format_table([none, fork])
    lines = table.splitlines()
    assert lines[0].split()[0] == "preset" and lines[2].startswith("none") and lines[3].startswith("forking")
    assert "0.200" in lines[3] and "250" in lines[3] and " - " in lines[2] + " "
    assert len({len(line) for line in lines}) == 1  # fixed width
    assert report.summarise("x", []).reward_last is None
    assert fork.learned is None  # no responses_per_step: no verdict


def test_noise_margin():
    # p = 0.5 at both steps, 100 answers each: 2 sqrt(0.25 / 100 + 0.25 / 100) = 0.1414
    assert report.noise_margin(0.5, 0.5, 100) == pytest.approx(0.14142, abs=1e-5)
    assert report.noise_margin(0.0, 0.0, 10) == 0.0
    row = report.summarise("forking", [{"critic/score/mean": 0.40}, {"critic/score/mean": 0.48}],
                           responses_per_step=128)
    assert row.reward_gain == pytest.approx(0.08) and row.learned is False  # 0.08 < 2 SE = 0.124
    # 8 steps: means of the first 3 (0.4) and last 3 (0.5) over 384 answers each; 2 SE = 0.0714
    rewards = [0.3, 0.5, 0.4, 0.9, 0.0, 0.45, 0.5, 0.55]
    row = report.summarise("forking", [{"critic/score/mean": r} for r in rewards], responses_per_step=128)
    assert row.reward_first == 0.3 and row.reward_last == 0.55
    assert row.reward_gain == pytest.approx(0.1) and row.noise_margin == pytest.approx(0.0714, abs=1e-4)
    assert row.learned is True


def test_metric_lookup():
    assert report.metric({"actor/tokensel/selected_fraction": 0.3}, "tokensel/selected_fraction") == 0.3
    assert report.metric({"tokensel/selected_fraction": 0.4}, "tokensel/selected_fraction") == 0.4
    assert report.metric({"x/notsel/selected_fraction": 0.4}, "tokensel/selected_fraction") is None
    assert report.metric({"critic/rewards/mean": float("nan")}, *report.REWARD_KEYS) is None
    assert report.metric({"critic/rewards/mean": 0.5}, *report.REWARD_KEYS) == 0.5


def test_plot_writes_png(tmp_path):
    runs = {p: _fake_steps(p) for p in ("none", "forking", "gmts")}
    path = report.plot(runs, tmp_path / "demo.png", [report.summarise(p, steps) for p, steps in runs.items()])
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- CLI

def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "verl-tokensel demo --out" in out and "--presets" in out and "none,forking,gmts" in out


@pytest.mark.parametrize("argv, message", [
    (["--presets", "none,bogus"], "unknown preset(s) bogus; valid: none, forking"),
    (["--presets", ","], "no preset given"),
    (["--presets", "gmts,gmts"], "listed twice"),
    (["--steps", "0"], "must be > 0"),
    (["--timeout", "abc"], "is not a number"),
    (["--engine", "fsdp"], "invalid choice: 'fsdp' (choose from"),
])
def test_bad_arguments_fail_before_anything_runs(tmp_path, capsys, argv, message):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--out", str(out), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def _write_fake_dump(dump_dir: Path, step: int) -> None:
    """A verl rollout dump (``<step>.jsonl``) of templated answers: per prompt one right, one wrong."""
    from verl_tokensel_cpu.demo.dataset import prompt_text
    from verl_tokensel_cpu.demo.task import trace

    dump_dir.mkdir(parents=True, exist_ok=True)
    with open(dump_dir / f"{step}.jsonl", "w") as f:
        for j, (question, answer) in enumerate(all_problems()[:4]):
            for k, value in enumerate((answer, int(answer) + 1)):
                f.write(json.dumps({"input": f"user\n{prompt_text(question)}\nassistant\n",
                                    "output": trace(question, value), "gts": answer, "score": float(k == 0),
                                    "step": step, "uid": f"sample{j}_{k}_0"}) + "\n")


@pytest.fixture
def random_warm_start(monkeypatch, tmp_path):
    """The orchestration tests skip the supervised warm-up (tested on its own): the demo gets the random
    tiny model as its 'warm' model."""
    from verl_tokensel_cpu.demo import warmup
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    def warm_model_dir(cfg, cache_dir=None, progress=None):
        return build_tiny_model_dir(tmp_path / "tiny"), {"accuracy": 0.0, "problems": 223}

    monkeypatch.setattr(warmup, "warm_model_dir", warm_model_dir)


def _fake_launch(fail_preset: str | None = None):
    """A stand-in for verl_tokensel_cpu.launch: writes the console and file-logger output verl would."""
    from verl_tokensel_cpu import launch

    calls = []

    def run_main_ppo(overrides, *, timeout_s, log_path, cpu=True, metrics_path=None):
        assert cpu is True and timeout_s > 0
        ov = dict(o.split("=", 1) for o in overrides)
        preset = ov["actor_rollout_ref.actor.token_selector"]
        assert ov["reward.custom_reward_function.path"] == demo_cli.REWARD_FN
        assert Path(ov["data.train_files"]).exists() and Path(ov["actor_rollout_ref.model.path"]).is_dir()
        calls.append(preset)
        n_steps = int(ov["trainer.total_training_steps"])
        steps = _fake_steps(preset, n_steps)
        returncode = 0
        _write_fake_dump(Path(ov["trainer.rollout_data_dir"]), n_steps)
        with open(log_path, "w") as log, open(metrics_path, "w") as mf:
            log.write("ray init kwargs: {}\n")
            if preset == fail_preset:
                log.write("Traceback (most recent call last):\nRuntimeError: boom in the actor\n")
                returncode, steps = 1, []
            for i, m in enumerate(steps, 1):
                log.write(f"step:{i} - " + " - ".join(f"{k}:{v}" for k, v in m.items()) + "\n")
                mf.write(json.dumps({"step": i, "data": m}) + "\n")
        return launch.RunResult(returncode=returncode, timed_out=False, wall_s=1.0, log_path=Path(log_path),
                                metrics_path=Path(metrics_path), command=[], steps=launch.read_metrics(metrics_path),
                                last_stage=launch.last_stage(Path(log_path).read_text()))

    fake = types.SimpleNamespace(run_main_ppo=run_main_ppo, read_metrics=launch.read_metrics,
                                 last_stage=launch.last_stage, stop_on_signals=launch.stop_on_signals,
                                 Interrupted=launch.Interrupted)
    return fake, calls


def test_demo_orchestration_with_fake_launcher(tmp_path, monkeypatch, capsys, random_warm_start):
    fake, calls = _fake_launch()
    monkeypatch.setitem(sys.modules, "verl_tokensel_cpu.launch", fake)
    monkeypatch.setattr("verl_tokensel_cpu.launch", fake, raising=False)
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out), "--steps", "2"]) == 0
    assert calls == ["none", "forking", "gmts"]
    captured = capsys.readouterr()
    table = [ln for ln in captured.out.splitlines() if ln.startswith(("none", "forking", "gmts"))]
    assert [ln.split()[0] for ln in table] == ["none", "forking", "gmts"]
    assert "[1/3] none" in captured.err and "[3/3] gmts: done" in captured.err
    assert (out / "demo.png").read_bytes()[:4] == b"\x89PNG"
    results = json.loads((out / "results.json").read_text())
    assert [r["preset"] for r in results["summary"]] == ["none", "forking", "gmts"]
    assert results["summary"][1]["selected_fraction"] == pytest.approx(0.2) and len(results["steps"]["gmts"]) == 2
    assert (out / "data" / "train.parquet").exists() and Path(results["warm_start"]["model"], "config.json").exists()
    # the last step's rollouts: 8 templated answers, each with its decided value's tokens
    for row in results["summary"]:
        for key in ("reward_first", "reward_last", "entropy_below_0_01_share", "entropy_p80",
                    "selected_on_decision_share", "decision_token_share"):
            assert row[key] is not None, (row["preset"], key)
        assert 0 < row["decision_token_share"] < 0.2
        # fake rewards 0.0 -> 0.1 (k = 1 of 2 steps), 128 answers a step: gain 0.1 > 2 sqrt(0.09 / 128) = 0.053
        assert row["reward_gain"] == pytest.approx(0.1) and row["noise_margin"] == pytest.approx(0.053, abs=1e-3)
        assert row["learned"] is True
    rows = {r["preset"]: r for r in results["summary"]}
    assert rows["none"]["selected_on_decision_share"] == rows["none"]["decision_token_share"]  # all tokens
    assert results["rollouts"]["forking"]["scored_with"] == "warm start"  # the fake run saved no checkpoint
    for preset in ("none", "forking", "gmts"):
        page = out / f"view_{preset}.html"
        assert page.read_text().startswith("<!DOCTYPE html>") and str(page) in captured.out
    assert "total wall time" in captured.out and str(out / "demo.png") in captured.out


def test_demo_failure_names_preset_log_and_tail(tmp_path, monkeypatch, capsys, random_warm_start):
    fake, calls = _fake_launch(fail_preset="forking")
    monkeypatch.setitem(sys.modules, "verl_tokensel_cpu.launch", fake)
    monkeypatch.setattr("verl_tokensel_cpu.launch", fake, raising=False)
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out), "--steps", "1"]) == 1
    assert calls == ["none", "forking"]  # stops at the first failure
    err = capsys.readouterr().err
    assert "token_selector=forking failed: main_ppo exited with code 1" in err
    assert str(out / "logs" / "forking.log") in err and "RuntimeError: boom in the actor" in err


def test_demo_engine_reaches_every_run(tmp_path, monkeypatch, capsys, random_warm_start):
    """``--engine megatron`` reaches the launched run's overrides and results.json (the fake launcher)."""
    from verl_tokensel_cpu.megatron import megatron_available

    if megatron_available():
        pytest.skip(megatron_available())
    fake, calls = _fake_launch()
    launched, fake_run = [], fake.run_main_ppo

    def run_main_ppo(overrides, **kw):
        launched.append(list(overrides))
        return fake_run(overrides, **kw)

    fake.run_main_ppo = run_main_ppo
    monkeypatch.setitem(sys.modules, "verl_tokensel_cpu.launch", fake)
    monkeypatch.setattr("verl_tokensel_cpu.launch", fake, raising=False)
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out), "--steps", "1", "--presets", "forking", "--engine", "megatron"]) == 0
    assert calls == ["forking"] and launched[0][0] == "model_engine=megatron"
    assert json.loads((out / "results.json").read_text())["settings"]["engine"] == "megatron"
    assert "[1/1] forking: verl GRPO (megatron)" in capsys.readouterr().err


def test_launch_problem(tmp_path):
    from verl_tokensel_cpu.launch import RunResult

    def result(**kw):
        base = dict(returncode=0, timed_out=False, wall_s=5.0, log_path=tmp_path / "x.log",
                    metrics_path=tmp_path / "x.jsonl", command=[], steps=[{"step": 1}, {"step": 2}])
        return RunResult(**{**base, **kw})

    assert "timed out" in demo_cli.launch_problem(result(timed_out=True, returncode=124), 3)
    assert demo_cli.launch_problem(result(timed_out=True, returncode=124), 2) is None  # killed in shutdown
    assert "exited with code 1" in demo_cli.launch_problem(result(returncode=1), 2)
    assert demo_cli.launch_problem(result(), 3).startswith("logged 2 of 3 training steps")
    assert demo_cli.launch_problem(result(), 2) is None


def test_demo_overrides_compose(tmp_path):
    """Every key the demo sets exists in the composed config (Hydra rejects unknown keys)."""
    import yaml

    overrides = demo_cli.demo_overrides("gmts", "/m", "/d/train.parquet", "/d/val.parquet", tmp_path, steps=3)
    proc = subprocess.run([sys.executable, "-m", "verl_tokensel.main_ppo", *overrides, "--cfg", "job"],
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, RAY_ADDRESS=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = yaml.safe_load(proc.stdout)
    assert job["reward"]["custom_reward_function"] == {"path": demo_cli.REWARD_FN, "name": "compute_score"}
    assert job["actor_rollout_ref"]["actor"]["token_selector"] == "gmts"
    assert (job["trainer"]["total_training_steps"] == 3
            and job["actor_rollout_ref"]["rollout"]["n"] == demo_cli.ROLLOUT_N)
    assert job["algorithm"]["adv_estimator"] == "grpo"
    assert job["actor_rollout_ref"]["actor"]["calculate_entropy"] is True


def test_engine_option_composes_the_megatron_run(tmp_path):
    """``--engine megatron``: the engine's override from ``launch.ENGINE_OVERRIDES`` (the one the Megatron pipeline
    tests run) ahead of the same run settings; composed, it is verl's Megatron actor with the demo's settings, and
    the CPU switch accepts it, filling the Megatron settings and the shims' variable. In-process Hydra, no Ray, ~3 s."""
    import argparse

    from hydra import compose, initialize_config_module

    from verl_tokensel_cpu.megatron import SHIMS_ENV, megatron_available
    from verl_tokensel_cpu.pipeline import apply_cpu_pipeline, cli_override_keys
    from verl_tokensel_cpu.launch import ENGINE_OVERRIDES

    parser = argparse.ArgumentParser()
    demo_cli.add_arguments(parser)
    assert parser.parse_args([]).engine == "fsdp2" and parser.parse_args(["--engine", "megatron"]).engine == "megatron"
    args = ("forking", "/m", "/d/train.parquet", "/d/val.parquet", tmp_path)
    fsdp2 = demo_cli.demo_overrides(*args, steps=3)
    megatron = demo_cli.demo_overrides(*args, steps=3, engine="megatron")
    assert ENGINE_OVERRIDES["megatron"] == ("model_engine=megatron",) and ENGINE_OVERRIDES["fsdp2"] == ()
    assert megatron == ["model_engine=megatron", *fsdp2]
    assert demo_cli.demo_overrides(*args, steps=3, engine="fsdp2") == fsdp2
    with pytest.raises(ValueError, match="engine='fsdp' is not an engine of the demo; valid: fsdp2, megatron"):
        demo_cli.demo_overrides(*args, steps=3, engine="fsdp")
    # the final policy: where each engine's checkpoint keeps the HF weights
    step_3 = tmp_path / "checkpoints/forking/global_step_3"
    assert demo_cli.final_model_dir(tmp_path, "forking", 3) == step_3 / "actor/huggingface"
    assert demo_cli.final_model_dir(tmp_path, "forking", 3, "megatron") == step_3 / "actor/model/huggingface"
    if megatron_available():
        pytest.skip(megatron_available())
    overrides = ["trainer.device=cpu", *megatron]
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=overrides)
    env = apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys(overrides), environ={})
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and actor.megatron.dtype == "float32" and actor.megatron.vanilla_mbridge
    assert actor.token_selector == "forking" and actor.calculate_entropy is True
    assert list(actor.checkpoint.save_contents) == ["hf_model"] and cfg.trainer.total_training_steps == 3
    assert env[SHIMS_ENV] == "1"


# ---------------------------------------------------------------- the real thing

@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_demo_end_to_end(tmp_path):
    """Warm-up plus three real verl GRPO pipelines on CPU (~10-15 min, ~6 GB each, one at a time)."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", "demo", "--out", str(out), "--steps", "2"],
                          capture_output=True, text=True, timeout=1400, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    rows = {r["preset"]: r for r in results["summary"]}
    assert set(rows) == {"none", "forking", "gmts"}
    assert rows["none"]["selected_fraction"] == 1.0
    for preset in ("forking", "gmts"):
        assert 0.15 <= rows[preset]["selected_fraction"] <= 0.3, rows[preset]
        assert rows[preset]["entropy_selected"] is not None and rows[preset]["entropy_unselected"] is not None
    assert all(r["steps"] == 2 and r["reward_mean"] is not None for r in rows.values())
    assert (out / "demo.png").exists()
    for preset, row in rows.items():
        assert row["reward_first"] is not None and row["reward_last"] is not None
        # the warm start's structure: most response tokens near-deterministic, the decisions (route word and
        # value) a small share (~0.1: a few of the ~20-30 tokens of an answer)
        assert row["entropy_below_0_01_share"] > 0.5 and 0 < row["decision_token_share"] < 0.2, row
        assert 0 < row["think_share"] < 1, row  # both routes still taken after 2 steps
        assert results["rollouts"][preset]["scored_with"] == "final policy"  # verl saved the HF checkpoint
        assert (out / f"view_{preset}.html").exists()
    # forking keeps the top 20% by entropy: the decision tokens are among them
    assert rows["forking"]["selected_on_decision_share"] > 2 * rows["forking"]["decision_token_share"]


@pytest.mark.slow  # 115 s on 2 cores (warm start cached): a Megatron GRPO pipeline; CI's time is spent
@pytest.mark.timeout(1500)
def test_demo_megatron_end_to_end(tmp_path):
    """``--engine megatron``: the warm start, then one real verl GRPO run through the Megatron engine (``forking``,
    2 steps): vLLM runs on the weights Megatron exports, and the final policy is read from the Megatron checkpoint's
    HF folder."""
    from verl_tokensel_cpu.megatron import SHIMS_ANNOUNCEMENT, megatron_available

    if megatron_available():
        pytest.skip(megatron_available())
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", "demo", "--out", str(out), "--steps", "2",
                           "--presets", "forking", "--engine", "megatron"],
                          capture_output=True, text=True, timeout=1400, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["engine"] == "megatron"
    (row,) = results["summary"]
    assert row["preset"] == "forking" and row["steps"] == 2 and 0.15 <= row["selected_fraction"] <= 0.3, row
    assert row["entropy_selected"] is not None and row["entropy_unselected"] is not None
    # vLLM's log-probs equal the actor's after each weight sync (Megatron -> mbridge -> vLLM)
    assert all(s["training/rollout_probs_diff_max"] < 1e-4 for s in results["steps"]["forking"]), results["steps"]
    assert results["rollouts"]["forking"]["scored_with"] == "final policy"  # actor/model/huggingface was found
    assert row["selected_on_decision_share"] > 2 * row["decision_token_share"], row
    assert SHIMS_ANNOUNCEMENT.split("{pid}")[0] in (out / "logs" / "forking.log").read_text(errors="replace")


@pytest.mark.parametrize("preset", ["kl_cov_global", "clip_cov_global", "archer"])
def test_demo_composes_the_toolbox_presets(tmp_path, preset):
    """The demo's overrides for each toolbox preset compose and resolve to the preset (archer gets the KL loss
    its per-token KL weight needs, and its reference worker's micro-batch). In-process Hydra, no Ray."""
    from hydra import compose, initialize_config_module

    from verl.utils.config import omega_conf_to_dataclass
    from verl_tokensel.core.config import PRESETS

    overrides = demo_cli.demo_overrides(preset, "/m", "/d/train.parquet", "/d/val.parquet", tmp_path, steps=3)
    assert ("actor_rollout_ref.actor.use_kl_loss=True" in overrides) == (preset == "archer")
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=overrides)
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).selection == PRESETS[preset]
