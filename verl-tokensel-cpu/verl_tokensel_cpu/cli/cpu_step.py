"""One real verl actor update per token selector on a tiny model, on CPU (the embedded default job).

Builds, with no download, a byte-level BPE tokenizer and a random-init Qwen2 (cached under
``--workdir``), starts verl's real ``TrainingWorker`` with the FSDP2 engine (``--engine megatron``: verl's
Megatron engine on the Megatron CPU test bed, one process) on verl's CPU platform, computes old log-probs
with the real log-prob pass, then runs one ``update_actor`` mini-batch per preset with the selecting loss and
prints what each preset did.

Examples::

    verl-tokensel cpu-step
    verl-tokensel cpu-step --presets none forking gmts --n 16 --dynamic-bsz
    verl-tokensel cpu-step --engine megatron --presets none forking gmts forking_paper
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HELP = "run one real verl FSDP2 (or Megatron) actor update per preset on a tiny CPU model"
DEFAULT_PRESETS = ("none", "forking", "forking_bottom", "random", "gmts", "grad_norm")


def add_arguments(parser) -> None:
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), help="token_selector presets to run")
    parser.add_argument("--n", type=int, default=8, help="responses in the mini-batch (default 8)")
    parser.add_argument("--dynamic-bsz", action="store_true", help="use_dynamic_bsz=True (token-budget micro-batches)")
    parser.add_argument("--no-remove-padding", action="store_true", help="use_remove_padding=False")
    parser.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "verl_tokensel"),
                        help="where the tiny model is cached")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("fsdp", "megatron"), default="fsdp",
                        help="verl's FSDP2 engine (default) or its Megatron engine (needs megatron-core and mbridge: "
                             "pip install 'verl_tokensel[megatron]')")


def _progress(msg: str) -> None:
    print(f"[cpu-step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _scalar(v):
    if isinstance(v, list):
        v = [float(x) for x in v]
        return sum(v) / len(v) if v else float("nan")
    return float(v) if v is not None else float("nan")


def _selected_fraction(metrics) -> float:
    """Selected / valid response tokens of the update: exact over each mini-batch when a pre-pass selected
    (its pools span micro-batches), else the mean of the per-micro-batch fractions."""
    sel, valid = metrics.get("tokensel/prepass/selected_tokens"), metrics.get("tokensel/prepass/valid_tokens")
    if sel is not None and valid is not None:  # one value per mini-batch
        sel, valid = (x if isinstance(x, list) else [x] for x in (sel, valid))
        return sum(map(float, sel)) / sum(map(float, valid))
    return _scalar(metrics.get("tokensel/selected_fraction", 1.0))


def run(args) -> int:
    from verl_tokensel.core.config import PRESETS

    bad = [p for p in args.presets if p not in PRESETS]
    if bad:
        print(f"error: --presets {bad} unknown; valid: {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    megatron = args.engine == "megatron"
    if megatron:
        from verl_tokensel_cpu.megatron import megatron_available

        reason = megatron_available()
        if reason:
            print(f"error: --engine megatron: {reason}", file=sys.stderr)
            return 2
    _progress("selecting verl's CPU platform and building the tiny model")
    from verl_tokensel_cpu import worker as H
    from verl_tokensel_cpu import batches as B
    from verl_tokensel_cpu import tiny_model
    from verl_tokensel.verl_glue.loss import SelectingLoss

    workdir = Path(args.workdir)
    model_dir = (tiny_model.build_tiny_model_dir(workdir / "tiny_qwen2_kv2", **tiny_model.MEGATRON_TINY_CONFIG)
                 if megatron else tiny_model.build_tiny_model_dir(workdir / "tiny_qwen2"))
    _progress(f"starting verl's TrainingWorker ({'Megatron' if megatron else 'FSDP2'}, CPU) on {model_dir}")
    actor = H.make_training_worker(model_dir, use_dynamic_bsz=args.dynamic_bsz,
                                   use_remove_padding=not args.no_remove_padding, seed=args.seed,
                                   master_port=H.free_port(), engine=args.engine,
                                   ppo_mini_batch_size=args.n, ppo_micro_batch_size_per_gpu=2,
                                   ppo_max_token_len_per_gpu=64, lr=1e-4)
    rows = []
    for preset in args.presets:
        config = H.selecting_actor_config(actor, preset)
        batch = B.make_update_batch(actor, n=args.n, seed=args.seed + 1, calculate_entropy=True,
                                    resp_len=(8, 24), group_size=4 if args.n % 4 == 0 else 1)
        H.compute_old_log_probs(actor, batch)
        if config.selection is not None and config.selection.score_source == "rollout":
            B.add_driver_selection(config, batch)  # what the tokensel driver does before update_actor
        passes = config.selection.update_passes if config.selection is not None else (None,)
        for n in passes:  # a rule's update passes: the driver's whole updates, one per pass
            _progress(f"update with token_selector={preset}" + (f" (update pass {n})" if n is not None else ""))
            data = batch.copy()
            if n is not None:
                from verl.utils import tensordict_utils as tu

                from verl_tokensel.core.fields import UPDATE_PASS

                tu.assign_non_tensor(data, **{UPDATE_PASS: n})
            result = H.run_train_step(actor, data, loss_fn=SelectingLoss(config), capture_params=True)
        m = result.metrics
        if not (result.loss == result.loss) or result.max_abs_param_delta <= 0:
            print(f"error: token_selector={preset}: loss {result.loss}, max |param delta| "
                  f"{result.max_abs_param_delta}: the update did not happen", file=sys.stderr)
            return 1
        rows.append((preset, _selected_fraction(m),
                     _scalar(m.get("tokensel/entropy_selected")), _scalar(m.get("tokensel/entropy_unselected")),
                     _scalar(m.get("tokensel/grad_mass_kept", 1.0)), result.loss,
                     float("nan") if result.grad_norm is None else result.grad_norm))
    print()
    print(f"{'preset':<15}{'selected':>9}{'H sel':>8}{'H unsel':>9}{'grad kept':>10}{'loss':>10}{'grad norm':>11}")
    for preset, frac, hs, hu, gk, loss, gn in rows:
        print(f"{preset:<15}{frac:>9.3f}{hs:>8.3f}{hu:>9.3f}{gk:>10.3f}{loss:>10.4f}{gn:>11.4f}")
    print("\nselected: fraction of response tokens with gradient; H: mean entropy (nats) of selected / unselected"
          "\ntokens; grad kept: share of the estimated per-token gradient-norm mass on the selected tokens.")
    return 0
