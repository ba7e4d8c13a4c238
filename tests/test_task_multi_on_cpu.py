"""The multi-decision demo task (``verl-tokensel demo --task multi``): template, decisions, reward, dataset, warm-up
keying, the CLI's ``--task``, the orchestration and the benchmark's table; a real short demo run is ``slow``.

The orchestration test replaces the pipeline launcher with a fake that writes verl-style metrics and a rollout dump
of templated multi-step answers (as ``tests/test_demo_on_cpu.py`` does for the route task).
"""

from __future__ import annotations

import importlib.util
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
from verl_tokensel_cpu.demo import dataset_multi, task_multi
from verl_tokensel_cpu.demo.reward_multi import compute_score
from verl_tokensel_cpu.demo.tasks import TASK_NAMES, get_task

QS = ["3 + 4", "5 * 2", "7 - 1", "9 * 9"]
RIGHT = [7, 10, 6, 81]


# ---------------------------------------------------------------- template and decisions

def test_trace_template_steps_and_spans():
    text = task_multi.trace(QS, [7, 11, 6, 81], ["think", "guess", "think", "think"])
    assert text == ("Let's think. 3 + 4 = 7. Let's guess. 5 * 2 = 11. Let's think. 7 - 1 = 6. "
                    "Let's think. 9 * 9 = 81. So \\boxed{7,11,6,81}.")
    assert task_multi.steps_of(text) == [("think", 7), ("guess", 11), ("think", 6), ("think", 81)]
    assert task_multi.routes_of(text) == ["think", "guess", "think", "think"]
    assert [text[a:b] for a, b in task_multi.decision_spans(text)] == ["think", "7", "guess", "11", "think", "6",
                                                                        "think", "81"]
    assert [text[a:b] for a, b in task_multi.route_spans(text)] == ["think", "guess", "think", "think"]
    assert task_multi.think_counts(text) == (3, 4) and task_multi.route_of(text) == "guess"
    right = task_multi.trace(QS, RIGHT, ["think"] * 4)
    assert task_multi.route_of(right) == "think" and task_multi.think_counts(right) == (4, 4)
    assert task_multi.route_of("\\boxed{7,10,6,81}") is None and task_multi.decision_spans("7 = 7") == []
    assert task_multi.ground_truth(["7", 10, "06", 81]) == "7,10,6,81"
    with pytest.raises(ValueError, match="route='hope': must be one of think, guess"):
        task_multi.trace(QS[:1], [7], ["hope"])
    with pytest.raises(ValueError, match="one per step"):
        task_multi.trace(QS, RIGHT, ["think"])


def test_warmup_example_draws_each_route_independently():
    from verl_tokensel_cpu.demo.dataset import split_problems

    problems = split_problems()[0]
    rng = random.Random(0)
    routes, all_think = [], 0
    for _ in range(4000):
        questions, values, rs = task_multi.warmup_example(problems, 4, 0.8, rng)
        assert len(set(questions)) == 4 and len(values) == 4  # distinct problems
        answers = dict(problems)
        for q, v, r in zip(questions, values, rs):
            assert (v == int(answers[q])) == (r == "think")  # think: the value; guess: a near miss, never right
        routes += rs
        all_think += rs == ["think"] * 4
    assert abs(routes.count("think") / len(routes) - 0.8) < 0.01  # binomial SE 0.003
    assert abs(all_think / 4000 - 0.8 ** 4) < 0.03  # 0.41; SE 0.008: the steps are independent


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    return AutoTokenizer.from_pretrained(build_tiny_model_dir(tmp_path_factory.mktemp("multi") / "model"))


