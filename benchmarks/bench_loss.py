"""Overhead of the selecting loss vs verl's stock ``ppo_loss`` (CPU), printed as ratios only.

Run (from the repository root, about a minute)::

    python benchmarks/bench_loss.py

Options: ``--repeats N`` (loss timings per variant, default 40), ``--engine-repeats N`` (train steps per
variant, default 9), ``--no-engine`` (skip part 2), ``--threads N`` (torch intra-op threads, default 1: on a
shared, busy CPU OpenMP spin-waits make multi-threaded element-wise kernels 100x slower and the timings meaningless).

Part 1 (loss only): one micro-batch of 16 responses of up to 1024 tokens (prompts 64..256 tokens,
responses 512..1024 tokens, verl's no-padding layout as the engine hands it to the loss, with
``log_probs`` and ``entropy`` model outputs, plus ``sum_pi_squared`` for the variant ``grad_norm+spsq``,
i.e. with ``actor.calculate_sum_pi_squared=true``). Each variant runs forward + backward of
its loss w.r.t. the log-probs; variants are interleaved (stock, forking, gmts, grad_norm, random,
grad_norm+spsq, stock, ...) and the median over the repeats is compared with stock's. Target: <= 1.05x.

Part 2 (one real verl actor update step on CPU): verl's ``TrainingWorker`` with the FSDP2 engine and the
tiny random Qwen2 from ``verl_tokensel_cpu.worker``.
Same weights every step (lr=0), same batch; the selecting loss is bound as the worker's loss function;
presets that rank by entropy get ``calculate_entropy=True`` (what the plugin turns on), stock does not.
Target: <= 1.02x. The tiny model makes the model's share of a step far smaller than in a real run, so
this ratio is an upper bound of the overhead in practice.

Absolute times are meaningless on a shared CPU and are not printed; the IQR/median column says how
noisy each median is (ratios closer to 1 than that spread are within noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' builder of the engine's micro-batch layout (tests/helpers)


def _import_cpu_worker():
    """verl's real TrainingWorker on CPU (``verl_tokensel_cpu.worker``). Returns (module or None, why not)."""
    try:
        import verl_tokensel_cpu.worker as mod

        return mod, None
    except Exception as e:  # pragma: no cover
        return None, f"verl_tokensel_cpu.worker: {type(e).__name__}: {e}"


# The CPU worker helper must select verl's CPU platform before verl is imported: import it first.
H, HARNESS_ERROR = _import_cpu_worker()

from verl_tokensel_cpu import batches as B  # noqa: E402

import torch  # noqa: E402

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from verl_tokensel.verl_glue.loss import tokensel_ppo_loss  # noqa: E402
from helpers.loss_inputs import engine_layout  # noqa: E402

PRESETS = ["forking", "gmts", "grad_norm", "random"]
# This benchmark times the loss itself, so every preset ranks inside it: the `gmts` preset's pre-pass
# scores (score_source=prepass, group scope) are replaced by its in-loss twin (same score, ratio and
# normaliser, micro-batch scope). The pre-pass's own cost is measured by benchmarks/bench_sources.py.
IN_LOSS = {"scope": "micro_batch", "score_source": "current"}
SELECTION_TARGET = "verl_tokensel.core.config.TokenSelectionConfig"


def _in_loss_overrides(preset: str) -> dict:
    from verl_tokensel.core.config import PRESETS as ALL

    return dict(IN_LOSS) if ALL[preset].score_source != "current" else {}
ACTOR_TARGET = "verl_tokensel.verl_glue.actor_config.TokenselFSDPActorConfig"


# --------------------------------------------------------------------------------------------
# configs (verl's own Hydra tree)
# --------------------------------------------------------------------------------------------
def actor_configs():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from verl.utils.config import omega_conf_to_dataclass

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module("verl.trainer.config", version_base=None):
        base = compose("ppo_trainer")

    def make(selector):
        cfg = base.copy()
        node = cfg.actor_rollout_ref.actor
        with open_dict(node):
            node.strategy = "fsdp2"
            node.ppo_micro_batch_size_per_gpu = 16
            node.clip_ratio_high = 0.28
            if selector is not None:
                node._target_ = ACTOR_TARGET
                node.token_selector = selector
                node.token_selection = {"_target_": SELECTION_TARGET, **_in_loss_overrides(selector)}
        return omega_conf_to_dataclass(node)

    return {"stock": make(None), **{p: make(p) for p in PRESETS}}


