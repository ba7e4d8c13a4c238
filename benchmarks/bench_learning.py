"""Does training on the selected tokens learn? Real verl GRPO from the demo's warm start, several seeds per preset.

Run (from the repository root; each run is one real verl pipeline, ~3-5 min on a 2-core CPU machine)::

    python benchmarks/bench_learning.py --seeds 0,1 --steps 20 --out /tmp/bench_learning \\
        --json benchmarks/results/bench_learning_cpu.json

A toy-scale version of the 80/20 paper's comparison (full tokens vs top-20% entropy vs bottom-80%) plus
the random-20% control the paper lacks and GMTS: the demo's warm-started tiny Qwen2
(:mod:`verl_tokensel_cpu.demo.warmup`: a templated trace whose route word decides the answer), the demo's GRPO
settings (:func:`verl_tokensel_cpu.cli.demo.demo_overrides`), ``--steps`` steps per run. Per preset it prints
the mean and spread (sample standard deviation over seeds) of the final reward and of the reward gain
(mean of the last 3 steps minus mean of the first 3, as in the demo's table), side by side, plus the
last step's share of answers on the ``think`` route, its entropy statistics (share < 0.01 nats, 80th
percentile) and the share of selected tokens on the decisions. Whatever it shows is reported as is.

Simplifications: the seed changes the data order, the rollout sampling and the trainer, not the warm
start (one warmed model, seed 0, for every run: the comparison is between presets from the same start);
the reward per step is a mean over 128 answers to 16 prompts, so one step's reward carries sampling
noise of about 0.04 (the table's "gain" spread includes it); no validation set.

``--task multi`` runs the same on the multi-decision task (:mod:`verl_tokensel_cpu.demo.task_multi`: K steps per
answer, each with its own route word, every one of which must be right; its own warm start, reward, ``--steps``
and ``--lr`` defaults), by default over every toolbox preset, and adds to the table the share of each rule's
selected tokens on the route words alone. Its results: ``benchmarks/results/bench_learning_multi_cpu.md``::

    python benchmarks/bench_learning.py --task multi --seeds 0,1,2 --out /tmp/bench_multi \
        --json benchmarks/results/bench_learning_multi_cpu.json
    python benchmarks/bench_learning.py --task multi --null-steps 40 --seeds 0 \
        --json benchmarks/results/bench_learning_multi_cpu.json

``--json`` accumulates: runs already in the file (same task, preset, seed, steps and lr) are not rerun, so the
benchmark can be run in parts. The file records the command line of every part. ``--from-demo DIR`` adds
the runs of a ``verl-tokensel demo --out DIR`` (same pipeline and settings: seed 0 with the demo's default
``--seed``) when their steps and lr match, marked ``"source": "demo"``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PRESETS = ("none", "forking", "forking_bottom", "random", "gmts")
#: the multi task's default: the controls and every rule of the toolbox (those the preset registry has)
MULTI_PRESETS = PRESETS + ("kl_cov_global", "clip_cov_global", "archer", "ar", "entropy_adv", "stapo", "ce_gppo",
                           "aspo", "fipo", "ktae", "gtpo", "m2po_global", "delta")

#: what "selected" means per rule on the multi task's table (the tokens the rule's mask marks)
SELECTED_MEANING = {
    "none": "every token (stock verl)",
    "forking": "the top 20% by entropy, the only tokens with gradient",
    "forking_bottom": "the bottom 80% by entropy, the only tokens with gradient",
    "random": "a keyed random 20%, the only tokens with gradient",
    "gmts": "the top 20% of each prompt group by H x |omega|, the only tokens with gradient",
    "kl_cov_global": "the top max(1, int(2e-4 N)) tokens by covariance, which get the |log r| penalty (every token "
                     "keeps its gradient)",
    "clip_cov_global": "a keyed draw of the 1 < cov < 5 tokens, whose policy loss is zeroed (every other token keeps "
                       "its gradient)",
    "archer": "the tokens above their response's 0.8 entropy quantile, which get clip 0.5 / 0.5 and no KL (every "
              "token keeps its gradient)",
    "ar": "every token (advantage reweighting, no mask)",
    "entropy_adv": "every token (advantage shaping, no mask)",
    "stapo": "every token but STAPO's spurious ones (A > 0, pi < 0.002, entropy under the candidates' 0.75 quantile), "
             "which leave the loss",
    "ce_gppo": "every token (the clipped ones keep a bounded gradient)",
    "aspo": "the tokens above their response's 0.8 entropy quantile, which get clip 0.4 / 0.4 (every token keeps its "
            "gradient; A > 0 the flipped ratio)",
    "fipo": "every token (its advantage weighted by clip(exp(FutureKL)))",
    "ktae": "every token (its advantage plus its token id's key-token score)",
    "gtpo": "every token (conflict tokens: no negative update, a doubled positive one; the entropy filter)",
    "m2po_global": "every token but those M2PO masks (the largest (log pi_old - log pi_rollout)^2 until the rest's "
                   "mean is under the threshold)",
    "delta": "every token (its advantage weighted by DelTA's w in [0.8, 1.2] from the last hidden states)",
}


def _stats(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def _pm(mean, sd, digits=3):
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + (f" +- {sd:.{digits}f}" if sd is not None else "")


def table(runs: list[dict], presets, task: str = "route") -> str:
    head = ("preset", "seeds", "reward first", "reward last", "gain (last 3 - first 3)", "think last", "H<0.01",
            "H p80", "sel on dec", "dec share")
    if task != "route":
        head += ("selected", "sel on route", "route share")
    lines = [head]
    for preset in presets:
        rs = [r for r in runs if r["preset"] == preset]
        if not rs:
            continue
        col = lambda k: [r.get(k) for r in rs]  # noqa: E731
        row = (preset, str(len(rs)), _pm(*_stats(col("reward_first"))), _pm(*_stats(col("reward_last"))),
               _pm(*_stats(col("reward_gain"))), _pm(*_stats(col("think_share"))),
               _pm(*_stats(col("entropy_below_0_01_share"))),
               _pm(*_stats(col("entropy_p80")), digits=4), _pm(*_stats(col("selected_on_decision_share"))),
               _pm(*_stats(col("decision_token_share"))))
        if task != "route":
            row += (_pm(*_stats(col("selected_share"))), _pm(*_stats(col("selected_on_route_share"))),
                    _pm(*_stats(col("route_token_share"))))
        lines.append(row)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def run_one(preset: str, seed: int, steps: int, lr: float, model_dir: str, out: Path, timeout_s: float,
            task: str = "route") -> dict:
    from verl_tokensel_cpu import launch
    from verl_tokensel_cpu.cli.demo import ROLLOUT_N, demo_overrides, final_model_dir, launch_problem
    from verl_tokensel_cpu.demo import report
    from verl_tokensel_cpu.demo.rollouts import analyse_rollouts, last_step_file
    from verl_tokensel_cpu.demo.tasks import get_task

    spec = get_task(task)
    run_dir = out / f"{preset}_seed{seed}"
    # the warm start's split (its seed-0 config): same problems every run
    train, val = spec.write_dataset(run_dir / "data", spec.warmup_config(0))
    overrides = demo_overrides(preset, model_dir, train, val, run_dir, steps, seed=seed, lr=lr, task=task)
    result = launch.run_main_ppo(overrides, timeout_s=timeout_s, log_path=run_dir / "logs" / f"{preset}.log", cpu=True)
    problem = launch_problem(result, steps)
    if problem:
        raise RuntimeError(f"{preset} seed {seed}: {problem}\n{result.log_tail(30)}")
    final = final_model_dir(run_dir, preset, steps)
    scorer = final if (final / "config.json").is_file() else Path(model_dir)
    try:
        analysis = analyse_rollouts(last_step_file(run_dir / "rollouts" / preset), scorer, preset,
                                    run_dir / f"view_{preset}.html", task=task)
        analysis_error = None
    except Exception as e:  # noqa: BLE001 - keep the run's rewards; its rollouts can be analysed again from run_dir
        analysis, analysis_error = {}, f"{type(e).__name__}: {e}"
        print(f"[bench] {preset} seed {seed}: warning: the analysis of the last rollouts failed ({analysis_error}); "
              "the row has no selection statistics", file=sys.stderr, flush=True)
    row = report.summarise(preset, result.steps, wall_s=result.wall_s, rollouts=analysis,
                           responses_per_step=spec.train_batch_size * ROLLOUT_N)
    rewards = [report.metric(s, *report.REWARD_KEYS) for s in result.steps]
    extra = {k: analysis.get(k) for k in ("selected_share", "route_token_share", "selected_on_route_share",
                                          "decision_selected_share", "all_think_share")}
    return {**report.to_json([row])[0], "task": task, "seed": seed, "lr": lr, "rewards": rewards, **extra,
            "wall_s": result.wall_s, "scored_with": "final policy" if scorer == final else "warm start",
            **({"analysis_error": analysis_error} if analysis_error else {})}


START_KEYS = ("selected_share", "selected_on_decision_share", "decision_token_share", "selected_on_route_share",
              "route_token_share", "think_share", "selected_on_fork_share", "fork_token_share", "fork_selected_share")


def start_selection(run_dir: Path, preset: str, model_dir: str, task: str) -> dict:
    """The rule's selection on the run's first-step rollouts (the warm start's answers) under the warm start, where
    the decisions are still open: ``start_<key>`` for each of :data:`START_KEYS` (``{}`` without the dump)."""
    from verl_tokensel_cpu.demo.rollouts import analyse_rollouts

    first = run_dir / "rollouts" / preset / "1.jsonl"
    if not first.is_file():
        return {}
    a = analyse_rollouts(first, model_dir, preset, run_dir / f"view_{preset}_step1.html", task=task)
    return {f"start_{k}": a.get(k) for k in START_KEYS}


def start_table(runs: list[dict], presets) -> str:
    head = ("preset", "seeds", "selected", "sel on dec", "dec share", "sel on route", "route share", "sel on fork",
            "fork share", "forks held")
    lines = [head]
    for preset in presets:
        rs = [r for r in runs if r["preset"] == preset and "start_selected_share" in r]
        if not rs:
            continue
        col = lambda k: [r.get(f"start_{k}") for r in rs]  # noqa: E731
        keys = START_KEYS[:5] + START_KEYS[6:]
        lines.append((preset, str(len(rs)), *(_pm(*_stats(col(k))) for k in keys)))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def null_noise(model_dir: str, steps: int, seed: int = 0, task: str = "route") -> dict:
    """Per-step reward of the warm start when nothing is learned: ``steps`` independent GRPO-shaped batches
    (16 training prompts drawn at random, 8 answers each at temperature 1, sampled with HF ``generate``:
    the policy's own distribution, as vLLM samples it), scored with the task's reward. Returns the per-step
    rewards, their sd, and the sd of ``mean(last k) - mean(first k)`` it implies for k = 1 and 3."""
    if task != "route":
        return _null_noise_multi(model_dir, steps, seed)
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_tokensel_cpu.cli.demo import ROLLOUT_N, TRAIN_BATCH_SIZE
    from verl_tokensel_cpu.demo.warmup import WarmupConfig, sample_accuracy, train_problems

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = train_problems(WarmupConfig())
    rng = random.Random(seed)
    rewards = []
    for step in range(steps):
        batch = [p for p in rng.sample(problems, TRAIN_BATCH_SIZE) for _ in range(ROLLOUT_N)]
        rewards.append(sample_accuracy(model, tok, batch, seed=seed * 100003 + step, batch_size=len(batch)))
        print(f"[null] step {step + 1}/{steps}: reward {rewards[-1]:.3f}", file=sys.stderr, flush=True)
    sd = statistics.stdev(rewards)
    return {"steps": steps, "seed": seed, "rewards": rewards, "mean": statistics.fmean(rewards), "sd_step": sd,
            "sd_gain_k1": sd * 2 ** 0.5, "sd_gain_k3": sd * (2 / 3) ** 0.5}


def _null_noise_multi(model_dir: str, steps: int, seed: int) -> dict:
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_tokensel_cpu.cli.demo import ROLLOUT_N
    from verl_tokensel_cpu.demo.dataset_multi import split_prompts
    from verl_tokensel_cpu.demo.tasks import get_task
    from verl_tokensel_cpu.demo.warmup import MultiWarmupConfig, sample_stats_multi

    torch.set_num_threads(1)
    cfg = MultiWarmupConfig()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = split_prompts(cfg.k, n_val=cfg.n_val, seed=cfg.seed)[0]  # the RL dataset's training prompts
    spec = get_task("multi")
    rng = random.Random(seed)
    rewards = []
    for step in range(steps):
        batch = [p for p in rng.sample(prompts, spec.train_batch_size) for _ in range(ROLLOUT_N)]
        rewards.append(sample_stats_multi(model, tok, batch, seed=seed * 100003 + step, batch_size=len(batch),
                                          max_new_tokens=spec.max_response_length)["accuracy"])
        print(f"[null] step {step + 1}/{steps}: reward {rewards[-1]:.3f}", file=sys.stderr, flush=True)
    sd = statistics.stdev(rewards)
    return {"task": "multi", "steps": steps, "seed": seed, "prompts_per_step": spec.train_batch_size,
            "answers_per_prompt": ROLLOUT_N, "rewards": rewards, "mean": statistics.fmean(rewards), "sd_step": sd,
            "sd_gain_k1": sd * 2 ** 0.5, "sd_gain_k3": sd * (2 / 3) ** 0.5}


def _import_demo(record: dict, demo_out: Path, steps: int, lr: float, task: str = "route") -> None:
    """Add a demo's runs (``results.json``) as seed-0 runs, re-summarised with the same code as a bench run."""
    from verl_tokensel_cpu.cli.demo import ROLLOUT_N, TRAIN_BATCH_SIZE
    from verl_tokensel_cpu.demo import report

    from verl_tokensel_cpu.cli.demo import ACTOR_LR

    demo = json.loads((demo_out / "results.json").read_text())
    settings = demo.get("settings", {"lr": ACTOR_LR, "seed": 0})  # older results.json: the demo's defaults
    if settings["lr"] != lr or settings["seed"] != 0 or settings.get("task", "route") != task:
        return
    for preset, metrics in demo["steps"].items():
        if len(metrics) != steps or any(_key(r) == (task, preset, 0, steps, lr) for r in record["runs"]):
            continue
        analysis = demo["rollouts"].get(preset)
        row = report.summarise(preset, metrics, rollouts=analysis, responses_per_step=TRAIN_BATCH_SIZE * ROLLOUT_N)
        record["runs"].append({**report.to_json([row])[0], "task": task, "seed": 0, "lr": lr, "source": "demo",
                               "rewards": [report.metric(s, *report.REWARD_KEYS) for s in metrics],
                               "scored_with": (analysis or {}).get("scored_with")})


def _key(run: dict) -> tuple:
    """What identifies a run in the results file (runs recorded before ``--task`` existed are the route task's)."""
    return run.get("task", "route"), run["preset"], run["seed"], run["steps"], run["lr"]


def main(argv=None) -> int:
    from verl_tokensel_cpu.cli.demo import ROLLOUT_N, preset_list, task_name
    from verl_tokensel.core.config import PRESETS as REGISTRY
    from verl_tokensel_cpu.demo.tasks import get_task
    from verl_tokensel_cpu.demo.warmup import warm_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", type=task_name, default="route",
                   help="the demo task: route (default) or multi (K decisions per answer)")
    p.add_argument("--presets", type=preset_list, default=None,
                   help=f"comma-separated presets (default {','.join(PRESETS)}; task multi: those of "
                        f"{','.join(MULTI_PRESETS)} the registry has)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 20; task multi: the "
                                                           "demo's default for it)")
    p.add_argument("--lr", type=float, default=None, help="actor learning rate (default: the demo's for the task)")
    p.add_argument("--out", default="/tmp/bench_learning", help="run folders (logs, rollouts, checkpoints)")
    p.add_argument("--json", default=None, help="results file, read and extended (runs in it are skipped)")
    p.add_argument("--cache-dir", default=None, help="warm-start cache (default: the demo's)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default 1200)")
    p.add_argument("--from-demo", default=None, help="a demo's --out folder whose runs count as seed 0")
    p.add_argument("--report", action="store_true",
                   help="only print the table of the runs already in --json (runs nothing; lists the missing runs)")
    p.add_argument("--null-steps", type=int, default=0,
                   help="only measure the no-learning noise of the per-step reward over this many batches "
                        "(no verl run; the basis of tests/test_learning_on_cpu.py's threshold)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    spec = get_task(args.task)
    if args.presets is None:
        args.presets = list(PRESETS) if args.task == "route" else [n for n in MULTI_PRESETS if n in REGISTRY]
    if args.steps is None:
        args.steps = 20 if args.task == "route" else spec.default_steps
    if args.lr is None:
        args.lr = spec.default_lr

    path = Path(args.json) if args.json else None
    record = json.loads(path.read_text()) if path and path.exists() else {"commands": [], "runs": []}
    if not args.report:
        record["commands"].append("python benchmarks/bench_learning.py "
                                  + " ".join(sys.argv[1:] if argv is None else argv))
    model_dir, warm = warm_model_dir(spec.warmup_config(0), cache_dir=args.cache_dir)
    record["warm_start"] = {k: warm.get(k) for k in ("config", "accuracy", "think_share", "think_accuracy",
                                                      "problems")}
    if args.task != "route":
        record["warm_start"].update({k: warm.get(k) for k in ("task", "version", "all_think_share",
                                                               "on_template_share", "final_loss")})
    print(f"warm start {model_dir}: accuracy {warm['accuracy']:.3f} at temperature 1", file=sys.stderr)
    if args.null_steps:
        record["null"] = null_noise(model_dir, args.null_steps, seed=seeds[0], task=args.task)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1))
        n = record["null"]
        print(f"no-learning per-step reward over {n['steps']} batches: mean {n['mean']:.3f}, sd {n['sd_step']:.4f}; "
              f"sd of last-minus-first: {n['sd_gain_k1']:.4f} (1 step each end), {n['sd_gain_k3']:.4f} (3 steps)")
        return 0
    if args.from_demo:
        _import_demo(record, Path(args.from_demo), args.steps, args.lr, args.task)
    out = Path(args.out)
    if args.report:
        missing = [f"{preset} seed {seed}" for seed in seeds for preset in args.presets
                   if not any(_key(r) == (args.task, preset, seed, args.steps, args.lr) for r in record["runs"])]
        if missing:
            print(f"missing runs ({len(missing)}): {', '.join(missing)}", file=sys.stderr)
        seeds = []
    for seed in seeds:  # seed-major: a partial benchmark still has every preset
        for preset in args.presets:
            done = [r for r in record["runs"] if _key(r) == (args.task, preset, seed, args.steps, args.lr)]
            if done:
                continue
            t0 = time.monotonic()
            print(f"[bench] {preset} seed {seed}: {args.steps} steps ...", file=sys.stderr, flush=True)
            row = run_one(preset, seed, args.steps, args.lr, model_dir, out, args.timeout, task=args.task)
            record["runs"].append(row)
            print(f"[bench] {preset} seed {seed}: reward {row['reward_first']:.3f} -> {row['reward_last']:.3f} "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
            if path:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(record, indent=1))
    runs = [r for r in record["runs"] if _key(r)[0] == args.task and r["steps"] == args.steps and r["lr"] == args.lr]
    if args.task != "route" and not args.report:  # the rules' selection at the warm start, for runs that lack it
        for r in runs:
            run_dir = out / f"{r['preset']}_seed{r['seed']}"
            if "start_selected_share" not in r and run_dir.is_dir():
                try:
                    r.update(start_selection(run_dir, r["preset"], model_dir, args.task))
                except Exception as e:  # noqa: BLE001 - the table is printed without it
                    print(f"[bench] {r['preset']} seed {r['seed']}: no selection at the start ({e})", file=sys.stderr)
        if path:
            path.write_text(json.dumps(record, indent=1))
    print(table(runs, args.presets, args.task))
    print(f"\n{args.steps} GRPO steps per run, lr {args.lr:g}, {spec.train_batch_size} prompts x {ROLLOUT_N} answers "
          "per step; mean +- sample sd over seeds; entropy statistics and 'sel on dec' from the last step's rollouts "
          "under the final policy.")
    if args.task != "route":
        print(MULTI_NOTE)
        for preset in args.presets:
            print(f"  {preset}: {SELECTED_MEANING.get(preset, 'the tokens its mask marks')}")
        print("\nThe same selection on each run's first-step rollouts (the warm start's answers, scored under the warm "
              "start: the decisions still open); fork = the token where a step's route is chosen (' think', or the "
              "space before 'guess'), forks held = the share of those tokens the rule selects:\n")
        print(start_table(runs, args.presets))
    null = record.get("null")
    if null and null.get("task", "route") == args.task:
        print(f"no-learning noise: per-step reward sd {null['sd_step']:.4f} over {null['steps']} batches of the warm "
              f"start (mean {null['mean']:.3f}); sd of a 3-step gain {null['sd_gain_k3']:.4f}")
    return 0


MULTI_NOTE = (
    "think last: share of the last step's route words that are 'think'; dec = the decision tokens (every step's\n"
    "route word and written value), route = the route words alone; sel on dec / sel on route: share of the rule's\n"
    "selected tokens that are decision / route-word tokens, against dec share / route share, their share of all\n"
    "response tokens; selected: the selected tokens' share of all response tokens (last step's rollouts, the\n"
    "whole step as one pool, on-policy: the loss ranks per micro-batch, gmts per prompt group). What 'selected'\n"
    "means per rule:")


if __name__ == "__main__":
    sys.exit(main())
