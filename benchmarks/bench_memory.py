"""Peak memory and step time of token selection vs stock verl at a real vocabulary (CPU), printed as ratios.

Run (from the repository root; about 10 minutes at the defaults on a 2-core machine)::

    python benchmarks/bench_memory.py                      # hidden 128 and 1024
    python benchmarks/bench_memory.py --hidden 128 --steps 3

What runs: one real verl actor update per step (``TrainingWorker.train_mini_batch``, FSDP2 engine,
``use_remove_padding``) of a random Qwen2 with a vocabulary of 151,936 (Qwen3's), 2 layers, tied embeddings
and ``--hidden`` units; 4 responses per step in 2 PPO mini-batches (``ppo_mini_batch_size=2``), each one
micro-batch of ``--tokens`` tokens or more (prompt + response), old log-probs from the real log-prob pass
(on-policy). Two mini-batches so that ``gmts``'s pre-pass shows both cases: on the first mini-batch the
weights are those the old-log-prob pass measured, and the pre-pass reuses its values
(``token_selection.prepass_reuse``); on the second the weights have changed (one optimizer step), and it runs
its no-grad forward. The table reports the share of mini-batches that reused the old pass. Each variant runs in a FRESH
process for its peak memory: a warm-up step, then two measured steps; right before each update freed heap is
returned to the system (``malloc_trim``) and the peak-RSS mark is reset (``/proc/self/clear_refs``, after the
old-log-prob pass, which verl runs as a separate call), so the peak is the RSS high-water mark (``VmHWM``) of
the update itself, max over the two steps. Step times come from one more process
that runs every variant on one worker, interleaved, ``--steps`` rounds after a warm-up round (median per
variant), so machine noise hits all variants alike.

Variants (as a recipe would run them):

- ``none``: stock verl (``calculate_entropy=false`` in the update, verl's default);
- ``none+entropy``: stock verl with ``calculate_entropy=true`` (verl computes the entropy with its graph);
  a reference for what the graph costs, not a selector;
- ``forking``, ``grad_norm`` (``score_source=current``; forking turns on ``calculate_entropy``),
  ``gmts`` (``score_source=prepass``: the step includes its no-grad pre-pass, a forward on the second
  mini-batch), ``forking_paper``
  (``score_source=rollout``: the mask comes from the driver, whose selection time is added);
- ``forking(graph)``: ``forking`` with ``token_selection.no_grad_scores=false`` (verl's graph kept), a
  reference for the before/after of the no-graph path.

Targets (issue "no extra memory"): every selector <= 1.05x ``none`` in peak memory; step time <= 1.10x at
hidden 128 and <= 1.03x at hidden 1024; ``gmts`` <= 1.25x. The last line is
``worst selector peak-memory ratio: X.XXx`` (the worst of the selectors over all hidden sizes).
Absolute numbers are printed for the record only: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 151_936
SELECTORS = ["forking", "gmts", "grad_norm", "forking_paper"]
REFERENCES = ["none+entropy", "forking(graph)"]
VARIANTS = ["none", "none+entropy", "forking", "forking(graph)", "gmts", "grad_norm", "forking_paper"]
TARGET_MEM = 1.05
TARGET_TIME = {128: 1.10, 1024: 1.03}
TARGET_GMTS = 1.25


def build_model_dir(root: Path, hidden: int) -> str:
    """The tiny tokenizer with a random Qwen2 of vocabulary 151,936 and ``hidden`` units (cached)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_tokensel.cpu import tiny_model

    path = root / f"qwen2_v{VOCAB}_h{hidden}"
    if (path / "config.json").exists():
        return str(path)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=str(root)))
    tok = tiny_model.build_tiny_tokenizer(tmp)
    heads = max(2, hidden // 64)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
        max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="float32",
        eos_token_id=tok.convert_tokens_to_ids(tiny_model.EOS_TOKEN),
        pad_token_id=tok.convert_tokens_to_ids(tiny_model.PAD_TOKEN), bos_token_id=None,
    )
    config._attn_implementation = "eager"
    import torch

    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(str(tmp), safe_serialization=True)
    os.replace(tmp, path)
    return str(path)


