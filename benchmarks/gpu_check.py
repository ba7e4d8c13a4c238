"""GPU check: verl's actor update on a Qwen3-0.6B-shaped model, every token_selector preset, FSDP2 and Megatron.

Run on the GPU machine from the repository root (``scripts/gpu_check.sh`` installs the carried wheels
offline first, then runs this under ``timeout``)::

    python benchmarks/gpu_check.py --out "$OUT/gpu_check.json"     # every preset; deadline 8 min
    python benchmarks/gpu_check.py --variants none forking gmts --steps 3 --out "$OUT/gpu_check.json"  # the comparison
    python benchmarks/gpu_check.py --no-fsdp --variants none forking gmts --steps 3 \
        --budget-megatron 330 --deadline 420 --out "$OUT/gpu_check.json"   # the Megatron phase alone

Here, on a CPU (tiny model, fp32; the Megatron phase on the CPU test bed; the test suite runs this; ~25 s, every
preset on FSDP2 in ~15 of them)::

    python benchmarks/gpu_check.py --tiny --device cpu --out /tmp/gpu_check.json

What it does, in one process, through verl's own ``TrainingWorker`` built by the in-process harness
(``verl_tokensel_cpu.worker.make_training_worker``; ``VERL_TOKENSEL_HARNESS_DEVICE=cuda`` on GPU):

1. model: writes a random-init Qwen3 shaped like Qwen3-0.6B (hidden 1024, 28 layers, 16 heads, 8 KV
   heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings) and a locally trained
   byte-level BPE tokenizer (``verl_tokensel_cpu.tiny_model``). Nothing is downloaded. ``--tiny``: hidden
   64, 2 layers, 2 heads, 2 KV heads (``tiny_model.MEGATRON_TINY_CONFIG``: TP=2 would divide them too).
   Both phases train the same folder.
2. fsdp: FSDP2 engine, bf16 compute (fp32 master weights), ``flash_attention_2`` if ``flash_attn``
   imports, else ``sdpa``; ``use_remove_padding`` and ``use_dynamic_bsz``, gradient checkpointing
   (verl's defaults); one mini-batch split into micro-batches of <= 16384 tokens; ``lr=0`` so every step sees
   the same weights and the old log-probs (the real log-prob pass, once) stay on-policy. The batch
   (``--workload``): ``compare``, 16 responses of 3584..4096 tokens (4 GRPO groups of 4, ~66k tokens), for up
   to 8 variants; ``sweep``, 8 responses of 2048..2560 (2 groups of 4, ~21k tokens), for more.
   Variants: by default every preset of ``verl_tokensel.core.resolve.presets.PRESETS``, read at run time (``none``
   first, the baseline), plus ``none+entropy`` (stock verl with the entropy pass on) and
   ``forking:no_grad_scores=false`` (``forking`` with verl's entropy graph kept), two references for what the
   no-graph entropy saves: ``default_variants()``; ``--variants`` narrows the list (the presets it leaves out
   are printed and recorded as ``config.presets_not_in_variants``). Each preset runs as it is configured:
   a ``score_source=prepass`` preset (``gmts``, ``kl_cov_global``, ``clip_cov_global``, ``stapo``,
   ``m2po_global``) with the worker's real pre-pass (one no-grad forward before its update, installed on the
   worker by the harness as the tokensel actor workers install it; the step never follows an old-log-prob pass,
   so it includes that forward; ``m2po_global``'s score reads no policy value, so its pre-pass runs no forward,
   and the batch carries rollout log-probs: the old pass's moved by a keyed uniform ``ROLLOUT_SHIFT`` wide); a
   ``score_source=rollout`` preset (``forking_paper``, ``ktae``, ``gtpo``) with the driver's
   selection over the batch before each step (``verl_tokensel_cpu.batches.add_driver_selection``, timed with
   the step); a rule with several update passes (``lopti``, ``ar_lopti``) with one whole update per pass, the
   pass number set as the drivers set it, the metrics merged by the rule; a rule that weights the KL loss
   per token (``archer``) with Archer's ``use_kl_loss=true``, ``low_var_kl``, ``kl_loss_coef=0.001`` and the
   old log-probs as the reference's (``KL_LOSS_SETTINGS``); ``gtpo`` with its entropy threshold above
   ln(vocab) (``RANDOM_MODEL_KNOBS``: a random model's entropy is near ln(vocab), above which GTPO gives no
   update at all). An explicit knob converts (``gmts:score_source=current,scope=micro_batch``: its in-loss
   twin; ``parse_variant``). A sanity step per variant, warm-up steps, then timed steps interleaved across the
   variants (none, none+entropy, forking, ..., none, ...); defaults: 1 warm-up and 5 timed rounds up to 8
   variants, none and 1 with more. Targets: ``forking`` peak memory <= 1.05x ``none``, step time <= 1.01x.
   Reported: median step time and its ratio vs ``none``, peak ``torch.cuda.max_memory_allocated`` over the
   timed steps and its ratio.
   Sanity (the step with hooks, not timed), per variant: the loss (each pass's) and the gradient norm are
   finite, the norm positive; for a selecting preset the ``tokensel/*`` metrics reached the step's metrics,
   their ``tokensel/selected_fraction`` and the share the loss's masks selected are in (0, 1], no padding
   position is selected; the counts the rule promises: exactly ``ceil(ratio N)`` of the ``N`` valid response
   tokens per micro-batch (micro_batch scope, a count budget), the tokens strictly above each response's
   ``1 - ratio`` quantile (sequence scope, quantile budget: ``archer``, ``aspo``), the sum over the pools of
   ``ceil(ratio n)`` over the step (group, batch scopes), KL-Cov's ``max(1, int(ratio N))``, and for a pre-pass
   preset that the loss applied the tokens its ``tokensel/prepass/*`` metrics report; where the rule's mask is
   a gradient gate (``gates_gradient``: ``gradient_mask``, ``stapo``, ``lopti``, ``fipo``) the logits'
   gradient is exactly zero at every unselected response token and non-zero at the selected ones (with
   several passes the unselected ones only: each pass zeroes the advantages of the tokens it does not
   update); ``archer`` also has its ``kl_loss``. A variant that cannot run (its config refused, an exception
   in its step, the phase budget spent before its sanity step) gets a row saying why, is left out of the
   timed rounds and counts as a failure.
3. megatron: verl's Megatron engine (``MegatronEngineWithLMHead``) built by the same harness
   (``make_training_worker(engine="megatron")``, TP=PP=1, one data-parallel rank), same model folder, batch
   and measurements; variants ``--megatron-variants`` (default: ``--variants`` if given, else ``none``,
   ``forking``, ``gmts``; the table's ratios are vs the first). ``gmts`` runs with its
   real pre-pass here (``score_source=prepass``, group scope): one no-grad forward over the mini-batch
   before its update, as in the FSDP phase; the timed steps never follow an old-log-prob pass, so each
   includes that forward (in training, the first mini-batch of a step reuses the old-log-prob pass instead:
   ``prepass_reuse``). A preset scored on the driver, or with several update passes or the KL loss, runs as
   in the FSDP phase. The stack it ran on is recorded under ``megatron.stack`` and printed under its table:

   * GPU, production: megatron-core + mbridge (``vanilla_mbridge=True``; carried by
     ``scripts/pack_megatron_wheels.sh``: megatron-core 0.16.1, mbridge 0.15.1, which fails on
     megatron-core >= 0.17), or megatron-bridge (verl's default) where it imports, bf16 (verl's engine
     default), TransformerEngine layers, attention backend ``flash`` if flash-attn imports, else ``auto``
     (TransformerEngine's cuDNN fused attention).
   * GPU without TransformerEngine's torch extension (PyPI publishes ``transformer_engine_torch`` as a
     source archive only, so the carried default set has none; see ``scripts/pack_megatron_wheels.sh``):
     megatron-core's local layers (mbridge's layer spec with ``use_transformer_engine=False``, the
     layer-spec shim of ``verl_tokensel_cpu.megatron``) with ``torch.nn.functional.scaled_dot_product_attention``
     per packed sequence in place of the local ``DotProductAttention`` (which rejects packed sequences),
     no fused kernels: ``stack.layers = "local"``. The ratios then measure the selection on an unfused
     Megatron model, not on the production one.
   * CPU (``--device cpu``, the dry run): the CPU test bed of ``verl_tokensel_cpu.megatron`` (gloo, local
     layers and attention, fp32). ``--megatron-attention sdpa`` runs the GPU fallback's attention there.

   Sanity as for FSDP (a pre-pass variant ``gmts``: the masks the loss applied hold exactly the sum over
   the GRPO groups of ``ceil(0.2 n_g)`` tokens, as the pre-pass's ``tokensel/prepass/*`` metrics report;
   both phases run it so, and ``fsdp_vs_megatron`` compares them). The logit-gradient check hooks the last stage's
   ``output_layer`` (logits ``[tokens, 1, vocab]`` in the packed layout; at TP=1 no sequence is padded,
   so the positions map as in FSDP). Recompute: ``--megatron-recompute`` (default ``none``, verl's
   Megatron default; FSDP's gradient checkpointing does not apply to this engine).
   Both phases train the same weights on the same batch: ``fsdp_vs_megatron`` (printed under the tables)
   puts their old-log-prob means and sanity-step losses side by side (fp32 on CPU: equal; bf16: close).
   Not run on a GPU yet: the Megatron phase has run only on the CPU test bed (megatron-core 0.16.1,
   mbridge 0.15.1, verl 0.9.1, Python 3.11); neither GPU stack above has run. An exception there is
   reported as ``megatron.status = "error"`` with its traceback, and counts as a failure.

Output: a table per phase on stdout and a JSON (``--out``, default ``$OUT/gpu_check.json`` when ``$OUT``
is set). Time: every phase has a budget (timed rounds stop early when theirs is spent, recorded as
``rounds_done``; the FSDP steps' budget is cut to what the deadline leaves after the Megatron phase's when
that phase runs); the whole run has a deadline (``--deadline``), past which a watchdog writes the
partial JSON and exits 3. Exit codes: 0 ok, 1 a sanity check failed, 2 usage or environment error,
3 deadline exceeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

# Qwen3-0.6B's architecture (its config.json), random weights
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  rms_norm_eps=1e-6)
TINY_QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, intermediate_size=128, vocab_size=1024, tie_word_embeddings=True,
                  max_position_embeddings=1024, rms_norm_eps=1e-6)
# Both vocabularies exceed the tokenizer's 384 tokens (as Qwen3's 151936 exceeds its 151669): the
# batches draw ids from the whole model vocabulary. The tiny shape takes its KV heads from
# verl_tokensel_cpu.tiny_model.MEGATRON_TINY_CONFIG (see build_model_dir): one folder serves both engines.

#: the two references run beside the presets: stock verl with the entropy pass on, and ``forking`` with verl's
#: entropy graph kept (what the no-graph entropy saves); each follows its preset in the default list
EXTRA_VARIANTS = ("none+entropy", "forking:no_grad_scores=false")
#: up to this many variants the default run is the comparison (GPU_WORKLOAD, 5 timed rounds); more: the sweep
MANY_VARIANTS = 8
# the Megatron phase's default when --variants is not given either: the comparison the phase is for, in a
# budget that leaves the FSDP phase its own (every preset on Megatron: tests/test_megatron_engine_on_cpu.py)
DEFAULT_MEGATRON_VARIANTS = ("none", "forking", "gmts")
EXIT_OK, EXIT_FAILED, EXIT_ENV, EXIT_DEADLINE = 0, 1, 2, 3


@dataclasses.dataclass
class Workload:
    """One mini-batch per step; sizes in tokens."""

    n: int
    group_size: int
    prompt_len: tuple[int, int]
    resp_len: tuple[int, int]
    max_token_len: int  # ppo_max_token_len_per_gpu (dynamic bsz budget per micro-batch)


GPU_WORKLOAD = Workload(n=16, group_size=4, prompt_len=(128, 512), resp_len=(3584, 4096), max_token_len=16384)
# every preset in one run: half the responses, shorter (~21k tokens per step, two micro-batches), so that a sanity
# step and one timed step of each fit the phase budget (one step of GPU_WORKLOAD took 17 s on an H200)
SWEEP_WORKLOAD = Workload(n=8, group_size=4, prompt_len=(128, 512), resp_len=(2048, 2560), max_token_len=16384)
TINY_WORKLOAD = Workload(n=8, group_size=4, prompt_len=(8, 16), resp_len=(24, 48), max_token_len=128)


def variant_preset(spec: str) -> str:
    """The preset a variant spec (``PRESET[+entropy][:knob=value,...]``) runs."""
    return spec.partition(":")[0].partition("+")[0]


def default_variants() -> list[str]:
    """Every preset of ``verl_tokensel.core.resolve.presets.PRESETS`` (read now: presets registered later are included),
    ``none`` first (the baseline), each of :data:`EXTRA_VARIANTS` right after its preset."""
    from verl_tokensel.core.config import PRESETS

    names = ["none", *(p for p in PRESETS if p != "none")]
    out = []
    for name in names:
        out.append(name)
        out += [x for x in EXTRA_VARIANTS if variant_preset(x) == name]
    return out


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# time: phase budgets and the overall deadline
# ------------------------------------------------------------------------------------------------
class Clock:
    """Phase budgets (soft: loops ask ``left()``) and the run's deadline (hard: a watchdog thread)."""

    def __init__(self, deadline_s: float, results: dict, out_path: str | None):
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s
        self.results = results
        self.out_path = out_path
        self.phase = None
        self.phase_end = math.inf
        self._watchdog = threading.Timer(deadline_s, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        msg = (f"overall deadline of {self.deadline_s:.0f}s exceeded during phase {self.phase!r}; "
               f"partial results in {self.out_path or '(no --out)'}")
        self.results["status"] = "deadline_exceeded"
        self.results["failures"].append(msg)
        self.results["seconds"] = round(self.elapsed(), 1)
        for _ in range(3):  # the main thread may be mutating results right now
            try:
                write_json(self.results, self.out_path)
                break
            except RuntimeError:
                time.sleep(0.2)
        print(f"gpu_check: ERROR: {msg}", file=sys.stderr, flush=True)
        os._exit(EXIT_DEADLINE)  # from this thread: the main one may be inside a CUDA call

    def cancel(self) -> None:
        self._watchdog.cancel()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        """Seconds left in the current phase (and before the deadline, less a margin for writing out)."""
        return min(self.phase_end - time.monotonic(), self.total_left())

    def total_left(self) -> float:
        """Seconds left before the deadline, less a margin for writing out."""
        return self.t0 + self.deadline_s - 5.0 - time.monotonic()

    def run_phase(self, name: str, budget_s: float, fn, *args, **kwargs):
        """Run ``fn`` as phase ``name``; record budget, seconds and status under results["phases"]."""
        self.phase, t = name, time.monotonic()
        self.phase_end = t + budget_s
        rec = self.results["phases"].setdefault(name, {"budget_s": budget_s})
        log(f"phase {name} (budget {budget_s:.0f}s, {self.deadline_s - self.elapsed():.0f}s to the deadline)")
        try:
            return fn(*args, **kwargs)
        finally:
            rec["seconds"] = round(time.monotonic() - t, 2)
            rec["status"] = "over_budget" if rec["seconds"] > budget_s else "ok"
            self.phase, self.phase_end = None, math.inf


def write_json(results: dict, path: str | None) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# phase: environment
# ------------------------------------------------------------------------------------------------
def _version(dist: str):
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_env(args) -> dict:
    import torch

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        **{k: _version(k) for k in ("verl", "transformers", "tensordict", "verl-tokensel", "flash-attn",
                                    "megatron-core", "mbridge", "megatron-bridge", "transformer-engine",
                                    "transformer-engine-cu13", "transformer-engine-cu12",
                                    "transformer-engine-torch", "ray")},
        "device": args.device,
    }
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentError(f"--device cuda but torch {torch.__version__} sees no CUDA device "
                                   "(CPU-only torch build, or no GPU): run with --device cpu --tiny here")
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count())
    return env