def test_decision_token_mask(tiny_tokenizer):
    from verl_tokensel.analysis.page import token_texts

    text = task_multi.trace(QS, [7, 11, 6, 81], ["think", "guess", "think", "think"])
    texts = token_texts(tiny_tokenizer, tiny_tokenizer("x")["input_ids"], tiny_tokenizer(text)["input_ids"])
    assert "".join(texts) == text
    picked = [t for t, m in zip(texts, task_multi.decision_token_mask(texts, text)) if m]
    # each route word (think: one token; guess: its bytes' pieces, the first with the leading space) and each
    # written value's digits (single-digit tokens); the boxed copies are not decisions
    assert "".join(picked).replace(" ", "") == "think7guess11think6think81"
    routes = [t for t, m in zip(texts, task_multi.decision_token_mask(texts, text, routes_only=True)) if m]
    assert "".join(routes).replace(" ", "") == "thinkguessthinkthink"
    # where each route is chosen: ' think' is one token, 'guess' starts with a space token, then its pieces
    forks = [t for t, m in zip(texts, task_multi.decision_token_mask(texts, text, forks_only=True)) if m]
    assert forks == [" think", " ", " think", " think"]
    assert sum(task_multi.decision_token_mask(texts, text)) < 0.35 * len(texts)
    assert not any(task_multi.decision_token_mask(texts[-8:], "".join(texts[-8:])))  # the box alone
    # the route task through the registry: its route word alone, and its decisions as task.decision_token_mask
    from verl_tokensel_cpu.demo.task import decision_token_mask, trace

    one = trace("9 * 9", 81, "guess")
    texts = token_texts(tiny_tokenizer, tiny_tokenizer("x")["input_ids"], tiny_tokenizer(one)["input_ids"])
    route = get_task("route")
    assert route.decision_mask(texts, one) == decision_token_mask(texts, one)
    assert "".join(t for t, m in zip(texts, route.decision_mask(texts, one, routes_only=True)) if m).strip() == "guess"
    assert [t for t, m in zip(texts, route.decision_mask(texts, one, forks_only=True)) if m] == [" "]
    assert route.think_counts(one) == (0, 1) and route.think_counts("nothing") == (0, 0)


# ---------------------------------------------------------------- reward

@pytest.mark.parametrize("solution, expected", [
    (task_multi.trace(QS, RIGHT, ["think"] * 4), 1.0),
    ("\\boxed{7, 10, 6, 81}", 1.0),                 # spaces do not matter
    ("\\boxed{07,10,6,+81}", 1.0),                  # integers compared as integers
    (task_multi.trace(QS, [7, 11, 6, 81], ["think", "guess", "think", "think"]), 0.0),  # one wrong step
    ("\\boxed{7,10,6}", 0.0),                       # a value missing
    ("\\boxed{7,10,6,81,1}", 0.0),                  # one too many
    ("\\boxed{81,6,10,7}", 0.0),                    # order matters
    ("\\boxed{7,10,6,81} wait \\boxed{7,10,6,80}", 0.0),  # the last box counts
    ("Let's think. 3 + 4 = 7.", 0.0),               # no box
    ("\\boxed{7,10,6,8.1}", 0.0),
    ("\\boxed{", 0.0),
    ("", 0.0),
])
def test_reward(solution, expected):
    assert compute_score(dataset_multi.DATA_SOURCE, solution, "7,10,6,81") == expected


def test_reward_never_raises_and_loads_through_verl():
    from verl.utils.import_utils import load_extern_object

    rng = random.Random(0)
    alphabet = "0123456789,+-=\\{}boxed .\n\x00"
    garbage = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(200)]
    garbage += [None, 12, b"\xff", "\\boxed{" * 40]
    out = []
    t = threading.Thread(target=lambda: out.extend(compute_score("x", g, "7,10") for g in garbage))
    t.start()
    t.join(timeout=60)
    assert len(out) == len(garbage) and set(out) <= {0.0, 1.0}
    assert compute_score("x", "\\boxed{1}", "not,a,list") == 0.0
    fn = load_extern_object(module_path=get_task("multi").reward_fn, object_name="compute_score")
    assert fn(dataset_multi.DATA_SOURCE, "\\boxed{5,6}", "5,6", extra_info=None) == 1.0


