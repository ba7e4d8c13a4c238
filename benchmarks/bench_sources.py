"""Cost of each ``token_selection.score_source`` relative to a plain CPU actor update step, printed as ratios.

Run (from the repository root, a few minutes on a 2-core machine)::

    python benchmarks/bench_sources.py

Options: ``--repeats N`` (steps per mode, default 7), ``--n N`` (responses per update, default 16),
``--threads N`` (torch intra-op threads, default 1; see ``bench_loss.py`` for why).

All three modes rank by the same score (GMTS, H * |omega|) with ratio 0.2 and train one PPO mini-batch of
``--n`` responses (prompts 32..96, responses 192..384 tokens, groups of 4 responses per prompt) through
verl's real ``TrainingWorker`` (FSDP2 engine, tiny random Qwen2, CPU, ``lr=0`` so every step sees the same
weights, 4 micro-batches):

- ``current`` (the 1.00x reference): scores from the update forward of each micro-batch
  (``scope=micro_batch``, the update computes entropy);
- ``prepass``: ``scope=group``; at the start of the mini-batch a no-grad forward measures entropy and the
  ratio, the groups are selected, then the update runs without entropy (what the tokensel trainers
  configure). Its column "extra" is the pre-pass's own time (``tokensel/prepass/seconds``);
- ``rollout``: ``scope=group``; the mask arrives with the batch, computed on the driver from the
  old-policy pass verl runs anyway (entropy, old log-probs) and the advantages. Its step is the update
  alone; "extra" is the driver-side work timed separately: padding the batch's nested fields,
  :func:`verl_tokensel.core.driver_select.select_on_driver`, and nesting the mask and scores back.

Modes are interleaved (current, prepass, rollout, current, ...) and the medians are compared. Absolute
times are meaningless on a shared CPU and are not printed. The tiny model makes the forward pass cheap
next to the fixed per-step costs, so on a real model the pre-pass's share approaches that of one
forward pass without gradient (about a third of a forward + backward step) and the driver's share
shrinks further.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# must come before verl: selects verl's CPU platform
from verl_tokensel_cpu import worker as H  # noqa: E402
from verl_tokensel_cpu import batches as B  # noqa: E402

import torch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from verl_tokensel.verl_glue.loss import SelectingLoss  # noqa: E402

MODES = ("current", "prepass", "rollout")
KNOBS = {
    "current": dict(score_source="current", scope="micro_batch"),
    "prepass": dict(score_source="prepass", scope="group"),
    "rollout": dict(score_source="rollout", scope="group"),
}


def _driver_select(config, batch) -> tuple[float, float]:
    """What the driver does for ``score_source=rollout``, in place (the mask and scores added to ``batch``);
    returns (seconds, selected fraction)."""
    t0 = time.perf_counter()
    out = B.add_driver_selection(config, batch)
    return time.perf_counter() - t0, out.metrics["tokensel/driver_selected_fraction"]


def bench(repeats: int, n: int, warmup: int = 1):
    worker_kw = dict(ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=max(1, n // 4),
                     ppo_max_token_len_per_gpu=4096, lr=0.0, clip_grad=1e6)
    model_dir = H.tiny_model.build_tiny_model_dir()
    actor = H.make_training_worker(model_dir, use_dynamic_bsz=False, use_remove_padding=True, **worker_kw)
    batch = B.make_update_batch(actor, n=n, seed=0, prompt_len=(32, 96), resp_len=(192, 384), group_size=4)
    H.compute_old_log_probs(actor, batch)  # the real old-log-prob pass (on-policy); keeps `entropy`

    configs = {}
    for mode in MODES:
        entropy_in_update = mode == "current"
        configs[mode] = (H.selecting_actor_config(actor, "gmts", calculate_entropy=entropy_in_update,
                                                  **KNOBS[mode]), entropy_in_update)

    def once(mode):
        config, entropy_in_update = configs[mode]
        b = batch.copy()
        tu.assign_non_tensor(b, calculate_entropy=entropy_in_update)
        extra, frac = 0.0, None
        if mode == "rollout":
            extra, frac = _driver_select(config, b)
        r = H.run_train_step(actor, b, loss_fn=SelectingLoss(config), capture_params=False)
        assert r.loss == r.loss, f"{mode}: NaN loss"
        if mode == "prepass":
            extra = sum(float(s) for s in r.metrics["tokensel/prepass/seconds"])
        if frac is None:  # the realised fraction of the update (prepass: exact over the mini-batch)
            frac = r.metrics.get("tokensel/prepass/selected_fraction") or r.metrics.get("tokensel/selected_fraction")
            frac = statistics.mean(float(f) for f in frac)
        return r.seconds, extra, frac

    for _ in range(warmup):
        for mode in MODES:
            once(mode)
    steps = {m: [] for m in MODES}
    extras = {m: [] for m in MODES}
    fractions = {}
    for _ in range(repeats):
        for mode in MODES:
            step, extra, frac = once(mode)
            steps[mode].append(step)
            extras[mode].append(extra)
            fractions[mode] = frac
    return steps, extras, fractions


def _iqr_over_median(v):
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return (q[2] - q[0]) / statistics.median(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, extras, fractions = bench(args.repeats, args.n)
    ref = statistics.median(steps["current"])
    print(f"\nscore_source cost, GMTS score, ratio 0.2: one verl actor update (TrainingWorker, FSDP2, CPU, tiny "
          f"Qwen2, {args.n} responses of 192..384 tokens, 4 micro-batches), median of {args.repeats} interleaved "
          f"steps, torch threads {torch.get_num_threads()}; 1.00x = the current-source step")
    ref_min = min(steps["current"])
    print(f"{'mode':<9} {'scope':<12} {'update step':>12} {'extra':>8} {'total':>8} {'total(min)':>11} "
          f"{'extra/own':>10} {'IQR/median':>11} {'selected':>9}")
    for mode in MODES:
        # totals per repeat: the prepass step already contains its pre-pass, the driver's work is outside
        totals = [s + (e if mode == "rollout" else 0.0) for s, e in zip(steps[mode], extras[mode])]
        total = statistics.median(totals) / ref
        extra = statistics.median(extras[mode]) / ref
        step = total - extra
        share = statistics.median(e / t for e, t in zip(extras[mode], totals))  # same-step ratio: load-robust
        print(f"{mode:<9} {KNOBS[mode]['scope']:<12} {step:>11.2f}x {extra:>7.2f}x {total:>7.2f}x "
              f"{min(totals) / ref_min:>10.2f}x {share:>10.1%} {_iqr_over_median(totals):>11.2f} "
              f"{fractions[mode]:>9.3f}")
    print("\nextra: prepass = its no-grad forward + selection (inside the step, split out here); rollout = the "
          "driver's selection (padding, select_on_driver, nesting), outside the step. total(min): fastest repeat "
          "vs current's fastest (less sensitive to a busy machine). extra/own: the extra's share of the same "
          "repeat's total. verl's old-log-prob pass, which rollout reads, runs in every mode and is not counted.")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