def _summarise(times: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Per variant: (median / stock's median, interquartile range / own median), both unit-free."""
    out = {}
    stock = statistics.median(times["stock"])
    for k, v in times.items():
        q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
        out[k] = (statistics.median(v) / stock, (q3 - q1) / med)
    return out


def _table(rows, target: float, entropy=None):
    print(f"{'variant':<15} {'ratio vs stock':>15} {'IQR/median':>11}  target <= {target:.2f}x")
    for k, (r, spread) in rows.items():
        note = "" if k == "stock" else ("  ok" if r <= target else "  ABOVE TARGET")
        ent = " (+entropy)" if entropy and entropy.get(k) else ""
        print(f"{k:<15} {r:>14.3f}x {spread:>10.3f}{note}{ent}")


# --------------------------------------------------------------------------------------------
# part 1: the loss alone
# --------------------------------------------------------------------------------------------
def make_micro_batch(batch=16, max_prompt=256, max_resp=1024, seed=0):
    """A micro-batch in verl's no-padding layout (``tests/helpers/loss_inputs.engine_layout``), realistic sizes."""
    g = torch.Generator().manual_seed(seed)
    P, R = max_prompt, max_resp
    prompt_lens = torch.randint(64, P + 1, (batch,), generator=g)
    resp_lens = torch.randint(R // 2, R + 1, (batch,), generator=g)
    input_ids = torch.zeros(batch, P + R, dtype=torch.long)
    attn = torch.zeros(batch, P + R, dtype=torch.long)
    for i in range(batch):
        pl, rl = int(prompt_lens[i]), int(resp_lens[i])
        input_ids[i, P - pl:P + rl] = torch.randint(3, 150000, (pl + rl,), generator=g)
        attn[i, P - pl:P + rl] = 1
    response_mask = attn[:, P:]
    total = int(attn.sum())
    # model outputs over the full sequences: log p (mostly confident), entropy (mostly ~0, heavy tail)
    lp_values = -(torch.rand(total, generator=g) ** 3) * 4
    ent_values = (torch.rand(total, generator=g) ** 4) * 3
    spsq_values = torch.rand(total, generator=g) * 0.7 + 0.3
    adv = (torch.randn(batch, 1, generator=g).expand(batch, R) * response_mask).contiguous()
    data = engine_layout(input_ids, attn, P, old_log_probs=torch.zeros(batch, R), advantages=adv)
    n_tok = int(response_mask.sum())
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tok, global_batch_size=batch)
    offsets = data["input_ids"].offsets()
    # near on-policy old log-probs: most tokens unclipped, some clipped
    lp_pad = no_padding_2_padding(lp_values, data)
    data["old_log_probs"] = (lp_pad + torch.randn(lp_pad.shape, generator=g) * 0.15) * response_mask
    lp_leaf = lp_values.clone().requires_grad_(True)
    model_output = {
        "log_probs": torch.nested.nested_tensor_from_jagged(lp_leaf, offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(ent_values, offsets),
        "sum_pi_squared": torch.nested.nested_tensor_from_jagged(spsq_values, offsets),
    }
    return model_output, data, lp_leaf, n_tok


def bench_loss(configs, repeats: int, warmup: int = 3):
    mo, data, lp, n_tok = make_micro_batch()
    # The engine returns sum_pi_squared only when actor.calculate_sum_pi_squared is on (not by default):
    # every variant gets log_probs + entropy; "grad_norm+spsq" also gets sum_pi_squared (exact norm).
    plain = {k: v for k, v in mo.items() if k != "sum_pi_squared"}
    variants = {"stock": partial(ppo_loss, configs["stock"], plain)}
    for p in PRESETS:
        variants[p] = partial(tokensel_ppo_loss, configs[p], plain)
    variants["grad_norm+spsq"] = partial(tokensel_ppo_loss, configs["grad_norm"], mo)

    def once(fn):
        lp.grad = None
        t0 = time.perf_counter()
        loss, _ = fn(data)
        loss.backward()
        return time.perf_counter() - t0

    for _ in range(warmup):
        for fn in variants.values():
            once(fn)
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            times[k].append(once(fn))
    return _summarise(times), n_tok


# --------------------------------------------------------------------------------------------
# part 2: one real actor update step (verl TrainingWorker, FSDP2, CPU)
# --------------------------------------------------------------------------------------------
def bench_engine(repeats: int, warmup: int = 2):
    worker_kw = dict(ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=4, ppo_max_token_len_per_gpu=4096,
                     lr=0.0, clip_grad=1e6)
    model_dir = H.tiny_model.build_tiny_model_dir()
    actor = H.make_training_worker(model_dir, use_dynamic_bsz=False, use_remove_padding=True, **worker_kw)
    batch = B.make_update_batch(actor, n=16, seed=0, prompt_len=(32, 96), resp_len=(192, 384))
    H.compute_old_log_probs(actor, batch)  # the real old-log-prob pass (on-policy)

    variants = {"stock": (H.default_loss_fn(actor.actor_config), False)}
    for p in PRESETS:
        cfg, _, _ = H.make_actor_config(
            model_dir, use_dynamic_bsz=False, use_remove_padding=True,
            overrides=[f"actor_rollout_ref.actor._target_={ACTOR_TARGET}",
                       f"+actor_rollout_ref.actor.token_selector={p}",
                       f"+actor_rollout_ref.actor.token_selection._target_={SELECTION_TARGET}",
                       *[f"+actor_rollout_ref.actor.token_selection.{k}={v}"
                         for k, v in _in_loss_overrides(p).items()]],
            **worker_kw)
        variants[p] = (partial(tokensel_ppo_loss, config=cfg), bool(cfg.needs_entropy))

    loss_seconds = [0.0]

    def timed(loss_fn):
        """The loss as the engine calls it, accumulating the seconds spent in its forward."""

        def call(model_output, data, dp_group=None):
            t0 = time.perf_counter()
            out = loss_fn(model_output=model_output, data=data, dp_group=dp_group)
            loss_seconds[0] += time.perf_counter() - t0
            return out

        return call

    variants = {k: (timed(fn), ent) for k, (fn, ent) in variants.items()}

    def once(loss_fn, entropy):
        b = batch.copy()
        tu.assign_non_tensor(b, calculate_entropy=entropy)
        loss_seconds[0] = 0.0
        r = H.run_train_step(actor, b, loss_fn=loss_fn, capture_params=False)
        assert r.loss == r.loss, "NaN loss"
        return r.seconds, loss_seconds[0]

    for _ in range(warmup):
        for fn, ent in variants.values():
            once(fn, ent)
    times = {k: [] for k in variants}
    in_loss = {k: [] for k in variants}
    for _ in range(repeats):
        for k, (fn, ent) in variants.items():
            step, lossf = once(fn, ent)
            times[k].append(step)
            in_loss[k].append(lossf)
    # a low-noise estimate: extra time inside the loss forward per step, relative to stock's step
    stock_step = statistics.median(times["stock"])
    stock_loss = statistics.median(in_loss["stock"])
    estimate = {k: 1.0 + (statistics.median(v) - stock_loss) / stock_step for k, v in in_loss.items()}
    share = stock_loss / stock_step
    return _summarise(times), {k: v[1] for k, v in variants.items()}, estimate, share


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--engine-repeats", type=int, default=9)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    configs = actor_configs()
    ratios, n_tok = bench_loss(configs, args.repeats)
    print(f"\nPart 1: loss forward+backward, one micro-batch of 16 x <=1024 response tokens "
          f"({n_tok} valid), median of {args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}")
    _table(ratios, 1.05)

    if args.no_engine:
        print("\nPart 2 skipped (--no-engine).")
        return
    if H is None:
        print(f"\nPart 2 skipped: no CPU engine helper ({HARNESS_ERROR}).")
        return
    eratios, entropy, estimate, share = bench_engine(args.engine_repeats)
    print(f"\nPart 2: one verl actor update step (TrainingWorker, FSDP2, CPU, tiny Qwen2, 16 responses of "
          f"192..384 tokens, 4 micro-batches), median of {args.engine_repeats} interleaved steps")
    _table(eratios, 1.02, entropy)
    print(f"\nPart 2b: the same steps, extra seconds spent inside the loss forward (timed around the engine's "
          f"loss call) / stock's step; stock's loss forward is {share:.1%} of its step. Excludes the engine's "
          f"entropy pass and the loss backward.")
    print(f"{'variant':<15} {'est. step ratio':>15}  target <= 1.02x")
    for k, r in estimate.items():
        note = "" if k == "stock" else ("  ok" if r <= 1.02 else "  ABOVE TARGET")
        print(f"{k:<15} {r:>14.3f}x{note}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