# ---------------------------------------------------------------- dataset

def test_dataset_schema_split_and_lengths(tmp_path, tiny_tokenizer):
    import pandas as pd
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from verl_tokensel_cpu.demo.dataset import split_problems

    train, val = dataset_multi.write_dataset(tmp_path, k=4)
    tr, va = pd.read_parquet(train), pd.read_parquet(val)
    assert (len(tr), len(va)) == (dataset_multi.N_TRAIN, 32)
    assert list(tr.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    train_q, val_q = ({q for q, _ in part} for part in split_problems())
    for df, split, pool in ((tr, "train", train_q), (va, "val", val_q)):
        assert set(df["data_source"]) == {dataset_multi.DATA_SOURCE}
        for i, row in enumerate(df.itertuples()):
            questions = list(row.extra_info["questions"])
            assert len(set(questions)) == 4 and set(questions) <= pool  # no validation problem is trained on
            assert row.extra_info["split"] == split and row.extra_info["index"] == i
            # the ground truth is the questions' values, in order (hand-checkable: "3 * 4" -> 12)
            assert row.reward_model["ground_truth"] == ",".join(str(eval(q)) for q in questions)  # noqa: S307
            (msg,) = list(row.prompt)
            assert msg["content"] == dataset_multi.prompt_text(questions) and "\\boxed{}" in msg["content"]
    assert len({tuple(q) for q in tr["extra_info"].map(lambda e: tuple(e["questions"]))}) == len(tr)  # distinct
    again = pd.read_parquet(dataset_multi.write_dataset(tmp_path / "again", k=4)[0])  # deterministic
    assert [(list(e["questions"]), r["ground_truth"]) for e, r in zip(again["extra_info"], again["reward_model"])] == \
        [(list(e["questions"]), r["ground_truth"]) for e, r in zip(tr["extra_info"], tr["reward_model"])]
    assert dataset_multi.prompt_text(["1 + 2", "3 + 4"]) == ("What are 1 + 2 and 3 + 4? Put the final answers in "
                                                             "\\boxed{}.")
    with pytest.raises(ValueError, match="k=0"):
        dataset_multi.draw_prompts([("1 + 1", "2")], 0, 1, 0)
    # nothing is filtered as too long, and the longest right answer fits the response length
    spec = get_task("multi")
    config = OmegaConf.create({"max_prompt_length": spec.max_prompt_length, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "cache")})
    assert len(RLHFDataset([train], tiny_tokenizer, config)) == dataset_multi.N_TRAIN
    longest = task_multi.trace(["9 * 9", "8 * 9", "9 * 8", "8 * 8"], [83, 74, 74, 66], ["guess"] * 4)
    assert len(tiny_tokenizer(longest)["input_ids"]) + 1 <= spec.max_response_length  # + the end token


# ---------------------------------------------------------------- warm-up config