def pick_attention(args) -> str:
    if args.attn != "auto":
        return args.attn
    if args.device == "cpu":
        return "eager"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


# ------------------------------------------------------------------------------------------------
# phase: model
# ------------------------------------------------------------------------------------------------
def build_model_dir(path: Path, tiny: bool, device: str, seed: int = 0) -> tuple[str, dict]:
    """Tokenizer (tiny byte-level BPE) + random-init Qwen3 saved with ``save_pretrained``. Returns (dir, config)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from verl_tokensel_cpu import tiny_model

    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_model.build_tiny_tokenizer(path)
    shape = dict(TINY_QWEN3 if tiny else QWEN3_0_6B)
    if tiny:  # Megatron needs num_key_value_heads divisible by TP: the test bed's tiny variant
        shape.update(tiny_model.MEGATRON_TINY_CONFIG)
    eos, pad = tok.convert_tokens_to_ids(tiny_model.EOS_TOKEN), tok.convert_tokens_to_ids(tiny_model.PAD_TOKEN)
    dtype = torch.float32 if tiny else torch.bfloat16
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=eos, pad_token_id=pad, use_sliding_window=False)
    config.dtype = dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # initialised on the GPU when there is one: 0.6B parameters take seconds there, a minute on CPU
        with torch.device("cuda" if device == "cuda" else "cpu"):
            model = Qwen3ForCausalLM(config).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return str(path), {**{k: v for k, v in shape.items() if k != "rope_parameters"}, "parameters": n_params,
                       "tokenizer_size": len(tok), "saved_dtype": str(dtype).replace("torch.", "")}


# ------------------------------------------------------------------------------------------------
# per-step instruments: sanity hooks, timing, memory
# ------------------------------------------------------------------------------------------------
def lm_head_module(actor):
    """(module, None) for the module whose output is the logits, or (None, why there is none).

    HF models (FSDP): ``lm_head``. Megatron: ``actor.module`` is the list of model chunks; the logits come
    from ``output_layer`` of the last chunk on the last pipeline stage (with tied embeddings too: the
    layer is called with the embedding's weight).
    """
    module = actor.module
    if isinstance(module, (list, tuple)):
        from megatron.core import parallel_state as mpu

        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return None, "this pipeline stage has no output_layer"
        for name, sub in module[-1].named_modules():
            if name.rsplit(".", 1)[-1] == "output_layer":
                return sub, None
        return None, "no output_layer in the last Megatron model chunk"
    head = getattr(module, "lm_head", None)
    return (head, None) if head is not None else (None, "the model has no lm_head module")


def gates_gradient(sel) -> bool:
    """Whether the rule keeps the policy gradient on its mask only, so that the logit-gradient check applies: the
    base rule's transform (``gate=mask``: ``gradient_mask``, ``stapo``) and the two that add per-token weights to
    that gate (``lopti``, ``fipo``). The other rules give the unselected tokens a gradient of their own (the
    actor's clip bounds, a penalty, an advantage shift, a policy loss per token): their mask is no gradient gate."""
    from verl_tokensel.core.seam.rule import Rule

    return sel is None or type(sel.impl).transform is Rule.transform or sel.rule in ("lopti", "fipo")


def counts_by_budget(sel) -> bool:
    """Whether the rule selects with the base ranking (``ceil(ratio n)`` of a pool, or the quantile budget), so the
    selected counts can be checked against ``ratio``; rules with a selection of their own (the covariance rules,
    STAPO, KTAE, GTPO) are checked by what they report."""
    from verl_tokensel.core.seam.rule import Rule

    return sel is not None and type(sel.impl).select is Rule.select


class SanityRecorder:
    """Per micro-batch: the mask the loss used, the response/prompt lengths, and which logit rows got gradient.

    The loss wrapper records lengths for every variant (``none`` included: its "mask" is all valid
    tokens); the selecting loss's observer adds the mask. The LM head's forward hook stores, in the
    same order, a per-position flag "the logits' gradient is not all zero" (``amax != 0 or amin != 0``
    over the vocabulary: no copy of the (tokens, vocab) gradient). HF's ``lm_head`` returns logits
    ``(1, tokens, vocab)``, Megatron's ``output_layer`` ``(logits [tokens, 1, vocab], bias)``; both
    flatten to one flag per packed position. Forwards without gradient (the old-log-prob pass, a
    pre-pass) are not recorded.
    """

    def __init__(self, actor, align: int = 1):
        import torch

        self.calls: list[dict] = []
        self.grad_rows: list = []
        self.handle = None
        self.align = align  # per-sequence padding of the packed layout (Megatron: TP size; FSDP: 1)
        head, self.no_head_reason = lm_head_module(actor)
        if head is None:
            return

        def fwd_hook(module, inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and logits.requires_grad:
                slot = len(self.grad_rows)
                self.grad_rows.append(None)

                def on_grad(g, slot=slot):
                    g = g.detach()
                    self.grad_rows[slot] = ((g.amax(-1) != 0) | (g.amin(-1) != 0)).cpu()

                logits.register_hook(on_grad)

        self.handle = head.register_forward_hook(fwd_hook)

    def wrap(self, loss_fn):
        """``loss_fn`` as the engine calls it, recording the micro-batch's prompt and response lengths first.

        The same object comes back, its class swapped for a subclass: the worker-side pre-pass and the
        no-graph scores look for a ``SelectingLoss`` as the worker's loss, so a plain wrapper would turn
        them off.
        """
        recorder, base = self, type(loss_fn)

        class Recording(base):
            def __call__(self, model_output, data, dp_group=None):
                recorder.calls.append({
                    "prompt_lens": data["prompts"].offsets().diff().tolist(),
                    "resp_lens": data["responses"].offsets().diff().tolist(),
                    "mask": None,
                })
                return base.__call__(self, model_output=model_output, data=data, dp_group=dp_group)

        Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
        loss_fn.__class__ = Recording
        return loss_fn

    def observe(self, rec) -> None:
        self.calls[-1]["mask"] = rec["mask"].detach().cpu()
        self.calls[-1]["valid"] = rec["response_mask"].detach().cpu()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()

    def check(self, selection, rmpad: bool, expected_selected: int | None = None, passes: int = 1) -> dict:
        """Counts per micro-batch and the gradient-zero checks; ``failures`` lists what did not hold.

        ``expected_selected``: the number of tokens the whole step must select, for a selection made over
        a pool wider than one micro-batch (the pre-pass's group scope: the sum over the groups of
        ``ceil(ratio n_g)``); checked against the masks the loss applied over all micro-batches.
        ``passes``: the step's update passes (Lopti: 2, the micro-batches of both recorded); a pass zeroes the
        advantages of the tokens it does not update, so with several the selected tokens' gradient is not checked,
        only that no unselected token got one. A rule whose mask is no gradient gate (:func:`gates_gradient`) gets
        no logit-gradient check; the reason is recorded under ``grad_check_skipped``.
        """
        import torch

        from verl_tokensel.core.ranking.scopes import budget

        out = {"micro_batches": len(self.calls), "count_checked": 0, "grad_checked": 0, "failures": []}
        if not self.calls:
            out["failures"].append("the loss was never called")
            return out
        gate = gates_gradient(selection)
        grad_check = rmpad and self.handle is not None and gate
        if grad_check and (len(self.grad_rows) != len(self.calls) or any(g is None for g in self.grad_rows)):
            out["failures"].append(f"{len(self.calls)} loss calls but {len(self.grad_rows)} LM-head gradients")
            return out
        sel_total = valid_total = leaked = starved = 0
        fractions = []
        for k, call in enumerate(self.calls):
            pl, rl = call["prompt_lens"], call["resp_lens"]
            valid = torch.zeros(len(rl), max(rl), dtype=torch.bool)
            for i, r in enumerate(rl):
                valid[i, :r] = True
            if call.get("valid") is not None:
                valid = call["valid"][:, : valid.shape[1]].bool() & valid
            mask = call["mask"][:, : valid.shape[1]].bool() if call["mask"] is not None else valid
            n_valid, n_sel = int(valid.sum()), int(mask.sum())
            sel_total, valid_total = sel_total + n_sel, valid_total + n_valid
            fractions.append(n_sel / max(n_valid, 1))
            if bool((mask & ~valid).any()):
                out["failures"].append("a padding position was selected")
            by_budget = counts_by_budget(selection)
            kind = getattr(selection.knobs, "budget", "count") if selection is not None else None
            if by_budget and selection.scope == "micro_batch" and kind == "count":
                want = budget(selection.ratio, n_valid)
                out["count_checked"] += 1
                if n_sel != want:
                    out["failures"].append(f"micro-batch with {n_valid} valid tokens: {n_sel} selected, "
                                           f"ceil({selection.ratio} N) = {want}")
            elif by_budget and selection.scope == "sequence" and kind == "quantile":
                # strictly above the response's (1 - ratio) quantile (linear interpolation): with distinct scores
                # the top n - 1 - floor((1 - ratio)(n - 1)) of its n valid tokens
                q = 1.0 - selection.ratio
                rows_valid, rows_sel = valid.sum(-1).tolist(), mask.sum(-1).tolist()
                want_rows = [n - 1 - math.floor(q * (n - 1)) if n else 0 for n in rows_valid]
                out["count_checked"] += 1
                if rows_sel != want_rows:
                    out["failures"].append(f"micro-batch {k}: {rows_sel} selected per response of {rows_valid}, "
                                           f"above the {q:g} quantile {want_rows}")
            if not grad_check:
                continue
            rows = self.grad_rows[k]
            # packed layout (one row of all sequences, each padded to a multiple of ``align``): the logits
            # at position t predict token t + 1
            a = self.align
            offsets = torch.tensor([0, *[-(-(p + r) // a) * a for p, r in zip(pl, rl)]]).cumsum(0)
            got = torch.zeros_like(valid)
            flat = rows.reshape(-1)
            for i, (p, r) in enumerate(zip(pl, rl)):
                start = int(offsets[i]) + p - 1
                got[i, :r] = flat[start : start + r]
            out["grad_checked"] += 1
            leaked += int((got & valid & ~mask).sum())
            if passes == 1:
                starved += int((~got & mask).sum())
        if expected_selected is not None:
            out["expected_selected_tokens"] = expected_selected
            if sel_total != expected_selected:
                out["failures"].append(f"{sel_total} tokens selected over the step, {expected_selected} expected "
                                       f"(sum over the {selection.scope if selection else '?'} pools of "
                                       f"ceil({selection.ratio if selection else '?'} n))")
        out.update(selected_tokens=sel_total, valid_tokens=valid_total,
                   selected_fraction=sel_total / max(valid_total, 1),
                   selected_fraction_per_micro_batch=[round(f, 6) for f in fractions],
                   unselected_with_grad=leaked, selected_without_grad=starved)
        if leaked:
            out["failures"].append(f"{leaked} unselected response tokens got a non-zero logit gradient")
        if starved:
            out["failures"].append(f"{starved} selected tokens got no logit gradient")
        if not rmpad:
            out["grad_check_skipped"] = ("use_remove_padding=False: the position map is only written for the "
                                         "packed layout")
        elif self.handle is None:
            out["grad_check_skipped"] = f"{self.no_head_reason}: selected counts and metrics only"
        elif not gate:
            out["grad_check_skipped"] = (f"rule {selection.rule}: its mask is no gradient gate (the other tokens get "
                                         "a gradient of their own): selected counts and metrics only")
        elif passes > 1:
            out["selected_grad_check_skipped"] = (f"{passes} update passes, each zeroes the advantages of the tokens "
                                                  "it does not update: only the unselected tokens are checked")
        return out


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _scalar(v):
    if isinstance(v, list):
        v = [float(x) for x in v]
        return sum(v) / len(v) if v else None
    return float(v) if v is not None else None


# ------------------------------------------------------------------------------------------------
# the engine phase (FSDP2 or Megatron): same variants, same batch, same measurements
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    name: str
    preset: str
    entropy: bool  # calculate_entropy for the update pass
    config: object = None  # the actor config the loss is bound to
    selection: object = None  # verl_tokensel.core.config.Selection or None
    knobs: dict = dataclasses.field(default_factory=dict)  # token_selection.* overrides of the preset
    settings: dict = dataclasses.field(default_factory=dict)  # actor settings the preset needs (use_kl_loss, ...)
    error: str | None = None  # its config could not be built: the reason (the variant does not run)

    def loss_fn(self, observer=None):
        from verl_tokensel.verl_glue.loss import SelectingLoss

        return SelectingLoss(self.config, observer=observer)

    @property
    def passes(self) -> tuple:
        """The update passes of one step (``(None,)``: verl's one; Lopti: ``(1, 2)``, each a whole update)."""
        return self.selection.update_passes if self.selection is not None else (None,)

    @property
    def driver(self) -> bool:
        """The selection runs on the driver before the update (``score_source=rollout``)."""
        return self.selection is not None and self.selection.score_source == "rollout"

    @property
    def kl(self) -> bool:
        return bool(self.settings.get("use_kl_loss"))


def parse_variant(spec: str, run_prepass: bool = False, run_driver: bool = False) -> tuple[str, bool, dict]:
    """``PRESET[+entropy][:knob=value,...]`` -> (preset, entropy forced on, token_selection knobs).

    A preset whose scores come from outside the loss (``score_source`` prepass / rollout: a pre-pass
    or the driver fills ``token_select_mask``) that the caller cannot run there is measured with
    ``score_source=current`` and ``scope=micro_batch``: the same score and ratio, computed inside the loss.
    Both engine phases run the worker's real pre-pass (``run_prepass``, ``verl_tokensel.verl_glue.prepass``) and
    the driver's selection before the step (``run_driver``), so there every preset keeps its own source and scope.
    An explicit knob overrides either (``gmts:score_source=current,scope=micro_batch``: its in-loss twin).
    """
    from verl_tokensel.core.config import PRESETS

    head, _, knob_text = spec.partition(":")
    preset, _, extra = head.partition("+")
    if preset not in PRESETS or extra not in ("", "entropy"):
        raise ValueError(f"variant {spec!r}: use PRESET[+entropy][:knob=value,...] with a preset of "
                         f"{', '.join(PRESETS)}")
    knobs = {}
    sel = PRESETS[preset]
    source = getattr(sel, "score_source", "current") if sel is not None else "current"
    if source != "current" and not ((run_prepass and source == "prepass") or (run_driver and source == "rollout")):
        knobs.update(score_source="current", scope="micro_batch")
    for item in filter(None, knob_text.split(",")):
        k, _, v = item.partition("=")
        knobs[k.strip()] = {"true": True, "false": False}.get(v.strip().lower(), v.strip())
        try:
            knobs[k.strip()] = float(v) if "." in v else int(v)
        except ValueError:
            pass
    return preset, extra == "entropy", knobs


#: knobs a preset gets on this random-init model (an explicit knob of the variant spec wins). GTPO's entropy filter
#: (0.7 nats, for a trained policy) gives no update to a response above it, and a random model's entropy is about
#: ln(vocab) (6.9 tiny, 11.9 at Qwen3's vocabulary): every response would be filtered, the gradient exactly zero.
#: Lifted above any ln(vocab), the same computation runs and the update has a gradient to check. Lp-Reg's release
#: regularises nothing until its pool holds 2 / rho negative tokens (200 at rho 0.01, more than a tiny batch): rho 0.3
#: lets its candidates be chosen; kappa 0.5 filters some of a near-uniform random model's tokens (at 0.02 its proxy
#: keeps every token and equals the sampled token's log-prob, so no candidate is strictly below it).
RANDOM_MODEL_KNOBS = {"gtpo": {"gtpo_entropy_threshold": 100.0}, "lp_reg": {"lp_reg_rho": 0.3, "lp_reg_kappa": 0.5}}
#: rules whose selection may be empty on a random model, and why (their selected fraction is checked in [0, 1]): the
#: tokens Lp-Reg regularises must sit strictly under the old policy's min-p proxy, which depends on how peaked the
#: random model's distributions are (none on the --tiny model at kappa 0.5; some on the CPU harness's)
MAY_SELECT_NONE = {"lp_reg": "its candidates must sit strictly under the min-p proxy, which a random model may not "
                             "give"}

#: what a rule that weights the KL loss per token (``Needs(kl_loss=True)``: archer) gets on the actor: Archer's settings
KL_LOSS_SETTINGS = {"use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001}


def actor_view(actor, settings: dict):
    """``actor`` with ``settings`` on its actor node (``actor_rollout_ref.actor``), for the config the loss binds;
    the worker (the engine) is shared."""
    import copy

    from omegaconf import OmegaConf

    if not settings:
        return actor
    cfg = copy.deepcopy(actor.cfg)
    OmegaConf.set_struct(cfg, False)
    for k, v in settings.items():
        cfg.actor_rollout_ref.actor[k] = v
    return dataclasses.replace(actor, cfg=cfg)


def make_variants(H, actor, names) -> list[Variant]:
    """The actor configs (``H.selecting_actor_config``: ``TokenselFSDPActorConfig`` or, for a Megatron
    worker, ``TokenselMcoreActorConfig``) of the variants, each preset as it is configured (its pre-pass, its
    driver selection, its update passes) and with the actor settings it needs (a rule that weights the KL loss
    per token: :data:`KL_LOSS_SETTINGS`), with ``calculate_entropy`` as the tokensel trainers set it: on when the
    update pass needs the entropy (``needs_entropy``: the loss scores by entropy itself, or an entropy shaping),
    off otherwise, unless forced with ``+entropy``. A config that cannot be built is kept with its ``error``."""
    from verl_tokensel.core.config import PRESETS

    out = []
    for name in names:
        preset, force_entropy, knobs = parse_variant(name, run_prepass=True, run_driver=True)
        knobs = {**RANDOM_MODEL_KNOBS.get(preset, {}), **knobs}
        base = PRESETS[preset]
        settings = dict(KL_LOSS_SETTINGS) if base is not None and base.impl.needs.kl_loss else {}
        try:
            view = actor_view(actor, settings)
            probe = H.selecting_actor_config(view, preset, calculate_entropy=force_entropy, **knobs)
            sel = getattr(probe, "selection", None)
            entropy = force_entropy or bool(getattr(probe, "needs_entropy", False))
            cfg = (H.selecting_actor_config(view, preset, calculate_entropy=entropy, **knobs)
                   if entropy != force_entropy else probe)
        except Exception as e:  # a preset this worker cannot configure: reported, the others still run
            out.append(Variant(name, preset, force_entropy, knobs=knobs, settings=settings,
                               error=f"config: {type(e).__name__}: {e}"[:1500]))
            continue
        out.append(Variant(name, preset, entropy, cfg, sel, knobs, settings))
    return out


def expected_selected(sel, valid_per_row: list[int], uids: list) -> int | None:
    """Tokens a selection over a pool wider than one micro-batch keeps in the whole (single) mini-batch,
    or None when the pool is the micro-batch (checked per micro-batch instead) or the rule's count is its own
    (STAPO, Clip-Cov's draw among its candidates, KTAE, GTPO: checked by what their selection reports).
    KL-Cov: ``max(1, int(ratio N))`` of the mini-batch (``core.rules.covariance.cov_budget``)."""
    from verl_tokensel.core.ranking.scopes import budget

    if sel is None or sel.scope == "micro_batch":
        return None
    if sel.rule == "kl_cov" and sel.scope == "mini_batch":
        from verl_tokensel.core.rules.covariance import cov_budget

        return cov_budget(sel.ratio, sum(valid_per_row))
    if not counts_by_budget(sel) or getattr(sel.knobs, "budget", "count") != "count":
        return None
    if sel.scope == "sequence":
        return sum(budget(sel.ratio, n) for n in valid_per_row)
    if sel.scope == "group":
        groups: dict = {}
        for uid, n in zip(uids, valid_per_row):
            groups[uid] = groups.get(uid, 0) + n
        return sum(budget(sel.ratio, n) for n in groups.values())
    return budget(sel.ratio, sum(valid_per_row))  # mini_batch / batch: one mini-batch per step here


#: the rollout engine's log-probs for a score that reads them (m2po_global): the old pass's moved by a keyed
#: uniform of this width (what M2PO's second moment measures): its mean square, 1/12, is above M2PO's 0.04, so the
#: rule masks some tokens and the sanity step sees it act
ROLLOUT_SHIFT = 1.0


def rollout_log_probs(old_log_probs, seed: int):
    """``rollout_log_probs`` as a recipe with ``rollout.calculate_log_probs=true`` sends them: per response, the old
    pass's log-probs plus a keyed uniform(-ROLLOUT_SHIFT / 2, ROLLOUT_SHIFT / 2) (nested, as the batch)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = [x + (ROLLOUT_SHIFT * (torch.rand(x.shape, generator=gen) - 0.5)).to(x.device, x.dtype)
            for x in old_log_probs.unbind(0)]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@dataclasses.dataclass
class StepOutcome:
    """One step of a variant: its update passes' results and their merged metrics."""

    results: list
    metrics: dict
    seconds: float  # the update passes plus the driver's selection
    driver_s: float = 0.0

    @property
    def losses(self) -> list:
        return [r.loss for r in self.results]

    @property
    def grad_norms(self) -> list:
        return [r.grad_norm for r in self.results]


def run_engine_steps(H, actor, args, workload: Workload, clock: Clock, rec: dict, names, align: int = 1) -> list[str]:
    """Sanity step, warm-up, interleaved timed rounds for every variant. Fills ``rec``; returns failures.

    A variant that cannot run (its config refused, an exception in its sanity step, or the phase budget spent
    before its sanity step) is recorded with ``status`` and ``reason`` under ``rec["variants"]``, counted as a
    failure, and left out of the timed rounds; the others still run."""
    import torch
    from verl.utils import tensordict_utils as tu

    from verl_tokensel.core import fields
    from verl_tokensel_cpu import batches as B

    failures: list[str] = []
    variants = make_variants(H, actor, names)
    vocab = actor.model_config.hf_config.vocab_size
    batch = B.make_config_batch(actor.cfg, vocab, n=workload.n, seed=args.seed, calculate_entropy=False,
                                prompt_len=workload.prompt_len, resp_len=workload.resp_len,
                                group_size=workload.group_size)
    resp = batch["response_mask"].offsets().diff()
    tokens = int(batch["input_ids"].offsets()[-1])
    rec.update(responses=workload.n, tokens_per_step=tokens, response_tokens_per_step=int(resp.sum()),
               response_len_min=int(resp.min()), response_len_max=int(resp.max()),
               max_token_len_per_micro_batch=workload.max_token_len)
    t = time.perf_counter()
    olp, ent = H.compute_old_log_probs(actor, batch)  # the real log-prob pass: on-policy, nothing clipped (lr=0)
    _sync(args.device)
    rec["old_log_prob_pass_s"] = round(time.perf_counter() - t, 3)
    # the same weights and batch in both phases: these agree across engines (fp32: ~1e-6; bf16: looser)
    rec["old_log_prob_mean"] = float(olp.values().float().mean())
    rec["old_entropy_mean"] = float(ent.values().float().mean())
    rmpad = actor.use_remove_padding
    valid_per_row = [int(x.sum()) for x in batch["response_mask"].unbind(0)]
    uids = list(batch["uid"])
    eos = actor.tokenizer.eos_token_id
    rollout_lp = rollout_log_probs(batch[fields.OLD_LOG_PROBS], args.seed)

    def step(v: Variant, recorder: SanityRecorder | None = None) -> tuple[StepOutcome, float | None, float | None]:
        b = batch.copy()
        tu.assign_non_tensor(b, calculate_entropy=v.entropy)
        if v.kl:  # the reference model is the policy the step starts from (lr=0: the old log-probs)
            b[fields.REF_LOG_PROB] = batch[fields.OLD_LOG_PROBS].clone()
        if v.selection is not None and v.selection.needs_rollout_log_probs:  # m2po_global: the rollout engine's
            b[fields.ROLLOUT_LOG_PROBS] = rollout_lp
        loss_fn = v.loss_fn() if recorder is None else recorder.wrap(v.loss_fn(observer=recorder.observe))
        if v.selection is not None and any(st.forward == "old" for st in v.selection.impl.needs.vocab):
            # verl's old-log-prob pass under the rule's loss computes its vocabulary reductions (kept on the worker
            # for the update); untimed, as the old pass of the other variants
            actor.set_loss_fn(loss_fn)
            H.compute_old_log_probs(actor, b.copy(), write=False)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            resting = torch.cuda.memory_allocated()
        _sync(args.device)
        t0 = time.perf_counter()
        driver_s = 0.0
        if v.driver:  # what verl's driver adds before update_actor: the mask and scores of the whole batch
            B.add_driver_selection(v.config, b, eos_token_id=eos)
            driver_s = time.perf_counter() - t0
        results = []
        for n in v.passes:  # a rule with several update passes: one whole update per pass, as the drivers run it
            bp = b
            if n is not None:
                bp = b.copy()
                tu.assign_non_tensor(bp, **{fields.UPDATE_PASS: n})
            results.append(H.run_train_step(actor, bp, loss_fn=loss_fn, capture_params=False))
        _sync(args.device)
        seconds = time.perf_counter() - t0
        metrics = (results[0].metrics if len(results) == 1
                   else v.selection.impl.merge_passes([r.metrics for r in results]))
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
        return (StepOutcome(results, metrics, seconds, driver_s), peak,
                (resting if args.device == "cuda" else None))

    per = {v.name: {"preset": v.preset, "knobs": v.knobs, "calculate_entropy": v.entropy,
                    "selection": v.selection.as_knobs() if v.selection is not None else None,
                    "actor_settings": v.settings, "update_passes": len(v.passes), "driver_selection": v.driver,
                    "status": "pending", "step_s": [], "peak_mem_bytes": None, "resting_mem_bytes": None}
           for v in variants}
    rec["variants"] = per  # filled in place: a deadline's partial JSON keeps what was measured
    rec["rounds_done"] = rec["warmup_rounds"] = 0

    def not_run(v: Variant, status: str, reason: str, **extra) -> None:
        per[v.name].update(status=status, reason=reason, **extra)
        failures.append(f"{v.name}: not run ({status}): {reason}")
        log(f"{v.name}: {status}: {reason.splitlines()[0][:300]}")

    # 1. sanity step per variant (hooks on; not timed)
    runnable: list[Variant] = []
    for v in variants:
        if v.error is not None:
            not_run(v, "error", v.error)
            continue
        done_s = [per[u.name]["sanity"]["seconds"] / len(u.passes) for u in runnable]
        need = 1.1 * max(done_s, default=0.0) * len(v.passes)
        if done_s and clock.left() < need:
            not_run(v, "skipped", f"the phase budget was spent before its sanity step ({clock.left():.0f}s left, "
                                  f"~{need:.0f}s needed; raise --budget-steps or pass fewer --variants)")
            continue
        recorder = SanityRecorder(actor, align=align)
        try:
            o, _, _ = step(v, recorder)
        except Exception as e:  # this variant's step failed: reported, the others still run
            not_run(v, "error", f"sanity step: {type(e).__name__}: {e}"[:1500],
                    traceback=traceback.format_exc()[-4000:])
            continue
        finally:
            recorder.close()
        want = expected_selected(v.selection, valid_per_row, uids)
        s = recorder.check(v.selection, rmpad, expected_selected=want, passes=len(v.passes))
        m = o.metrics
        losses, gns = o.losses, o.grad_norms
        s.update(loss=sum(losses) / len(losses) if None not in losses else None,
                 grad_norm=sum(gns) / len(gns) if None not in gns else None, seconds=round(o.seconds, 3))
        if len(o.results) > 1:
            s.update(pass_losses=losses, pass_grad_norms=gns)
        if not all(x is not None and math.isfinite(x) for x in losses):
            s["failures"].append(f"loss not finite: {losses if len(losses) > 1 else losses[0]}")
        if not all(x is not None and math.isfinite(x) for x in gns) or not any(x and x > 0 for x in gns):
            s["failures"].append(f"grad norm not finite and positive: {gns if len(gns) > 1 else gns[0]}")
        if v.kl:
            s["metric_kl_loss"] = _scalar(m.get("kl_loss"))
            if s["metric_kl_loss"] is None:
                s["failures"].append("kl_loss missing from the step's metrics (use_kl_loss is on)")
        if v.selection is not None:
            s["metric_selected_fraction"] = _scalar(m.get("tokensel/selected_fraction"))
            s["metric_grad_mass_kept"] = _scalar(m.get("tokensel/grad_mass_kept"))
            s["metric_nan_scores"] = _scalar(m.get("tokensel/nan_scores"))
            s["metric_keys"] = sorted(k for k in m if k.startswith("tokensel/"))
            frac = s["metric_selected_fraction"]
            may_be_empty = MAY_SELECT_NONE.get(v.selection.rule)
            lowest, shown = (0.0, "[0, 1]") if may_be_empty else (None, "(0, 1]")
            if may_be_empty:
                s["selection_may_be_empty"] = may_be_empty

            def outside(x) -> bool:
                return not ((x >= 0.0 if lowest is not None else x > 0.0) and x <= 1.0)

            if frac is None:
                s["failures"].append("tokensel/selected_fraction missing from the step's metrics")
            elif outside(frac):
                s["failures"].append(f"tokensel/selected_fraction = {frac}, not in {shown}")
            if outside(s.get("selected_fraction", 0.0)):
                s["failures"].append(f"the masks the loss applied select {s.get('selected_fraction')} of the valid "
                                     f"tokens, not in {shown}")
            if s["metric_nan_scores"]:
                s["failures"].append(f"tokensel/nan_scores = {s['metric_nan_scores']}")
            if v.driver:  # the driver's selection: the mask the loss applied is the driver's
                s["driver_select_s"] = round(o.driver_s, 4)
            if v.selection.score_source == "prepass":  # the worker's pre-pass ran and selected what it reports
                pre = "tokensel/prepass/"
                s["prepass_selected_tokens"] = _scalar(m.get(pre + "selected_tokens"))
                s["prepass_selected_fraction"] = _scalar(m.get(pre + "selected_fraction"))
                s["prepass_reused_old_pass"] = _scalar(m.get(pre + "reused_old_pass"))
                s["prepass_seconds"] = _scalar(m.get(pre + "seconds"))
                if s["prepass_selected_tokens"] is None:
                    s["failures"].append(f"{pre}selected_tokens missing: the pre-pass did not run")
                elif want is not None and round(s["prepass_selected_tokens"]) != want:
                    s["failures"].append(f"the pre-pass selected {s['prepass_selected_tokens']:.0f} tokens, "
                                         f"{want} expected")
                elif round(s["prepass_selected_tokens"]) != s.get("selected_tokens"):
                    s["failures"].append(f"the loss applied {s.get('selected_tokens')} tokens, the pre-pass "
                                         f"selected {s['prepass_selected_tokens']:.0f}")
        per[v.name]["sanity"] = s
        per[v.name]["status"] = "failed" if s["failures"] else "ok"
        runnable.append(v)
        failures += [f"{v.name}: {f}" for f in s["failures"]]
        log(f"sanity {v.name}: {len(s['failures'])} failure(s), selected {s.get('selected_fraction', 0):.4f}, "
            f"{s['micro_batches']} micro-batches, step {o.seconds:.2f}s")
    rec["ran"] = [v.name for v in runnable]
    rec["not_run"] = {v.name: per[v.name]["reason"] for v in variants if per[v.name]["status"] in ("error", "skipped")}
    if not runnable:
        failures.append("no variant ran")
        return failures
    base_name = runnable[0].name
    rec["baseline"] = base_name
    # 2. warm-up and timed rounds over the variants that ran, interleaved so drift hits every variant alike. A
    # round is started only if the phase budget holds it (estimated from the sanity steps before any timed
    # round, then from the last round); warm-up gives way first, and one timed round always runs.
    est = sum(per[v.name]["sanity"]["seconds"] for v in runnable)
    warm = done = 0
    warm_target = args.warmup
    while done < args.steps:
        warming = warm < warm_target
        need = est * (2.2 if warming else 1.1)  # a warm-up round leaves room for a timed one
        if clock.left() < need and (warming or done >= 1):
            if warming:
                log(f"phase budget tight: skipping warm-up after {warm} round(s)")
                warm_target = warm
                continue
            log(f"phase budget nearly spent: stopping after {done} timed round(s)")
            break
        round_s = 0.0
        for v in runnable:
            o, peak, resting = step(v)
            round_s += o.seconds
            if warming:
                continue
            p = per[v.name]
            p["step_s"].append(round(o.seconds, 4))
            if v.driver:
                p.setdefault("driver_select_s", []).append(round(o.driver_s, 4))
            if peak is not None:
                p["peak_mem_bytes"] = max(p["peak_mem_bytes"] or 0, peak)
                p["resting_mem_bytes"] = resting
        est = round_s
        if warming:
            warm += 1
        else:
            done += 1
        rec["rounds_done"], rec["warmup_rounds"] = done, warm
    base = per[base_name]
    for v in runnable:
        p = per[v.name]
        p["step_s_median"] = statistics.median(p["step_s"])
        if len(p["step_s"]) >= 2:  # how noisy the median is: ratios closer to 1 than this are noise
            q1, _, q3 = statistics.quantiles(p["step_s"], n=4, method="inclusive")
            p["step_iqr_over_median"] = (q3 - q1) / p["step_s_median"]
        p["step_ratio_vs_" + base_name] = p["step_s_median"] / statistics.median(base["step_s"])
        p["tokens_per_s"] = tokens / p["step_s_median"]
        if p["peak_mem_bytes"] is not None:
            p["peak_mem_gib"] = p["peak_mem_bytes"] / 2**30
            p["mem_ratio_vs_" + base_name] = p["peak_mem_bytes"] / base["peak_mem_bytes"]
    return failures


def _common_worker_kwargs(args, workload: Workload, attn: str) -> dict:
    return dict(use_dynamic_bsz=True, use_remove_padding=not args.no_remove_padding, seed=args.seed,
                ppo_mini_batch_size=workload.n // workload.group_size, rollout_n=workload.group_size,
                ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=workload.max_token_len,
                lr=0.0, clip_grad=1.0, dtype=args.dtype, attn_implementation=attn,
                gradient_checkpointing=args.grad_ckpt == "on",
                num_threads=1 if args.device == "cpu" else None)


def fsdp_phase(H, model_dir, args, workload, attn, clock: Clock, rec: dict, reserve_s: float = 0.0) -> list[str]:
    """``reserve_s``: seconds kept for what runs after this phase (the Megatron phase's budget): the steps' budget
    is cut to what the deadline leaves after it."""
    kw = _common_worker_kwargs(args, workload, attn)
    actor = clock.run_phase("fsdp_init", args.budget_init, H.make_training_worker, model_dir, **kw)
    rec.update(status="running", engine="fsdp2", init_s=round(actor.init_seconds, 2),
               settings={k: v for k, v in kw.items() if k != "num_threads"})
    budget = min(args.budget_steps, max(clock.total_left() - reserve_s, 0.0))
    if budget < args.budget_steps:
        log(f"fsdp steps: budget cut to {budget:.0f}s ({reserve_s:.0f}s kept for the phases after it)")
    rec["steps_budget_s"] = round(budget, 1)
    failures = clock.run_phase("fsdp_steps", budget, run_engine_steps, H, actor, args, workload, clock,
                               rec, args.variants)
    rec["status"] = "failed" if failures else "ok"
    rec["failures"] = failures
    del actor
    if args.device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return failures


# ------------------------------------------------------------------------------------------------
# Megatron: the harness's Megatron worker (the CPU test bed on --device cpu, verl's engine on a GPU)
# ------------------------------------------------------------------------------------------------
def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def _import_error(module: str) -> str | None:
    """None when ``module`` imports, else why not. An installed package can still fail to import:
    megatron-bridge imports TransformerEngine's torch extension when it is imported."""
    if not _findable(module):
        return f"{module} is not installed"
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a compiled extension that does not load
        return f"{type(e).__name__}: {e}"[:600]
    return None


def megatron_skip_reason(args) -> str | None:
    if args.no_megatron:
        return "--no-megatron"
    if args.device == "cpu":  # the CPU test bed: megatron-core + mbridge with the runtime shims
        from verl_tokensel_cpu.megatron import megatron_available

        return megatron_available()
    if not _findable("megatron.core"):
        return ("megatron.core is not importable (pip package megatron-core; the GPU image does not ship it: "
                "carry it, scripts/pack_megatron_wheels.sh)")
    if not (_findable("mbridge") or _findable("megatron.bridge")):
        return "neither mbridge nor megatron.bridge is importable (carry mbridge, scripts/pack_megatron_wheels.sh)"
    return None


_PATCHED: set = set()


def install_local_layer_spec() -> None:
    """mbridge's layer spec with ``use_transformer_engine=False`` and its weight names for the local spec's
    separate norms (shim 5 of ``verl_tokensel_cpu.megatron``, device-independent): the Megatron model
    without TransformerEngine. Idempotent."""
    if "layer_spec" not in _PATCHED:
        from verl_tokensel_cpu.megatron import install_local_layer_spec

        install_local_layer_spec()
        _PATCHED.add("layer_spec")


def packed_sdpa(query, key, value, starts: list[int], lengths: list[int], scale: float | None = None):
    """Causal attention of each packed sequence with itself: ``query`` ``[tokens, heads, dim]``, ``key`` /
    ``value`` ``[tokens, kv_heads, dim]`` (grouped-query: KV head ``g`` serves query heads ``g r .. g r + r - 1``,
    Megatron's ``repeat_interleave`` convention), sequence ``i`` at rows ``starts[i] .. starts[i] + lengths[i]``;
    rows between sequences (padding) come out zero. Returns ``[tokens, heads, dim]``."""
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    for start, n in zip(starts, lengths):
        q, k, v = (x[start : start + n].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out[start : start + n] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


def install_sdpa_attention() -> None:
    """Megatron's local ``DotProductAttention`` with packed sequences (verl's ``thd`` batches, which it
    rejects): :func:`packed_sdpa` (flash or memory-efficient kernels on a GPU: O(tokens) memory, where the
    CPU test bed's dense mask is O(tokens^2)). Other calls go to the forward it replaces. Idempotent."""
    if "sdpa" in _PATCHED:
        return
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base_forward = DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is None or attention_bias is not None or kwargs:
            return base_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if query.dim() == 4:  # [t, 1, heads, dim]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        starts = packed_seq_params.cu_seqlens_q_padded
        if starts is None:
            starts = packed_seq_params.cu_seqlens_q
        out = packed_sdpa(query, key, value, starts[:-1].tolist(), packed_seq_params.cu_seqlens_q.diff().tolist(),
                          scale=self.softmax_scale)
        return out.reshape(out.shape[0], 1, -1)  # [t, b=1, heads * dim], as the local attention returns

    forward.__wrapped__ = base_forward
    DotProductAttention.forward = forward
    _PATCHED.add("sdpa")


def megatron_plan(args) -> tuple[list[str], dict, list, list]:
    """(Hydra overrides after the harness's, the stack record, installs before / after the worker is built).

    CPU: the harness's test bed as it is (``--megatron-attention sdpa``: the GPU fallback's attention on
    it). GPU: verl's engine defaults from the harness (``megatron_gpu_overrides``), then TransformerEngine
    layers when its torch extension imports, else megatron-core's local layers with SDPA attention and
    no fused kernels (they need TransformerEngine or apex).
    """
    g = "actor_rollout_ref.actor.megatron"
    t = f"{g}.override_transformer_config"
    overrides: list[str] = []
    if args.megatron_recompute == "full":
        overrides += [f"{t}.recompute_granularity=full", f"{t}.recompute_method=uniform", f"{t}.recompute_num_layers=1"]
    elif args.megatron_recompute == "selective":  # verl's recompute_modules default: core_attn
        overrides.append(f"{t}.recompute_granularity=selective")
    stack = {"megatron_core": _version("megatron-core"), "tensor_parallel": 1, "pipeline_parallel": 1,
             "recompute": args.megatron_recompute}
    if args.device == "cpu":
        sdpa = args.megatron_attention == "sdpa"
        stack.update(platform="cpu test bed (verl_tokensel_cpu.megatron shims, gloo)",
                     bridge=f"mbridge {_version('mbridge')} (vanilla_mbridge=True)", transformer_engine=None,
                     layers="local", attention=("torch sdpa per packed sequence" if sdpa
                                                else "local DotProductAttention, dense per-sequence causal mask"))
        return overrides, stack, [], ([install_sdpa_attention] if sdpa else [])
    stack["platform"] = "cuda"
    te_error = _import_error("transformer_engine.pytorch")
    stack["transformer_engine"] = (_version("transformer-engine-torch") or _version("transformer-engine")
                                   if te_error is None else None)
    bridge_error = _import_error("megatron.bridge")
    if te_error is None and args.megatron_attention == "auto":
        backend = "flash" if _findable("flash_attn") else "auto"  # TE's flash backend needs flash-attn
        overrides.append(f"{t}.attention_backend={backend}")
        if bridge_error is None:
            overrides.append(f"{g}.vanilla_mbridge=False")
            stack["bridge"] = f"megatron-bridge {_version('megatron-bridge')}"
        else:  # installed or not, megatron-bridge must not be chosen when it does not import
            overrides.append(f"{g}.vanilla_mbridge=True")
            stack.update(bridge=f"mbridge {_version('mbridge')} (vanilla_mbridge=True)", megatron_bridge=bridge_error)
        stack.update(layers="transformer_engine", attention=f"TransformerEngine, attention_backend={backend}")
        return overrides, stack, [], []
    overrides += [f"{g}.vanilla_mbridge=True", f"{t}.attention_backend=local",
                  f"++{t}.gradient_accumulation_fusion=False", f"++{t}.masked_softmax_fusion=False",
                  f"++{t}.apply_rope_fusion=False"]
    stack.update(bridge=f"mbridge {_version('mbridge')} (vanilla_mbridge=True)", layers="local",
                 attention="torch sdpa per packed sequence", megatron_bridge=bridge_error,
                 fallback=("--megatron-attention sdpa" if te_error is None else
                           f"TransformerEngine's torch extension does not import ({te_error}): megatron-core's "
                           "local layers, no fused kernels; not the production stack"))
    return overrides, stack, [install_local_layer_spec], [install_sdpa_attention]


def describe_megatron_model(actor) -> dict:
    """What was built: the classes of the first layer's QKV projection and core attention, the engine dtype,
    the bridge and attention backend the config asked for."""
    out = {}
    for name, sub in actor.module[0].named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("linear_qkv", "core_attention") and f"{leaf}_class" not in out:
            out[f"{leaf}_class"] = type(sub).__name__
    mcfg = actor.cfg.actor_rollout_ref.actor.megatron
    out.update(engine_dtype=str(getattr(actor.actor_config.engine, "dtype", None)),
               vanilla_mbridge=bool(mcfg.get("vanilla_mbridge", False)),
               attention_backend=str(mcfg.override_transformer_config.get("attention_backend")))
    return out


def megatron_phase(H, model_dir, args, workload, attn, clock: Clock, rec: dict) -> list[str]:
    kw = _common_worker_kwargs(args, workload, attn)
    kw["gradient_checkpointing"] = False  # not read by the Megatron engine: --megatron-recompute
    names = args.megatron_variants
    try:
        overrides, stack, before, after = megatron_plan(args)
        rec.update(status="starting", engine="megatron", stack=stack, overrides=overrides)
        for install in before:
            install()
        actor = H.make_training_worker(model_dir, engine="megatron", tensor_parallel=1, pipeline_parallel=1,
                                       overrides=overrides, **kw)
        for install in after:
            install()
        stack.update(describe_megatron_model(actor))
    except Exception as e:  # report, do not hide (the GPU stacks have not run yet)
        rec.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        return [f"megatron: worker did not start: {type(e).__name__}: {e}"]
    rec.update(status="running", init_s=round(actor.init_seconds, 2),
               settings={k: v for k, v in kw.items() if k not in ("num_threads", "gradient_checkpointing")})
    log(f"megatron stack: {stack}")
    try:
        failures = run_engine_steps(H, actor, args, workload, clock, rec, names, align=1)
    except Exception as e:
        rec.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        return [f"megatron: {type(e).__name__}: {e}"]
    rec["status"] = "failed" if failures else "ok"
    rec["failures"] = failures
    return [f"megatron: {f}" for f in failures]


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def print_table(title: str, rec: dict, base: str) -> None:
    stack = rec.get("stack")
    stack_line = ("stack: " + "; ".join(f"{k} {v}" for k, v in stack.items() if v not in (None, ""))) if stack else None
    if rec.get("status") in ("skipped", "error") or not rec.get("rounds_done"):
        print(f"\n{title}: {rec.get('status')}: {rec.get('reason') or rec.get('error') or rec.get('failures')}")
        if stack_line:
            print(stack_line)
        return
    base = rec.get("baseline", base)
    print(f"\n{title}: {rec['responses']} responses of {rec['response_len_min']}..{rec['response_len_max']} tokens, "
          f"{rec['tokens_per_step']} tokens per step, micro-batches of <= {rec['max_token_len_per_micro_batch']} "
          f"tokens; median of {rec['rounds_done']} interleaved timed rounds after {rec['warmup_rounds']} warm-up")
    w = max(14, *(len(n) + 2 for n in rec["variants"]))
    print(f"{'variant':<{w}}{'step s':>9}{'ratio':>8}{'spread':>8}{'peak GiB':>10}{'ratio':>8}{'selected':>10}"
          f"{'mb':>4}{'unsel.grad':>11}{'sanity':>8}")
    for name, p in rec["variants"].items():
        if "step_s_median" not in p:  # not run: the reason, in the table where its row would be
            reason = (p.get("reason") or "not reached").splitlines()[0]
            print(f"{name:<{w}}{p.get('status', 'pending').upper()}: {reason[:300]}")
            continue
        s = p["sanity"]
        mem = (f"{p['peak_mem_gib']:>10.2f}{p['mem_ratio_vs_' + base]:>7.3f}x" if p.get("peak_mem_gib")
               else f"{'-':>10}{'-':>8}")
        spread = f"{p['step_iqr_over_median']:>8.3f}" if "step_iqr_over_median" in p else f"{'-':>8}"
        unsel = "-" if s.get("grad_checked", 0) == 0 else s.get("unselected_with_grad", 0)
        print(f"{name:<{w}}{p['step_s_median']:>9.3f}{p['step_ratio_vs_' + base]:>7.3f}x{spread}{mem}"
              f"{s.get('selected_fraction', float('nan')):>10.4f}{s['micro_batches']:>4}"
              f"{unsel:>11}{'ok' if not s['failures'] else 'FAIL':>8}")
    ran, not_run = rec.get("ran", []), rec.get("not_run", {})
    print(f"{len(ran)} of {len(rec['variants'])} variants ran"
          + (f"; not run: {', '.join(not_run)} (reasons in the rows above and under FAILURE)" if not_run else ""))
    if stack_line:
        print(stack_line)


def compare_engines(fsdp: dict, mega: dict) -> dict | None:
    """Both phases trained the same weights on the same batch: the old-log-prob means and, per variant with the
    same selection in both, the sanity step's loss and gradient norm side by side (fp32 on CPU: equal to
    ~1e-6; bf16 on a GPU: close, not equal). Informational; not a pass/fail check."""
    if not (fsdp.get("variants") and mega.get("variants")):
        return None
    out = {"old_log_prob_mean": [fsdp.get("old_log_prob_mean"), mega.get("old_log_prob_mean")],
           "old_entropy_mean": [fsdp.get("old_entropy_mean"), mega.get("old_entropy_mean")], "variants": {}}
    for name, m in mega["variants"].items():
        f = fsdp["variants"].get(name)
        if f is None or f.get("selection") != m.get("selection") or "sanity" not in f or "sanity" not in m:
            continue
        out["variants"][name] = {k: [f["sanity"].get(k), m["sanity"].get(k)] for k in ("loss", "grad_norm")}
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  python benchmarks/gpu_check.py --out $OUT/gpu_check.json\n"
                                        "  python benchmarks/gpu_check.py --tiny --device cpu --out /tmp/g.json\n"
                                        "  python benchmarks/gpu_check.py --variants none forking --steps 3\n"
                                        "  python benchmarks/gpu_check.py --no-fsdp --variants none forking gmts "
                                        "--steps 3 --budget-megatron 330 --deadline 420")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen3 and short responses (the CPU self-test)")
    ap.add_argument("--out",
                    default=os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None,
                    help="JSON results path (default $OUT/gpu_check.json if $OUT is set)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="presets to compare, the first is the baseline; 'P+entropy' turns the entropy pass on "
                         "(default: every preset of verl_tokensel.core.resolve.presets.PRESETS, none first, plus "
                         f"{' and '.join(EXTRA_VARIANTS)})")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"untimed rounds after the sanity step (default 1; 0 with more than {MANY_VARIANTS} variants)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"timed rounds (default 5; 1 with more than {MANY_VARIANTS} variants; fewer if the budget "
                         "runs out)")
    ap.add_argument("--workload", choices=("auto", "compare", "sweep"), default="auto",
                    help="GPU batch: compare (16 responses of 3584..4096 tokens, ~66k per step), sweep (8 of "
                         f"2048..2560, ~21k); auto: compare up to {MANY_VARIANTS} variants, else sweep "
                         "(--tiny: its own)")
    ap.add_argument("--attn", default="auto", help="attention: auto (flash_attention_2 if importable, else sdpa; "
                                                   "eager on CPU), or a transformers name")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="FSDP compute dtype (auto: bf16 on cuda, fp32 on cpu; master weights fp32 either way)")
    ap.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto",
                    help="gradient checkpointing (auto: on for cuda, as verl's default; off on cpu)")
    ap.add_argument("--no-remove-padding", action="store_true")
    ap.add_argument("--no-megatron", action="store_true", help="skip the Megatron phase")
    ap.add_argument("--no-fsdp", action="store_true", help="skip the FSDP2 phase")
    ap.add_argument("--megatron-variants", nargs="+", default=None,
                    help="variants of the Megatron phase (default: --variants if given, else "
                         f"{' '.join(DEFAULT_MEGATRON_VARIANTS)}); gmts runs its real pre-pass there")
    ap.add_argument("--megatron-attention", choices=("auto", "sdpa"), default="auto",
                    help="Megatron layers: auto (GPU: TransformerEngine if its torch extension imports, else "
                         "local layers + sdpa; CPU: the test bed's local attention); sdpa: local layers with "
                         "torch sdpa per packed sequence (the GPU fallback, also on the CPU test bed)")
    ap.add_argument("--megatron-recompute", choices=("none", "selective", "full"), default="none",
                    help="Megatron activation recompute (default none, verl's default; selective: core_attn; "
                         "full: every layer, uniform, 1 layer per chunk)")
    ap.add_argument("--workdir", default=None, help="where the model folder goes (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=None,
                    help="overall seconds (default 480; with --tiny 240, 360 for more than "
                         f"{MANY_VARIANTS} variants)")
    ap.add_argument("--budget-model", type=float, default=None, help="phase budget, s (default 60; 30 tiny)")
    ap.add_argument("--budget-init", type=float, default=None, help="phase budget, s (default 90; 60 tiny)")
    ap.add_argument("--budget-steps", type=float, default=None,
                    help=f"phase budget, s (default 150, 360 for more than {MANY_VARIANTS} variants; tiny 60, 180); "
                         "cut to what the deadline leaves after the Megatron phase's budget when that phase runs")
    ap.add_argument("--budget-megatron", type=float, default=None, help="phase budget, s (default 150; 60 tiny)")
    args = ap.parse_args(argv)
    if args.megatron_variants is None:
        args.megatron_variants = list(args.variants or DEFAULT_MEGATRON_VARIANTS)
    if args.variants is None:
        args.variants = default_variants()
    many = len(args.variants) > MANY_VARIANTS
    # tiny: every preset in ~20 s on an idle 2-core CPU; the budgets leave room for a busy one.
    # full size on one H200 (measured: 17 s per step of the compare workload, 66k tokens; the sweep's ~21k tokens
    # per step, scaled from it, ~5.5 s): the sweep of every preset, a sanity and a timed step each, ~5.5 min
    defaults = dict(deadline=((360 if many else 240), 480), budget_model=(30, 60), budget_init=(60, 90),
                    budget_steps=((180 if many else 60), (360 if many else 150)), budget_megatron=(60, 150),
                    steps=((1, 1) if many else (5, 5)), warmup=((0, 0) if many else (1, 1)))
    for k, (tiny, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    if args.workload == "auto":
        args.workload = "sweep" if many else "compare"
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.grad_ckpt == "auto":
        args.grad_ckpt = "on" if args.device == "cuda" else "off"
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu runs the 0.6B model for hours: add --tiny")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # the harness decides verl's platform at import: set it first
    os.environ["VERL_TOKENSEL_HARNESS_DEVICE"] = args.device
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = {"schema": 1, "status": "running", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "argv": sys.argv[1:] if argv is None else list(argv), "phases": {}, "failures": []}
    clock = Clock(args.deadline, results, args.out)
    try:
        try:
            results["env"] = clock.run_phase("env", 60, check_env, args)
        except EnvironmentError as e:
            results.update(status="env_error")
            results["failures"].append(str(e))
            print(f"gpu_check: ERROR: {e}", file=sys.stderr)
            return EXIT_ENV
        import tempfile

        H = clock.run_phase("imports", 120, importlib.import_module, "verl_tokensel_cpu.worker")  # verl, ray
        attn = pick_attention(args)
        workload = TINY_WORKLOAD if args.tiny else (SWEEP_WORKLOAD if args.workload == "sweep" else GPU_WORKLOAD)
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
        model_dir, model_info = clock.run_phase("model", args.budget_model, build_model_dir,
                                                workdir / ("tiny_qwen3" if args.tiny else "qwen3_0p6b_shape"),
                                                args.tiny, args.device, args.seed)
        results["config"] = {"tiny": args.tiny, "device": args.device, "attn_implementation": attn,
                             "dtype": args.dtype, "gradient_checkpointing": args.grad_ckpt == "on",
                             "model": model_info, "workload": dataclasses.asdict(workload),
                             "variants": args.variants, "warmup": args.warmup, "steps": args.steps,
                             "workload_name": "tiny" if args.tiny else args.workload, "deadline_s": args.deadline}
        from verl_tokensel.core.config import PRESETS

        # every preset is run unless --variants narrows the list: what this run leaves out, by name
        ran_presets = {variant_preset(v) for v in args.variants}
        results["config"]["presets_not_in_variants"] = [p for p in PRESETS if p not in ran_presets]
        results["config"]["megatron"] = {"variants": args.megatron_variants,
                                         "attention": args.megatron_attention, "recompute": args.megatron_recompute}
        reason = megatron_skip_reason(args)
        if args.no_fsdp:
            results["fsdp"] = {"status": "skipped", "reason": "--no-fsdp"}
        else:
            results["fsdp"] = {}
            results["failures"] += fsdp_phase(H, model_dir, args, workload, attn, clock, results["fsdp"],
                                              reserve_s=0.0 if reason else args.budget_megatron)
        if reason:
            results["megatron"] = {"status": "skipped", "reason": reason}
            log(f"megatron skipped: {reason}")
        else:
            results["megatron"] = {}
            results["failures"] += clock.run_phase("megatron", args.budget_megatron, megatron_phase, H, model_dir,
                                                   args, workload, attn, clock, results["megatron"])
        results["fsdp_vs_megatron"] = compare_engines(results["fsdp"], results["megatron"])
    except Exception as e:
        results["failures"].append(f"{type(e).__name__}: {e}")
        results["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    finally:
        clock.cancel()
    results["status"] = "failed" if results["failures"] else "ok"
    results["seconds"] = round(clock.elapsed(), 1)
    write_json(results, args.out)
    base = args.variants[0]
    if "variants" in results.get("fsdp", {}) or results.get("fsdp", {}).get("status") == "skipped":
        print_table("FSDP2", results["fsdp"], base)
    print_table("Megatron", results.get("megatron", {"status": "not reached"}), base)
    cmp = results.get("fsdp_vs_megatron")
    if cmp:
        diffs = [abs(v["loss"][0] - v["loss"][1]) for v in cmp["variants"].values() if None not in v["loss"]]
        olp = cmp["old_log_prob_mean"]
        print(f"FSDP2 vs Megatron, same weights and batch: old log-prob mean {olp[0]:.6f} vs {olp[1]:.6f}"
              + (f"; sanity-step loss, {len(cmp['variants'])} variants with the same selection: max |diff| "
                 f"{max(diffs):.2e}" if diffs else ""))
    print("\nstep ratio / peak-memory ratio: vs the first variant; spread: IQR / median of the step times; "
          "selected: fraction of valid response tokens selected "
          "(sanity step); mb: micro-batches; unsel.grad: unselected tokens whose logits got gradient (must be 0; "
          "- where not checked)")
    left_out = results.get("config", {}).get("presets_not_in_variants")
    if left_out:
        print(f"presets not in --variants (not run): {' '.join(left_out)}")
    for f in results["failures"]:
        print(f"FAILURE: {f}")
    print(f"gpu_check: {results['status']} in {results['seconds']}s"
          + (f"; results in {args.out}" if args.out else " (no --out given)"))
    return EXIT_OK if not results["failures"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