def _hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``), then reset the RSS high-water mark, so the
    next peak counts what the update allocates, not what earlier phases left mapped."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the mark is reset all the same
        pass
    Path("/proc/self/clear_refs").write_text("5")


class _Variant:
    """One variant on a worker: its loss, whether the update computes entropy, its selection config."""

    def __init__(self, actor, variant: str):
        from verl_tokensel.cpu import worker as H
        from verl_tokensel.verl_glue.loss import SelectingLoss

        preset = {"forking(graph)": "forking"}.get(variant, variant)
        knobs = {"no_grad_scores": False} if variant == "forking(graph)" else {}
        stock = variant in ("none", "none+entropy")
        self.name = variant
        self.actor = actor
        self.config = None if stock else H.selecting_actor_config(actor, preset, **knobs)
        self.loss_fn = H.default_loss_fn(actor.actor_config) if stock else SelectingLoss(self.config)
        needs = bool(self.config is not None and self.config.needs_entropy)
        self.entropy_in_update = variant == "none+entropy" or needs

    def step(self, resp: int) -> tuple[float, int, float]:
        """One update (after its old-log-prob pass): (seconds incl. the driver's selection, the update's peak KiB,
        the share of its mini-batches whose pre-pass reused the old pass's values; NaN without a pre-pass)."""
        from verl_tokensel.cpu import batches as B, worker as H

        from verl.utils import tensordict_utils as tu

        batch = B.make_update_batch(self.actor, n=4, seed=0, prompt_len=(128, 128), resp_len=(resp, resp),
                                    group_size=2)
        H.compute_old_log_probs(self.actor, batch)  # the real old-log-prob pass (keeps `entropy` for the driver)
        tu.assign_non_tensor(batch, calculate_entropy=self.entropy_in_update)
        extra = 0.0
        _reset_hwm()  # the update's own peak from here (the old-log-prob pass is another call in verl)
        if self.config is not None and self.config.selection.score_source == "rollout":
            extra = _driver_select(self.config, batch)
        r = H.run_train_step(self.actor, batch, loss_fn=self.loss_fn, capture_params=False)
        assert r.loss == r.loss, f"{self.name}: NaN loss"
        reused = r.metrics.get("tokensel/prepass/reused_old_pass")
        share = statistics.fmean(map(float, reused)) if isinstance(reused, list) and reused else float("nan")
        return r.seconds + extra, _hwm_kb(), share


def _actor(model_dir: str, tokens: int):
    from verl_tokensel.cpu import worker as H  # selects verl's CPU platform first

    return H.make_training_worker(model_dir, use_remove_padding=True, ppo_mini_batch_size=2,
                                  ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=4 * tokens,
                                  lr=0.0, clip_grad=1e9, num_threads=None)