def test_warmup_keys_the_route_task_unchanged_and_the_multi_task_apart(tmp_path, monkeypatch):
    from verl_tokensel_cpu.demo import warmup

    # the route task's cache key and version as they were before the multi task existed: its cached warm starts
    # and committed results stay valid
    assert warmup.WARMUP_VERSION == 2 and warmup.WarmupConfig().key() == "3c1f42a66143"
    assert warmup.cache_name(warmup.WarmupConfig()) == "warm-3c1f42a66143"
    multi = warmup.MultiWarmupConfig()
    assert warmup.cache_name(multi) == f"warm-multi-{multi.key()}" and multi.key() != warmup.WarmupConfig().key()
    assert warmup.MultiWarmupConfig(k=3).key() != multi.key() and warmup.MultiWarmupConfig(q=0.7).key() != multi.key()
    assert get_task("multi").warmup_config(1) == warmup.MultiWarmupConfig(seed=1)
    assert get_task("route").warmup_config(1) == warmup.WarmupConfig(seed=1)
    with pytest.raises(ValueError, match="k=9"):
        warmup.MultiWarmupConfig(k=9)
    with pytest.raises(ValueError, match="q=0"):
        warmup.MultiWarmupConfig(q=0)
    # a short multi warm-up builds its own cache folder and records the task; reused, not retrained
    monkeypatch.setattr(warmup, "MULTI_STATS_PROMPTS", 8)
    cfg = warmup.MultiWarmupConfig(steps=40, batch_size=8, k=2)
    path, info = warmup.warm_model_dir(cfg, cache_dir=tmp_path)
    assert Path(path).name == f"warm-multi-{cfg.key()}" and info["task"] == "multi" and info["problems"] == 8
    assert info["final_loss"] < 3.0 and 0.0 <= info["accuracy"] <= 1.0  # from ~6 (uniform over 384 tokens)
    assert warmup.warm_model_dir(cfg, cache_dir=tmp_path) == (path, info)


# ---------------------------------------------------------------- CLI and overrides

@pytest.mark.parametrize("argv, message", [
    (["--task", "bogus"], "unknown task 'bogus'; valid: route, multi (default route)"),
    (["--task", ""], "unknown task ''; valid: route, multi"),
])
def test_bad_task_fails_before_anything_runs(tmp_path, capsys, argv, message):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "--out", str(out), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err and not out.exists()


def test_task_registry_and_help(capsys):
    assert TASK_NAMES == ("route", "multi")
    with pytest.raises(ValueError, match="task='x' is not a demo task; valid: route, multi"):
        get_task("x")
    with pytest.raises(SystemExit):
        cli_main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--task" in out and "verl-tokensel demo --task multi" in out


def test_overrides_per_task(tmp_path):
    """The route task's overrides are the demo's constants as before; the multi task's carry its reward and
    lengths, and compose (in-process Hydra, no Ray)."""
    from hydra import compose, initialize_config_module

    args = ("forking", "/m", "/d/train.parquet", "/d/val.parquet", tmp_path)
    route = dict(o.split("=", 1) for o in demo_cli.demo_overrides(*args, steps=3))
    assert route["reward.custom_reward_function.path"] == "pkg://verl_tokensel_cpu.demo.reward" == demo_cli.REWARD_FN
    assert (route["data.max_prompt_length"], route["data.max_response_length"]) == ("64", "48")
    assert (demo_cli.ACTOR_LR, demo_cli.DEFAULT_STEPS) == (3e-4, 12)
    assert demo_cli.demo_overrides(*args, steps=3) == demo_cli.demo_overrides(*args, steps=3, task="route")
    overrides = demo_cli.demo_overrides(*args, steps=3, task="multi")
    multi = dict(o.split("=", 1) for o in overrides)
    assert multi["reward.custom_reward_function.path"] == "pkg://verl_tokensel_cpu.demo.reward_multi"
    assert (multi["data.max_prompt_length"], multi["data.max_response_length"]) == ("80", "96")
    assert multi["actor_rollout_ref.rollout.max_model_len"] == "176"
    assert set(route) == set(multi)  # the same keys, only values differ
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=overrides)
    assert cfg.reward.custom_reward_function.path == get_task("multi").reward_fn
    assert cfg.data.max_response_length == 96


# ---------------------------------------------------------------- orchestration (fake launcher)

