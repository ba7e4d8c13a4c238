"""``verl-tokensel demo``: warm-start a tiny local model, then real verl GRPO on it per token selector (CPU).

The embedded-default main job. With no network and no GPU it:

1. builds a tiny Qwen2 and a byte-level BPE tokenizer locally and warms it up with supervised next-token loss
   on templated traces whose route word (``think``, then the correct value, or ``guess``, then a near miss) is
   the one uncertain choice that decides the answer (:mod:`verl_tokensel_cpu.demo.task`,
   :mod:`verl_tokensel_cpu.demo.warmup`; about a minute on 2 cores, cached by its settings under ``--cache-dir``);
2. writes the verifiable arithmetic dataset in verl's RL parquet format (``<out>/data``);
3. runs verl's full pipeline (``python -m verl_tokensel.main_ppo``: Ray, vLLM rollout, FSDP2 actor, GRPO,
   math-verify reward) for ``--steps`` steps once per preset (logs, Hydra's run folder, rollouts and final policy
   under ``<out>``, default ``./tokensel_demo``; nothing else goes into the current folder);
   ``--engine megatron`` trains with verl's Megatron engine instead (``model_engine=megatron``, megatron-core
   and mbridge on CPU: ``docs/cpu.md``; the default three presets took 12.6 min on 2 cores);
4. scores each run's last-step rollouts under its final policy and prints one table row per preset (reward
   first / last and whether it rose beyond its noise, ``think`` share, entropy statistics, selected share on
   the decisions), and writes ``demo.png``, ``view_<preset>.html`` and ``results.json``.

``--task multi`` runs the same on the multi-decision task (:mod:`verl_tokensel_cpu.demo.task_multi`: K arithmetic
steps per answer, each with its own route word, all of which must be right; its own warm start, dataset and
reward, :mod:`verl_tokensel_cpu.demo.tasks`).

A preset of your own (``register_preset``) runs too when its module is listed in ``VERL_USE_EXTERNAL_MODULES``
(imported before ``--presets`` is checked, and by every process of each run).

Exits 1 naming the preset, its log and the log's last lines if a run fails; SIGINT (Ctrl-C) and SIGTERM (``kill``,
a scheduler, ``timeout``) end the run in progress and its Ray processes, print one line and exit 130 / 143. Known
third-party notices (thread counts, Apex / TransformerEngine, Triton) stay off the console
(:mod:`verl_tokensel_cpu.demo.console`; ``<out>/logs/console_noise.log`` and each run's log keep them).
Measured results:
``docs/benchmarks.md``.

Examples::

    verl-tokensel demo
    verl-tokensel demo --out /tmp/demo --presets none,forking,forking_bottom,random,gmts --steps 16
    verl-tokensel demo --presets forking --steps 6 --timeout 900
    verl-tokensel demo --engine megatron --presets none,forking --steps 4
    verl-tokensel demo --task multi --presets none,forking,random
    VERL_USE_EXTERNAL_MODULES=examples.custom_preset verl-tokensel demo --presets none,entropy_top10
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

from verl_tokensel_cpu.demo.tasks import DEFAULT_TASK, TASK_NAMES, get_task
from verl_tokensel_cpu.launch import ENGINE_OVERRIDES, HF_CHECKPOINT_DIRS

HELP = ("warm-start a tiny local model, run real verl GRPO per preset and compare them (CPU; 9 min on an idle 2-core "
        "machine, 20 on a loaded one)")
DEFAULT_PRESETS = ("none", "forking", "gmts")
_ROUTE = get_task(DEFAULT_TASK)  # the default task's settings (demo/tasks.py is their home)
REWARD_FN = _ROUTE.reward_fn

# Run shape: 16 prompts x 8 responses of <= 48 tokens per step (multi task: 8 prompts, <= 96 tokens), two PPO
# updates per step.
TRAIN_BATCH_SIZE = _ROUTE.train_batch_size
ROLLOUT_N = 8
PPO_MINI_BATCH_SIZE = _ROUTE.ppo_mini_batch_size
MAX_PROMPT_LENGTH = _ROUTE.max_prompt_length
MAX_RESPONSE_LENGTH = _ROUTE.max_response_length
ACTOR_LR = _ROUTE.default_lr
DEFAULT_STEPS = _ROUTE.default_steps


def preset_list(value: str) -> list[str]:
    """argparse type of ``--presets``: comma-separated names from the preset registry, the presets of the modules
    listed in ``VERL_USE_EXTERNAL_MODULES`` included (imported first, as ``verl-tokensel rules`` and verl do; the
    runs inherit the variable, so every process of a run has them too)."""
    import os

    from verl_tokensel.cli.rules import EXTERNAL_MODULES, import_external_modules
    from verl_tokensel.core.config import PRESETS, TokenSelectionConfigError, resolve_selection

    try:
        import_external_modules()
    except Exception as exc:  # noqa: BLE001  (the user's module: say which, and why)
        raise argparse.ArgumentTypeError(f"{EXTERNAL_MODULES}={os.environ.get(EXTERNAL_MODULES)!r}: importing it "
                                         f"failed: {exc!r}") from None
    names = [p.strip() for p in value.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no preset given; valid: {', '.join(PRESETS)}")
    bad = []
    for name in names:  # resolved as a run resolves token_selector
        try:
            resolve_selection(name)
        except TokenSelectionConfigError:
            bad.append(name)
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown preset(s) {', '.join(bad)}; valid: {', '.join(PRESETS)} (comma-separated)")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"preset listed twice in {value!r}")
    return names


def task_name(value: str) -> str:
    """argparse type of ``--task``: a name from :data:`verl_tokensel_cpu.demo.tasks.TASK_NAMES`."""
    if value not in TASK_NAMES:
        raise argparse.ArgumentTypeError(f"unknown task {value!r}; valid: {', '.join(TASK_NAMES)} "
                                         f"(default {DEFAULT_TASK})")
    return value


def _positive(kind):
    def parse(value: str):
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
        return v

    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="./tokensel_demo",
                        help="output folder: data, logs, rollouts, results.json, demo.png, view pages "
                             "(default ./tokensel_demo)")
    parser.add_argument("--presets", type=preset_list, default=list(DEFAULT_PRESETS),
                        help="comma-separated token_selector presets, run in this order (default none,forking,gmts; "
                             "also forking_bottom, random, forking_paper, grad_norm, and yours from the modules of "
                             "VERL_USE_EXTERNAL_MODULES)")
    parser.add_argument("--task", type=task_name, default=DEFAULT_TASK,
                        help=f"the synthetic task: {'; '.join(f'{n}: {get_task(n).summary}' for n in TASK_NAMES)} "
                             f"(default {DEFAULT_TASK})")
    parser.add_argument("--steps", type=_positive(int), default=None,
                        help=f"GRPO training steps per run (default {DEFAULT_STEPS}; task multi: "
                             f"{get_task('multi').default_steps})")
    parser.add_argument("--lr", type=_positive(float), default=None,
                        help=f"actor learning rate of the GRPO runs (default {ACTOR_LR:g}; task multi: "
                             f"{get_task('multi').default_lr:g})")
    parser.add_argument("--timeout", type=_positive(float), default=900.0,
                        help="seconds allowed per run, start-up and shutdown included (default 900; a run "
                             "takes 3-6 min on an idle 2-core machine)")
    parser.add_argument("--engine", choices=tuple(ENGINE_OVERRIDES), default="fsdp2",
                        help="the actor's verl engine: fsdp2 (default) or megatron (model_engine=megatron; needs "
                             "megatron-core and mbridge: pip install 'verl_tokensel[megatron]')")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, warm-up, data split and trainer "
                                                            "(default 0)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the warmed model is cached, keyed by its settings "
                             "(default $XDG_CACHE_HOME/verl_tokensel, i.e. ~/.cache/verl_tokensel)")


def _engine_overrides(engine: str) -> tuple[str, ...]:
    if engine not in ENGINE_OVERRIDES:
        raise ValueError(f"engine={engine!r} is not an engine of the demo; valid: {', '.join(ENGINE_OVERRIDES)}. "
                         "Fix: pass one of them (verl-tokensel demo --engine megatron).")
    return ENGINE_OVERRIDES[engine]


def _kl_overrides(preset: str, micro: int) -> tuple[str, ...]:
    """The KL loss is off, except for a rule that weights it per token (Archer's: low_var_kl at 0.001, with the
    reference worker's log-prob micro-batch)."""
    from verl_tokensel.core.config import PRESETS

    sel = PRESETS.get(preset)
    if sel is not None and sel.impl.needs.kl_loss:
        return ("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
                "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}")
    return ("actor_rollout_ref.actor.use_kl_loss=False",)


def demo_overrides(preset: str, model_dir: str, train: str, val: str, out: Path, steps: int,
                   seed: int = 0, lr: float = ACTOR_LR, engine: str = "fsdp2", task: str = DEFAULT_TASK) -> list[str]:
    """The Hydra overrides of one demo run on ``task`` (its reward function and lengths). The launcher adds the CPU
    switch (``trainer.device=cpu``), which fills the engine's CPU settings, and verl's ``file`` logger (per-step
    metrics)."""
    spec = get_task(task)
    micro = spec.ppo_mini_batch_size * ROLLOUT_N // 2
    prompt_len, response_len = spec.max_prompt_length, spec.max_response_length
    return [
        *_engine_overrides(engine),
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={spec.train_batch_size}",
        f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={response_len}",
        f"data.seed={seed}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.actor.token_selector={preset}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec.ppo_mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.optim.lr={lr:g}",
        *_kl_overrides(preset, micro),
        "actor_rollout_ref.actor.entropy_coeff=0",
        # entropy in the update pass for every preset, so the table can compare selected vs unselected
        # tokens also for presets whose scores come from elsewhere (gmts: a pre-pass)
        "actor_rollout_ref.actor.calculate_entropy=True",
        # the final policy as a HF folder, so the demo can measure its entropies on the last rollouts
        "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.max_model_len={prompt_len + response_len}",
        "actor_rollout_ref.rollout.max_num_batched_tokens="
        f"{spec.train_batch_size * ROLLOUT_N * (prompt_len + response_len)}",
        f"reward.custom_reward_function.path={spec.reward_fn}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",  # the step count ends the run (one epoch is 13 steps)
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        f"trainer.save_freq={steps}",
        "trainer.resume_mode=disable",
        "trainer.project_name=tokensel_demo",
        f"trainer.experiment_name={preset}",
        f"trainer.default_local_dir={out / 'checkpoints' / preset}",
        f"trainer.rollout_data_dir={out / 'rollouts' / preset}",
        # Hydra's run folder (the composed config in .hydra/, main_ppo.log) inside --out, not ./outputs/<date>/<time>
        f"hydra.run.dir={hydra_run_dir(out, preset)}",
    ]


def hydra_run_dir(out: Path, preset: str) -> Path:
    """Hydra's run folder of the preset's run: ``<out>/logs/hydra/<preset>`` (its ``.hydra/config.yaml`` is the
    composed config)."""
    return Path(out) / "logs" / "hydra" / preset


def _think(warm: dict) -> str:
    share, acc = warm.get("think_share"), warm.get("think_accuracy")
    if share is None:
        return "think route not measured"
    if warm.get("task") == "multi":
        return (f"think route at {share:.3f} of the steps, at every step in {warm['all_think_share']:.3f} of answers"
                + (f" (right {acc:.3f} of those)" if acc is not None else ""))
    return f"think route {share:.3f} of answers" + (f" (right {acc:.3f} of those)" if acc is not None else "")


def final_model_dir(out: Path, preset: str, steps: int, engine: str = "fsdp2") -> Path:
    """Where verl saved the run's final policy as a HF folder (``checkpoint.save_contents=[hf_model]``)."""
    _engine_overrides(engine)
    return out / "checkpoints" / preset / f"global_step_{steps}" / HF_CHECKPOINT_DIRS[engine]


def _run_one(launch, overrides: list[str], log_path: Path, timeout_s: float, progress, label: str, steps: int):
    """One pipeline run in this thread (a signal reaches the launcher, which kills the run); a watcher
    thread reports progress from the run's metrics file and log."""
    from verl_tokensel_cpu.demo.console import watch_run

    metrics_path = log_path.with_name(log_path.stem + ".metrics.jsonl")
    stop = threading.Event()
    watcher = threading.Thread(target=watch_run, args=(launch, log_path, metrics_path, steps, timeout_s, progress,
                                                    label, stop), name=f"demo-{label}", daemon=True)
    watcher.start()
    try:
        return launch.run_main_ppo(overrides, timeout_s=timeout_s, log_path=log_path, cpu=True,
                                   metrics_path=metrics_path)
    finally:
        stop.set()
        watcher.join(timeout=5.0)


def run(args) -> int:
    """The demo; SIGINT / SIGTERM (Ctrl-C, ``kill``, a scheduler) end the run in progress and the Ray processes it
    started (:func:`verl_tokensel_cpu.launch.stop_on_signals`), then one line and exit 130 / 143."""
    from verl_tokensel_cpu import launch
    from verl_tokensel_cpu.demo.console import quiet_console

    with launch.stop_on_signals(), quiet_console(Path(args.out).resolve() / "logs" / "console_noise.log"):
        try:
            return _run(args)
        except launch.Interrupted as stop:
            print(f"\nverl-tokensel demo: stopped by {stop.name}; the verl run in progress and the Ray processes it "
                  f"started were ended (partial output: {Path(args.out).resolve()})", file=sys.stderr, flush=True)
            return stop.exit_code


def _run(args) -> int:
    from verl_tokensel_cpu import launch
    from verl_tokensel_cpu.demo import report
    from verl_tokensel_cpu.demo.console import Progress
    from verl_tokensel_cpu.demo.rollouts import analyse_rollouts, last_step_file
    from verl_tokensel_cpu.demo.warmup import warm_model_dir

    if args.engine == "megatron":
        from verl_tokensel_cpu.megatron import megatron_available

        reason = megatron_available()
        if reason:
            print(f"error: --engine megatron: {reason}", file=sys.stderr)
            return 2
    spec = get_task(args.task)
    args.steps = spec.default_steps if args.steps is None else args.steps
    args.lr = spec.default_lr if args.lr is None else args.lr
    progress = Progress()
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cfg = spec.warmup_config(args.seed)
    progress(f"warm start: supervised warm-up of the tiny model ({cfg.steps} steps, cached by its settings)")
    try:
        model_dir, warm = warm_model_dir(cfg, cache_dir=args.cache_dir, progress=progress)
    except Exception as e:  # noqa: BLE001
        print(f"\nerror: the warm-up of the tiny model failed ({type(e).__name__}: {e}); nothing was trained "
              "with verl. Fix: rerun with --cache-dir pointing at a writable folder.", file=sys.stderr)
        return 1
    progress(f"warm model {model_dir}: accuracy {warm['accuracy']:.3f} at temperature 1 on the "
             f"{warm['problems']} training {'prompts' if args.task == 'multi' else 'problems'}, {_think(warm)}")
    train, val = spec.write_dataset(out / "data", cfg)
    progress(f"wrote {train} and {val}")

    runs, rows, analyses = {}, [], {}
    for i, preset in enumerate(args.presets, 1):
        label = f"[{i}/{len(args.presets)}] {preset}"
        log_path = out / "logs" / f"{preset}.log"
        progress(f"{label}: verl GRPO ({args.engine}), {args.steps} steps, log {log_path}")
        shutil.rmtree(out / "rollouts" / preset, ignore_errors=True)
        shutil.rmtree(out / "checkpoints" / preset, ignore_errors=True)
        shutil.rmtree(hydra_run_dir(out, preset), ignore_errors=True)
        overrides = demo_overrides(preset, model_dir, train, val, out, args.steps, seed=args.seed, lr=args.lr,
                                   engine=args.engine, task=args.task)
        try:
            result = _run_one(launch, overrides, log_path, args.timeout, progress, label, args.steps)
        except Exception as e:  # noqa: BLE001
            return _fail(preset, log_path, f"could not be launched ({type(e).__name__}: {e})")
        problem = launch_problem(result, args.steps)
        if problem:
            return _fail(preset, result.log_path, problem)
        if result.timed_out:
            progress(f"{label}: warning: all {args.steps} steps were logged but verl did not exit within "
                     f"--timeout {args.timeout:.0f} s (killed while {result.last_stage or 'finishing'}); "
                     "using its metrics")
        progress(f"{label}: done in {result.wall_s:.0f} s; scoring the last step's rollouts")
        dump = last_step_file(out / "rollouts" / preset)
        final = final_model_dir(out, preset, args.steps, args.engine)
        analysis = None
        if dump is None:
            progress(f"{label}: warning: verl dumped no rollouts in {out / 'rollouts' / preset}; no entropy statistics")
        else:
            scorer = final if (final / "config.json").is_file() else Path(model_dir)
            if scorer != final:
                progress(f"{label}: warning: no final checkpoint at {final}; scoring under the warm start")
            try:
                analysis = analyse_rollouts(dump, scorer, preset, out / f"view_{preset}.html", task=args.task)
                analysis["scored_with"] = "final policy" if scorer == final else "warm start"
            except Exception as e:  # noqa: BLE001
                return _fail(preset, result.log_path, f"the analysis of its rollouts {dump} failed "
                                                      f"({type(e).__name__}: {e})")
        runs[preset] = result.steps
        analyses[preset] = analysis
        rows.append(report.summarise(preset, result.steps, wall_s=result.wall_s, rollouts=analysis,
                                     responses_per_step=spec.train_batch_size * ROLLOUT_N))

    table = report.format_table(rows)
    png = report.plot(runs, out / "demo.png", rows)
    (out / "results.json").write_text(json.dumps(
        {"settings": {"task": args.task, "engine": args.engine, "steps": args.steps, "lr": args.lr,
                      "seed": args.seed, "train_batch_size": spec.train_batch_size,
                      "rollout_n": ROLLOUT_N, "ppo_mini_batch_size": spec.ppo_mini_batch_size},
         "summary": report.to_json(rows), "warm_start": {"model": model_dir, **warm}, "rollouts": analyses,
         "steps": runs}, indent=1))
    print()
    print(f"warm start: accuracy {warm['accuracy']:.3f} at temperature 1, {_think(warm)} ({model_dir})")
    print(table)
    print()
    print(report.TABLE_NOTE)
    print(f"\nreward curves and the selection on the decisions: {png}")
    for preset, analysis in analyses.items():
        if analysis is not None:
            print(f"view ({preset}, last step's rollouts, selected tokens marked): {analysis['html']}")
    print(f"results: {out / 'results.json'}\nlogs: {out / 'logs'}")
    print(f"total wall time: {time.monotonic() - progress.t0:.0f} s")
    return 0


def launch_problem(result, want_steps: int) -> str | None:
    """Why a launcher :class:`~verl_tokensel_cpu.launch.RunResult` is a failure (None if it is not).

    A run that logged every step and was then killed at the timeout (stuck in verl's shutdown) is not
    a failure: its metrics are complete. The caller warns about it.
    """
    if len(result.steps) >= want_steps and (result.ok or result.timed_out):
        return None
    if not result.ok:
        return result.describe()
    return f"logged {len(result.steps)} of {want_steps} training steps ({result.describe()})"


def _fail(preset: str, log_path, why: str) -> int:
    from verl_tokensel_cpu.demo.console import log_tail

    log_path = Path(log_path)
    print(f"\nerror: token_selector={preset} failed: {why}\nlog: {log_path}\n--- last lines of the log ---\n"
          f"{log_tail(log_path)}--- end ---", file=sys.stderr)
    return 1