def child_memory(variant: str, model_dir: str, tokens: int) -> dict:
    """Peak RSS of one variant's update, in this fresh process (a warm-up step, then the max over two measured
    steps: one step's RSS peak varies with what the allocator kept from earlier phases)."""
    v = _Variant(_actor(model_dir, tokens), variant)
    v.step(tokens // 2)  # warm-up: optimizer state, allocator pools
    peak = max(v.step(tokens // 2)[1] for _ in range(2))
    return {"variant": variant, "peak_kb": peak}


def child_time(variants: list[str], model_dir: str, tokens: int, steps: int) -> dict:
    """Step time of every variant on ONE worker, interleaved (v1, v2, ..., v1, v2, ...): median per variant."""
    actor = _actor(model_dir, tokens)
    vs = [_Variant(actor, v) for v in variants]
    for v in vs:  # warm-up
        v.step(tokens // 2)
    times: dict = {v.name: [] for v in vs}
    reused: dict = {v.name: [] for v in vs}
    for _ in range(steps):
        for v in vs:
            seconds, _, share = v.step(tokens // 2)
            times[v.name].append(seconds)
            reused[v.name].append(share)
    return {k: {"seconds": statistics.median(t), "prepass_reused_share": statistics.fmean(reused[k])}
            for k, t in times.items()}


def _driver_select(config, batch) -> float:
    """What the driver does for ``score_source=rollout``; adds the mask fields to ``batch``; returns seconds."""
    from verl_tokensel.cpu.batches import add_driver_selection

    t0 = time.perf_counter()
    add_driver_selection(config, batch)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 1024], help="hidden sizes (default 128 1024)")
    ap.add_argument("--tokens", type=int, default=2304, help="tokens per micro-batch (default 2304: 2 x (128 + 1024))")
    ap.add_argument("--steps", type=int, default=3, help="interleaved timing rounds after a warm-up round (default 3)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "verl_tokensel_bench_memory"))
    ap.add_argument("--json", default=None, help="also write the measurements here")
    ap.add_argument("--no-time", action="store_true", help="measure peak memory only (skip the timing process)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "time":
        print(json.dumps(child_time(args.variants.split(","), args.model, args.tokens, args.steps)))
        return 0
    if args.child:
        print(json.dumps(child_memory(args.child, args.model, args.tokens)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "none" not in variants:
        ap.error(f"--variants {args.variants!r}: must include none; valid: {', '.join(VARIANTS)}")
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    worst = 0.0
    for hidden in args.hidden:
        model_dir = build_model_dir(root, hidden)
        rows = {}

        def run_child(*extra, label):
            t0 = time.time()
            proc = subprocess.run([sys.executable, __file__, "--model", model_dir, "--tokens", str(args.tokens),
                                   "--steps", str(args.steps), *extra], capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{label} (hidden {hidden}) failed with exit code {proc.returncode}")
            print(f"  hidden {hidden} {label}: done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
            return json.loads(proc.stdout.strip().splitlines()[-1])

        for v in variants:  # peak memory: one fresh process per variant
            rows[v] = run_child("--child", v, label=f"{v} (memory)")
        nan = {"seconds": float("nan"), "prepass_reused_share": float("nan")}
        timed = ({v: nan for v in variants} if args.no_time else
                 run_child("--child", "time", "--variants", ",".join(variants), label="all variants (time)"))
        for v in variants:
            rows[v].update(timed[v])
        base = rows["none"]
        target_t = TARGET_TIME.get(hidden)
        print(f"\nhidden {hidden}, vocabulary {VOCAB}, >= {args.tokens} tokens per micro-batch; time: median of "
              f"{args.steps} interleaved steps (none: peak {base['peak_kb'] / 2**20:.2f} GiB, "
              f"step {base['seconds']:.1f} s)")
        print(f"{'variant':<16} {'peak memory':>12} {'step time':>10} {'pre-pass reused':>19}  "
              f"targets: memory <= {TARGET_MEM:.2f}x, time <= "
              f"{target_t if target_t else float('nan'):.2f}x (gmts <= {TARGET_GMTS:.2f}x)")
        for v, r in rows.items():
            m, t = r["peak_kb"] / base["peak_kb"], r["seconds"] / base["seconds"]
            r["peak_ratio"], r["time_ratio"] = m, t
            note = ""
            if v in SELECTORS:
                worst = max(worst, m)
                t_target = TARGET_GMTS if v == "gmts" else target_t
                ok_m = m <= TARGET_MEM
                ok_t = t_target is None or t != t or t <= t_target  # t is NaN with --no-time
                note = "  ok" if ok_m and ok_t else "  NOT MET: " + ", ".join(
                    [s for s, ok in (("memory", ok_m), ("time", ok_t)) if not ok])
            elif v in REFERENCES:
                note = "  (reference)"
            share = r.get("prepass_reused_share", float("nan"))
            reused = f"{share:.0%} of mini-batches" if share == share else "-"
            print(f"{v:<16} {m:>11.2f}x {t:>9.2f}x {reused:>19}{note}")
        results[str(hidden)] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"worst selector peak-memory ratio: {worst:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