def _write_multi_dump(dump_dir: Path, step: int) -> None:
    """A verl rollout dump of templated multi-step answers: per prompt one all-right, one with a guessed step."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    prompts = dataset_multi.split_prompts(4)[0][:4]
    with open(dump_dir / f"{step}.jsonl", "w") as f:
        for j, (questions, truth) in enumerate(prompts):
            right = [int(v) for v in truth.split(",")]
            for k, routes in enumerate((["think"] * 4, ["think", "guess", "think", "think"])):
                values = [v + (r == "guess") for v, r in zip(right, routes)]
                f.write(json.dumps({"input": f"user\n{dataset_multi.prompt_text(questions)}\nassistant\n",
                                    "output": task_multi.trace(questions, values, routes), "gts": truth,
                                    "score": float(k == 0), "step": step, "uid": f"s{j}_{k}"}) + "\n")


def test_analyse_rollouts_multi(tmp_path):
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
    from verl_tokensel_cpu.demo.rollouts import analyse_rollouts

    model = build_tiny_model_dir(tmp_path / "tiny")
    _write_multi_dump(tmp_path / "dump", 2)
    none = analyse_rollouts(tmp_path / "dump" / "2.jsonl", model, "none", tmp_path / "none.html", task="multi")
    fork = analyse_rollouts(tmp_path / "dump" / "2.jsonl", model, "forking", tmp_path / "fork.html", task="multi")
    assert none["task"] == "multi" and none["responses"] == 8 and none["decision_steps"] == 32
    assert none["think_share"] == pytest.approx(28 / 32) and none["all_think_share"] == 0.5
    assert none["selected_share"] == 1.0 and none["selected_on_decision_share"] == none["decision_token_share"]
    assert none["selected_on_route_share"] == none["route_token_share"] < none["decision_token_share"] < 0.35
    assert none["fork_selected_share"] == 1.0 and none["fork_token_share"] * none["response_tokens"] == 32
    assert fork["selected_share"] == pytest.approx(0.2, abs=0.01)


@pytest.fixture
def fake_multi_pipeline(monkeypatch, tmp_path):
    from verl_tokensel_cpu import launch
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
    from verl_tokensel_cpu.demo import warmup

    def warm_model_dir(cfg, cache_dir=None, progress=None):
        assert isinstance(cfg, warmup.MultiWarmupConfig)
        return build_tiny_model_dir(tmp_path / "tiny"), {"task": "multi", "accuracy": 0.4, "think_share": 0.8,
                                                         "all_think_share": 0.4, "problems": 256}

    monkeypatch.setattr(warmup, "warm_model_dir", warm_model_dir)
    launched = []

    def run_main_ppo(overrides, *, timeout_s, log_path, cpu=True, metrics_path=None):
        ov = dict(o.split("=", 1) for o in overrides)
        launched.append(ov)
        n = int(ov["trainer.total_training_steps"])
        _write_multi_dump(Path(ov["trainer.rollout_data_dir"]), n)
        with open(log_path, "w") as log, open(metrics_path, "w") as mf:
            for i in range(1, n + 1):
                m = {"critic/score/mean": 0.4 + 0.02 * i, "actor/tokensel/selected_fraction": 0.2}
                log.write(f"step:{i} - " + " - ".join(f"{k}:{v}" for k, v in m.items()) + "\n")
                mf.write(json.dumps({"step": i, "data": m}) + "\n")
        return launch.RunResult(returncode=0, timed_out=False, wall_s=1.0, log_path=Path(log_path),
                                metrics_path=Path(metrics_path), command=[], steps=launch.read_metrics(metrics_path),
                                last_stage=None)

    fake = types.SimpleNamespace(run_main_ppo=run_main_ppo, read_metrics=launch.read_metrics,
                                 last_stage=launch.last_stage, stop_on_signals=launch.stop_on_signals,
                                 Interrupted=launch.Interrupted)
    monkeypatch.setitem(sys.modules, "verl_tokensel_cpu.launch", fake)
    monkeypatch.setattr("verl_tokensel_cpu.launch", fake, raising=False)
    return launched


def test_demo_task_multi_orchestration(tmp_path, capsys, fake_multi_pipeline):
    import pandas as pd

    out = tmp_path / "demo"
    assert cli_main(["demo", "--task", "multi", "--out", str(out), "--presets", "forking"]) == 0
    (ov,) = fake_multi_pipeline
    spec = get_task("multi")
    assert ov["reward.custom_reward_function.path"] == spec.reward_fn
    assert ov["trainer.total_training_steps"] == str(spec.default_steps)  # the task's defaults
    assert ov["actor_rollout_ref.actor.optim.lr"] == f"{spec.default_lr:g}"
    assert set(pd.read_parquet(ov["data.train_files"])["data_source"]) == {dataset_multi.DATA_SOURCE}
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["task"] == "multi" and results["rollouts"]["forking"]["task"] == "multi"
    captured = capsys.readouterr()
    assert "at every step in 0.400 of answers" in captured.out and "training prompts" in captured.err


# ---------------------------------------------------------------- benchmark

@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_learning.py"
    spec = importlib.util.spec_from_file_location("bench_learning_multi_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_table_and_keys(bench, capsys):
    runs = [{"preset": "forking", "seed": s, "steps": 10, "lr": 3e-4, "task": "multi", "reward_first": 0.4,
             "reward_last": 0.6, "reward_gain": g, "think_share": 0.9, "selected_on_decision_share": 0.5,
             "decision_token_share": 0.15, "selected_share": 0.2, "selected_on_route_share": 0.3,
             "route_token_share": 0.06} for s, g in ((0, 0.1), (1, 0.2))]
    lines = bench.table(runs, ["none", "forking"], task="multi").splitlines()
    assert lines[0].split()[-2:] == ["route", "share"] and len(lines) == 3  # no row without runs
    assert "0.150 +- 0.071" in lines[2] and "0.300" in lines[2]  # gain: mean 0.15, sd 0.0707
    assert "sel on route" not in bench.table(runs, ["forking"])  # the route task's table as before
    for r, share in zip(runs, (0.2, 0.3)):
        r.update({f"start_{k}": share for k in bench.START_KEYS})
    start = bench.start_table(runs, ["none", "forking"]).splitlines()
    assert len(start) == 3 and start[2].split()[:3] == ["forking", "2", "0.250"] and "+- 0.071" in start[2]
    assert bench._key({"preset": "none", "seed": 0, "steps": 12, "lr": 3e-4}) == ("route", "none", 0, 12, 3e-4)
    assert set(bench.MULTI_PRESETS) >= {"none", "forking", "forking_bottom", "random", "gmts", "kl_cov_global",
                                        "clip_cov_global", "archer", "ar", "entropy_adv", "stapo"}
    with pytest.raises(SystemExit):
        bench.main(["--task", "bogus"])
    assert "unknown task 'bogus'; valid: route, multi" in capsys.readouterr().err


# ---------------------------------------------------------------- the real thing

# slow: the multi task's warm-up (2.7 min on one core when not cached) and one verl GRPO pipeline of 2 steps (~2 min on
# 2 cores): longer than CI's budget next to the route demo's runs.
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_demo_task_multi_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", "demo", "--task", "multi", "--out",
                           str(out), "--steps", "2", "--presets", "forking"],
                          capture_output=True, text=True, timeout=1400, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["task"] == "multi" and results["warm_start"]["task"] == "multi"
    # the warm start: partly right, spread at the route words
    assert 0.15 <= results["warm_start"]["accuracy"] <= 0.6 and 0.6 <= results["warm_start"]["think_share"] <= 0.95
    (row,) = results["summary"]
    assert row["steps"] == 2 and 0.15 <= row["selected_fraction"] <= 0.3, row
    roll = results["rollouts"]["forking"]
    assert roll["scored_with"] == "final policy" and roll["on_template_share"] > 0.9, roll
    assert row["entropy_below_0_01_share"] > 0.5, row  # near-deterministic on the template
    # the top 20% by entropy holds the route words far above their share of the tokens
    assert roll["selected_on_route_share"] > 2 * roll["route_token_share"], roll
