"""Peak memory and step time of token selection vs stock verl at a real vocabulary (CPU), printed as ratios.

Run (from the repository root; on a 2-core machine about 15 minutes per shape at hidden 128, 35 at 1024)::

    python benchmarks/bench_memory.py --grid                          # every shape below, hidden 128 and 1024
    python benchmarks/bench_memory.py --hidden 128 --shapes 4608x1,2304x2
    python benchmarks/bench_memory.py                                 # 2304x2 at hidden 128 and 1024

What runs: one real verl actor update per step (``TrainingWorker.train_mini_batch``, FSDP2 engine,
``use_remove_padding``) of a random Qwen2 with a vocabulary of 151,936 (Qwen3's), 2 layers, tied embeddings
and ``--hidden`` units. A shape ``TxM`` is T tokens per micro-batch (T / 1152 responses of 128 prompt + 1024
response tokens, in GRPO groups of 2) and M PPO mini-batches per step, each one micro-batch; the grid is
T in 2304, 4608, 9216 and M in 1, 2. Old log-probs come from the real log-prob pass (on-policy). With M = 2,
``gmts``'s pre-pass shows both cases: on the first mini-batch the weights are those the old-log-prob pass
measured and the pre-pass reuses its values (``token_selection.prepass_reuse``); on the second the weights
have changed (one optimizer step) and it runs its no-grad forward; with M = 1 it always reuses. The table
reports the share of mini-batches that reused the old pass.

Memory: each variant runs in a FRESH process (``--mem-reps`` of them: the max is reported, and the spread
between them in the summary): a warm-up step, then ``--mem-steps`` measured steps (``--parallel N``: N of these
processes at a time, for wall time on a loaded host; each peak is its own process's RSS). The memory processes run
with glibc's mmap threshold fixed at 128 KiB (``--allocator fixed``, ``MALLOC_MMAP_THRESHOLD_=131072``): glibc's
default raises the threshold each time a mapped block is freed (up to 32 MiB), after which tensors below it
come from the heap, so a process's RSS depends on the order of its earlier frees, and two identical processes
differ (1.08x at h128/2304x1 with ``--allocator default --mem-reps 2``,
``benchmarks/results/bench_memory_cpu_allocator_2026-12-03.txt``). Fixed, every tensor of 128 KiB or
more is its own mapping, returned when freed, so the RSS follows the live tensors. The timing process keeps
the default allocator. Two peaks:
``update peak``: right before each update freed heap is returned to the system (``malloc_trim``) and the
RSS high-water mark is reset (``/proc/self/clear_refs``, after the old-log-prob pass, which verl runs as a
separate call), so it is the ``VmHWM`` of the update itself (max over the measured steps); ``process peak``:
the ``VmHWM`` of the whole process, never reset (the mark reached before each reset is kept), so it also
counts the model build, the old-log-prob passes and whatever a phase leaves allocated for the next one.
Time: one more process runs every variant on one worker, interleaved, ``--steps`` rounds after a warm-up
round (median per variant), so machine noise hits all variants alike; beside the wall time, the step's CPU time
(``time.process_time``: every thread of the process), which time the process spends waiting does not count
(``--no-memory`` runs the timing alone; ``--report`` joins it to a memory run). It also times the log-prob kernel
(forward, plus its backward from the arrival of its output's gradient to the completion of its logits'
gradient) and names it.

Baselines. Stock verl on CPU (no flash-attn, no NPU) computes the update's log-prob with
``verl.utils.torch_functional.logprobs_from_logits_v2`` (one ``logsumexp`` per row, a tokens x vocab gradient
buffer in the backward). A selecting loss whose update computes the entropy (``forking``, score source
``current``) runs ``no_graph.logprobs_from_lse`` instead (the row ``logsumexp`` of its chunked no-graph entropy
pass, backward in place), and under a selecting loss every pass's entropy is the chunked no-graph one (the
old-log-prob pass's included). The other selectors' updates (``gmts``, ``grad_norm``, ``forking_paper``) run
verl's kernel, as the ``log-prob kernel`` column shows. Two baselines run verl's stock loss (``ppo_loss``) with
the selectors' engine functions: ``none(no-graph entropy)`` (the no-graph entropy in every pass, verl's
log-prob in the update: what ``gmts``, ``grad_norm`` and ``forking_paper`` run) and ``none(same kernel)``
(also, in the update, ``logprobs_from_lse`` after the same chunked pass ``forking`` runs). Each selector's
ratios are printed against stock ``none`` and against its matched baseline (the one whose update ran the
same kernel), side by side: the second isolates the selection's own cost. ``--kernel ROWS`` times the two
kernels alone.

Variants (as a recipe would run them):

- ``none``: stock verl (``calculate_entropy=false`` in the update, verl's default);
- ``none(no-graph entropy)``, ``none(same kernel)``: the matched baselines above;
- ``none+entropy`` (reference, opt-in): stock verl with ``calculate_entropy=true`` (verl's entropy with its graph);
- ``forking``, ``grad_norm`` (``score_source=current``; forking turns on ``calculate_entropy``),
  ``gmts`` (``score_source=prepass``: the step includes its no-grad pre-pass), ``forking_paper``
  (``score_source=rollout``: the mask comes from the driver, whose selection time is added);
- ``forking(graph)`` (reference, opt-in): ``forking`` with ``token_selection.no_grad_scores=false``;
- the toolbox presets ``ce_gppo``, ``aspo``, ``fipo`` (``score_source=current``), ``ktae``, ``gtpo`` (the driver's,
  its time added), ``m2po_global`` (its pre-pass, no forward; the batch carries rollout log-probs, the old pass's
  moved by ``ROLLOUT_SHIFT``) (opt-in, ``--variants``), with the selectors' targets and matched baselines::

    python benchmarks/bench_memory.py --hidden 128 --shapes 2304x1 \
        --variants "none,none(no-graph entropy),none(same kernel),ce_gppo,aspo,fipo,ktae,gtpo"

- ``delta`` (opt-in, ``--variants``): a rule over the model's last hidden states: before its update, K + 3
  (``delta_k`` 1: 4) no-grad forwards over the step's batch; a variant spec ``NAME:KNOB=VALUE[:KNOB=VALUE]`` runs
  a selector with ``token_selection`` knobs, so ``delta:delta_cache_gib=4`` is ``delta`` keeping the valid response
  tokens' hidden states after its first pass (one forward instead of K + 3). Its matched baseline is
  ``none(no-graph entropy)`` (its update runs verl's kernel); below the table, its forwards, the seconds of its
  passes and the bytes of the hidden states a cache holds (tokens x H x the element size)::

    python benchmarks/bench_memory.py --hidden 128 1024 --shapes 2304x1 \
        --variants "none,none(no-graph entropy),ce_gppo,delta,delta:delta_cache_gib=4"

Targets: every selector <= 1.05x in peak memory (update and process); step time <= 1.10x at hidden 128 and
<= 1.03x at hidden 1024, ``gmts`` <= 1.25x; ``delta`` <= 1.10x in peak memory, its step time reported (its
forwards are the method's own cost: no target). After the tables, one ``summary:`` line per target and baseline:
the worst selector over all shapes run, and whether the target is met.
Absolute numbers are printed for the record only: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 151_936
#: the toolbox's presets of one rule each (opt-in: --variants), measured like the selectors
TOOLBOX = ["ce_gppo", "aspo", "fipo", "ktae", "gtpo", "m2po_global"]
#: the rollout engine's log-probs of a score that reads them (m2po_global): the old pass's, moved by this much
ROLLOUT_SHIFT = 0.3
#: the presets whose rule reads the model's last hidden states (opt-in, --variants): K + 3 no-grad forwards over the
#: step's batch before its update (``delta_k`` 1: 4), or one with ``delta_cache_gib`` > 0 (the hidden states kept)
HIDDEN = ["delta"]
SELECTORS = ["forking", "gmts", "grad_norm", "forking_paper", *TOOLBOX, *HIDDEN]
BASELINES = ["none", "none(no-graph entropy)", "none(same kernel)"]
REFERENCES = ["none+entropy", "forking(graph)"]
VARIANTS = ["none", "none(no-graph entropy)", "none(same kernel)", "none+entropy", "forking", "forking(graph)", "gmts",
            "grad_norm", "forking_paper", *TOOLBOX, *HIDDEN]
DEFAULT_VARIANTS = ["none", "none(no-graph entropy)", "none(same kernel)", "forking", "gmts", "grad_norm",
                    "forking_paper"]
_MODES = {"none(no-graph entropy)": "entropy", "none(same kernel)": "full"}  # see _install_kernel_probes
TARGET_MEM = 1.05
TARGET_TIME = {128: 1.10, 1024: 1.03}
TARGET_GMTS = 1.25
TARGET_MEM_HIDDEN = 1.10  # a rule over the hidden states (delta): its passes' transients, or its cache
PROMPT, RESPONSE = 128, 1024  # tokens per response: a micro-batch of T tokens holds T // 1152 responses
GRID_SHAPES = ["2304x1", "2304x2", "4608x1", "4608x2", "9216x1", "9216x2"]
GRID_HIDDEN = [128, 1024]


def split_variant(variant: str) -> tuple[str, dict]:
    """A variant spec ``NAME`` or ``NAME:KNOB=VALUE[:KNOB=VALUE...]`` (a selector with ``token_selection.*`` knobs,
    e.g. ``delta:delta_cache_gib=4``) as its name and knobs (values as YAML reads them: ``4`` an int)."""
    name, *specs = variant.split(":")
    knobs = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise SystemExit(f"--variants {variant!r}: expected NAME:KNOB=VALUE, e.g. delta:delta_cache_gib=4")
        import yaml

        knobs[key] = yaml.safe_load(value)
    return name, knobs


def base_variant(variant: str) -> str:
    """A variant's name without its knobs (``delta:delta_cache_gib=4`` -> ``delta``)."""
    return variant.split(":")[0]


def parse_shape(text: str) -> tuple[int, int]:
    """``TOKENSxMINIBATCHES`` (``4608x1``): tokens per micro-batch (a multiple of 2 x 1152: whole GRPO groups of
    two responses of 128 + 1024 tokens) and PPO mini-batches per step (one micro-batch each)."""
    try:
        tokens, mbs = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: expected TOKENSxMINIBATCHES such as 4608x1; valid tokens: multiples "
                         f"of {2 * (PROMPT + RESPONSE)}, mini-batches >= 1") from None
    if tokens <= 0 or tokens % (2 * (PROMPT + RESPONSE)) or mbs < 1:
        raise SystemExit(f"--shapes {text!r}: tokens must be a positive multiple of {2 * (PROMPT + RESPONSE)} "
                         f"(groups of 2 responses of {PROMPT} + {RESPONSE} tokens) and mini-batches >= 1; "
                         f"e.g. 2304x2, 4608x1, 9216x2")
    return tokens, mbs


def build_model_dir(root: Path, hidden: int) -> str:
    """The tiny tokenizer with a random Qwen2 of vocabulary 151,936 and ``hidden`` units (cached)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_tokensel_cpu import tiny_model

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


def _host_memory_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) / 2**20


def _hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


_PROCESS_PEAK = [0]  # the process's RSS high-water mark so far, kept across the resets below


def _reset_hwm() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``), then reset the RSS high-water mark, so the
    next peak counts what the update allocates, not what earlier phases left mapped. The mark reached so far
    is kept first (:data:`_PROCESS_PEAK`: the whole process's peak is the max of the marks between resets)."""
    import ctypes
    import gc

    _PROCESS_PEAK[0] = max(_PROCESS_PEAK[0], _hwm_kb())
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the mark is reset all the same
        pass
    Path("/proc/self/clear_refs").write_text("5")


def process_peak_kb() -> int:
    """VmHWM of the whole process (model build, old-log-prob passes, updates), resets included."""
    return max(_PROCESS_PEAK[0], _hwm_kb())


# --- the log-prob kernel: which one runs, and its time ---------------------------------------------------------

_KERNEL = {"seconds": 0.0, "calls": [], "same": ""}


def _timed_kernel(name: str, fn):
    """``fn`` (a log-prob kernel) timed: forward wall time, plus backward from the moment the gradient of its
    output arrives until the gradient of its logits is complete (tensor hooks; autograd runs one node at a time
    on CPU, so this is the kernel's backward)."""
    def wrapper(logits, labels, *args, **kwargs):
        import torch

        t0 = time.perf_counter()
        out = fn(logits, labels, *args, **kwargs)
        _KERNEL["seconds"] += time.perf_counter() - t0
        _KERNEL["calls"].append(name)
        if torch.is_grad_enabled() and out.requires_grad and logits.requires_grad:
            t = {}
            out.register_hook(lambda g: t.__setitem__("t", time.perf_counter()))

            def done(g):
                if "t" in t:
                    _KERNEL["seconds"] += time.perf_counter() - t.pop("t")
            logits.register_hook(done)
        return out
    return wrapper


def _install_kernel_probes(actor) -> None:
    """Time both log-prob kernels the update can run (module globals, looked up at call time):
    verl's CPU fallback ``logprobs_from_logits_v2`` (stock verl on CPU: no flash-attn, no NPU) and
    ``no_graph.logprobs_from_lse`` (a selecting loss whose update computes the entropy without a graph);
    and wrap the engine's ``prepare_model_outputs`` for the two matched baselines: ``none(same kernel)``
    (:func:`_same_kernel`) and ``none(no-graph entropy)`` (every entropy from the no-graph function, as under a
    selecting loss; the update's log-prob stays verl's, as in the updates of ``gmts``, ``grad_norm`` and
    ``forking_paper``)."""
    import verl.utils.torch_functional as verl_F

    from verl_tokensel.verl_glue import no_graph

    if not getattr(verl_F, "_bench_timed", False):
        verl_F.logprobs_from_logits_v2 = _timed_kernel("logprobs_from_logits_v2", verl_F.logprobs_from_logits_v2)
        no_graph.logprobs_from_lse = _timed_kernel("logprobs_from_lse", no_graph.logprobs_from_lse)
        verl_F._bench_timed = True
    engine = actor.engine
    if getattr(engine, "_bench_same_kernel", None) is None:
        base = engine.prepare_model_outputs

        def prepare_model_outputs(*args, **kwargs):
            if not _KERNEL["same"]:
                return base(*args, **kwargs)
            if _KERNEL["same"] == "entropy":  # the no-graph entropy only; the update's log-prob stays verl's
                from verl_tokensel.verl_glue import no_graph

                with no_graph._no_graph_functions(engine, log_prob=False):
                    return base(*args, **kwargs)
            with _same_kernel(engine):
                return base(*args, **kwargs)

        engine._bench_same_kernel = base
        engine.prepare_model_outputs = prepare_model_outputs


def _same_kernel(engine):
    """Stock loss, the selectors' engine functions: every entropy from ``no_graph.entropy_no_graph`` (old-log-prob
    pass included, as under a selecting loss) and, in the update, the log-prob from the row ``logsumexp`` of that
    same chunked pass (``logprobs_from_lse``, backward in place): exactly what ``forking``'s update runs, with
    verl's ``ppo_loss`` and no selection."""
    import contextlib

    import torch

    from verl.workers.engine.fsdp import transformer_impl
    from verl_tokensel.verl_glue import no_graph

    @contextlib.contextmanager
    def ctx():
        with no_graph._no_graph_functions(engine, log_prob=False):
            stock = transformer_impl.logprobs_from_logits

            def logprobs(logits, labels, inplace_backward=True):
                if torch.is_grad_enabled() and logits.dim() == 2 and labels.shape == logits.shape[:1]:
                    cache = no_graph._LseCache()
                    no_graph.entropy_no_graph(logits, cache=cache)
                    return no_graph.logprobs_from_lse(logits, labels, cache.lse, inplace=True)
                return stock(logits=logits, labels=labels, inplace_backward=inplace_backward)

            transformer_impl.logprobs_from_logits = logprobs
            try:
                yield
            finally:
                transformer_impl.logprobs_from_logits = stock
    return ctx()


class _Variant:
    """One variant on a worker: its loss, whether the update computes entropy, its selection config."""

    def __init__(self, actor, variant: str, tokens: int, mini_batches: int):
        from verl_tokensel_cpu import worker as H
        from verl_tokensel.verl_glue.loss import SelectingLoss

        preset, knobs = split_variant({"forking(graph)": "forking:no_grad_scores=false"}.get(variant, variant))
        stock = variant in ("none", "none+entropy") or variant in _MODES
        self.name = variant
        self.actor = actor
        self.per_mb = tokens // (PROMPT + RESPONSE)
        self.n = self.per_mb * mini_batches
        self.config = None if stock else H.selecting_actor_config(actor, preset, **knobs)
        self.loss_fn = H.default_loss_fn(actor.actor_config) if stock else SelectingLoss(self.config)
        needs = bool(self.config is not None and self.config.needs_entropy)
        self.entropy_in_update = variant == "none+entropy" or needs

    def step(self) -> dict:
        """One update (after its old-log-prob pass): seconds incl. the driver's selection, the update's peak KiB,
        the log-prob kernel's seconds and name, the share of mini-batches whose pre-pass reused the old pass."""
        from verl_tokensel_cpu import batches as B, worker as H

        from verl.utils import tensordict_utils as tu

        _KERNEL["same"] = _MODES.get(self.name, "")
        try:
            batch = B.make_update_batch(self.actor, n=self.n, seed=0, prompt_len=(PROMPT, PROMPT),
                                        resp_len=(RESPONSE, RESPONSE), group_size=2)
            # the variant's loss before its old-log-prob pass, as a trainer sets it at init: the pass's entropy
            # function follows the loss (no-graph under a selecting loss)
            self.actor.set_loss_fn(self.loss_fn)
            H.compute_old_log_probs(self.actor, batch)  # the real old-log-prob pass (keeps `entropy` for the driver)
            if self.config is not None and self.config.selection.needs_rollout_log_probs:
                _add_rollout_log_probs(batch)
            tu.assign_non_tensor(batch, calculate_entropy=self.entropy_in_update)
            extra = 0.0
            _reset_hwm()  # the update's own peak from here (the old-log-prob pass is another call in verl)
            _KERNEL["seconds"], _KERNEL["calls"] = 0.0, []
            cpu0 = time.process_time()  # every thread of this process: what the step costs, whatever else runs
            if self.config is not None and self.config.selection.score_source == "rollout":
                extra = _driver_select(self.config, batch, self.actor.tokenizer.eos_token_id)
            r = H.run_train_step(self.actor, batch, loss_fn=self.loss_fn, capture_params=False)
            cpu = time.process_time() - cpu0
        finally:
            _KERNEL["same"] = ""
        assert r.loss == r.loss, f"{self.name}: NaN loss"
        reused = r.metrics.get("tokensel/prepass/reused_old_pass")
        share = statistics.fmean(map(float, reused)) if isinstance(reused, list) and reused else float("nan")
        return {"seconds": r.seconds + extra, "cpu_seconds": cpu, "update_peak_kb": _hwm_kb(),
                "kernel_seconds": _KERNEL["seconds"], "kernel": ",".join(sorted(set(_KERNEL["calls"]))) or "-",
                "prepass_reused_share": share, **self._hidden_metrics(r.metrics)}

    def _hidden_metrics(self, metrics: dict) -> dict:
        """A rule over the hidden states: its forwards, the seconds of its passes, the valid response tokens they
        read, and the bytes of those tokens' hidden states (tokens x H x the element size of the output layer's
        input: what ``delta_cache_gib`` keeps); NaN for the other variants."""
        rule = base_variant(self.name)
        if rule not in HIDDEN:
            return {k: float("nan") for k in HIDDEN_FIELDS}

        def last(key):
            v = metrics.get(f"tokensel/{rule}/{key}", float("nan"))
            return float(v[-1] if isinstance(v, list) else v)

        tokens = last("tokens")
        return {"hidden_forwards": last("forwards"), "hidden_sweep_seconds": last("sweep_seconds"),
                "hidden_tokens": tokens, "hidden_bytes": tokens * _OUTPUT_INPUT["bytes_per_token"]}


HIDDEN_FIELDS = ("hidden_forwards", "hidden_sweep_seconds", "hidden_tokens", "hidden_bytes")
_OUTPUT_INPUT = {"bytes_per_token": float("nan")}  # H x element size of the output layer's input (last forward)


def _add_rollout_log_probs(batch) -> None:
    """The rollout engine's log-probs as a recipe with ``rollout.calculate_log_probs`` sends them: the old pass's
    moved by a keyed uniform(-ROLLOUT_SHIFT / 2, ROLLOUT_SHIFT / 2) (what M2PO's second moment measures)."""
    import torch

    olp = batch["old_log_probs"]
    gen = torch.Generator().manual_seed(0)
    rows = [x + ROLLOUT_SHIFT * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp.unbind(0)]
    batch["rollout_log_probs"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _actor(model_dir: str, tokens: int, mini_batches: int):
    from verl_tokensel_cpu import worker as H  # selects verl's CPU platform first

    per_mb = tokens // (PROMPT + RESPONSE)
    actor = H.make_training_worker(model_dir, use_remove_padding=True, ppo_mini_batch_size=per_mb,
                                   ppo_micro_batch_size_per_gpu=per_mb, ppo_max_token_len_per_gpu=4 * tokens,
                                   lr=0.0, clip_grad=1e9, num_threads=None)
    _install_kernel_probes(actor)
    from verl_tokensel.verl_glue.hidden import output_layer

    def probe(module, args):  # the last hidden state's width and dtype: what a token costs a hidden-state cache
        _OUTPUT_INPUT["bytes_per_token"] = float(args[0].shape[-1] * args[0].element_size())
    output_layer(actor.engine).register_forward_pre_hook(probe)
    return actor


ALLOCATORS = {"fixed": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "default": {}}  # env of the memory processes


def child_memory(variant: str, model_dir: str, tokens: int, mini_batches: int, mem_steps: int) -> dict:
    """Peak RSS of one variant in this fresh process: the update's (a warm-up step, then the max over
    ``mem_steps`` measured steps, each from a reset mark) and the whole process's (every phase, no reset)."""
    v = _Variant(_actor(model_dir, tokens, mini_batches), variant, tokens, mini_batches)
    v.step()  # warm-up: optimizer state, allocator pools
    steps = [v.step() for _ in range(mem_steps)]
    return {"variant": variant, "peak_kb": max(s["update_peak_kb"] for s in steps),
            "process_peak_kb": process_peak_kb(), **{k: steps[-1][k] for k in HIDDEN_FIELDS}}


def child_time(variants: list[str], model_dir: str, tokens: int, mini_batches: int, steps: int) -> dict:
    """Step time of every variant on ONE worker, interleaved (v1, v2, ..., v1, v2, ...): median per variant."""
    actor = _actor(model_dir, tokens, mini_batches)
    vs = [_Variant(actor, v, tokens, mini_batches) for v in variants]
    for v in vs:  # warm-up
        v.step()
    runs: dict = {v.name: [] for v in vs}
    for _ in range(steps):
        for v in vs:
            runs[v.name].append(v.step())
    return {k: {"seconds": statistics.median(r["seconds"] for r in rs),
                "cpu_seconds": statistics.median(r["cpu_seconds"] for r in rs),
                "kernel_seconds": statistics.median(r["kernel_seconds"] for r in rs),
                "kernel": rs[-1]["kernel"],
                "prepass_reused_share": statistics.fmean(r["prepass_reused_share"] for r in rs),
                **{f: statistics.median(r[f] for r in rs) for f in HIDDEN_FIELDS}}
            for k, rs in runs.items()}


def _driver_select(config, batch, eos_token_id=None) -> float:
    """What the driver does for ``score_source=rollout``; adds the mask fields to ``batch``; returns seconds."""
    from verl_tokensel_cpu.batches import add_driver_selection

    t0 = time.perf_counter()
    add_driver_selection(config, batch, eos_token_id=eos_token_id)
    return time.perf_counter() - t0


def child_kernel(rows: int, rounds: int) -> list[str]:
    """The two log-prob kernels alone on ``rows`` x 151,936 random float32 logits (a non-leaf tensor, as the
    engine's temperature-scaled logits), interleaved ``rounds`` times: verl's CPU fallback
    ``logprobs_from_logits_v2`` and ``no_graph.logprobs_from_lse`` after the chunked no-graph entropy pass
    (in place). Per call: forward and backward seconds, and the RSS high-water mark of forward + backward
    above the logits (reset after they are built)."""
    import torch

    import verl.utils.torch_functional as verl_F
    from verl_tokensel.verl_glue import no_graph

    torch.manual_seed(0)
    labels = torch.randint(0, VOCAB, (rows,))
    grad = torch.randn(rows)
    out = []
    for _ in range(rounds):
        for name in ("logprobs_from_logits_v2", "logprobs_from_lse"):
            x = torch.randn(rows, VOCAB, requires_grad=True)
            y = x * 2.0
            _reset_hwm()
            base = _hwm_kb()
            t0 = time.perf_counter()
            if name == "logprobs_from_logits_v2":
                lp = verl_F.logprobs_from_logits_v2(y, labels)
            else:
                cache = no_graph._LseCache()
                no_graph.entropy_no_graph(y, cache=cache)
                lp = no_graph.logprobs_from_lse(y, labels, cache.lse, inplace=True)
            t1 = time.perf_counter()
            lp.backward(grad)
            t2 = time.perf_counter()
            out.append(f"{name:<24} rows {rows}: forward {t1 - t0:6.2f} s  backward {t2 - t1:6.2f} s  peak above "
                       f"the logits {(_hwm_kb() - base) / 2**20:5.2f} GiB (logits {rows * VOCAB * 4 / 2**30:.2f} GiB)")
            print(out[-1], flush=True)
            del x, y, lp
    return out


def _group(variant: str) -> str:
    """A selector's target group: ``gmts``, a rule over the hidden states (its name), or ``other selectors``."""
    base = base_variant(variant)
    return base if base == "gmts" or base in HIDDEN else "other selectors"


def _verdict(variant: str, hidden: int, m: float, pm: float, t: float) -> str:
    group = _group(variant)
    # a rule over the hidden states adds K + 3 forwards (or one, cached) by design: its time is reported, no target
    t_target = TARGET_GMTS if group == "gmts" else None if group in HIDDEN else TARGET_TIME.get(hidden)
    mem = TARGET_MEM_HIDDEN if group in HIDDEN else TARGET_MEM
    bad = [s for s, ok in (("update memory", m != m or m <= mem),  # NaN: not measured
                           ("process memory", pm != pm or pm <= mem),
                           ("time", t_target is None or t != t or t <= t_target)) if not ok]
    return "ok" if not bad else "NOT MET: " + ", ".join(bad)


def matched_baseline(variant: str, row: dict) -> str:
    """The baseline that runs a selector's engine functions: ``none(same kernel)`` where its update ran
    ``logprobs_from_lse``, else ``none(no-graph entropy)``."""
    kernel = row.get("kernel", "-")
    if kernel == "-":  # not timed (--no-time), so not probed: the kernel the variant's update runs (docstring above)
        return "none(same kernel)" if variant == "forking" else "none(no-graph entropy)"
    return "none(same kernel)" if "logprobs_from_lse" in kernel else "none(no-graph entropy)"


def report(results: dict, variants: list[str]) -> list[str]:
    """The tables (one per shape; each ratio against stock ``none`` and against the selector's matched baseline,
    side by side) and the summary lines per target."""
    lines = []
    worst: dict = {}  # (target, "none" or "matched", hidden for step time) -> (ratio, variant, shape)
    for key, rows in results.items():
        if "killed" in rows:
            lines.append(f"\n{key}: not measured: {rows['killed']}")
            continue
        hidden = int(key.split("/")[0][1:])
        t_target = TARGET_TIME.get(hidden)
        base = rows["none"]
        lines.append(f"\n{key} (hidden/tokens per micro-batch x mini-batches), vocabulary {VOCAB}; stock none: update "
                     f"peak {base['peak_kb'] / 2**20:.2f} GiB, process peak {base['process_peak_kb'] / 2**20:.2f} "
                     f"GiB, step {base['seconds']:.1f} s, log-prob kernel {base['kernel_seconds']:.1f} s")
        reps = len(base.get("peak_kb_runs", [0]))
        lines.append("memory: not measured (--no-memory)" if base["peak_kb"] != base["peak_kb"] else
                     f"memory: {reps} process{'es' if reps > 1 else ''} per variant (max), allocator "
                     f"{base.get('allocator', 'default')}")
        lines.append(f"targets: memory <= {TARGET_MEM:.2f}x, time <= "
                     f"{t_target if t_target else float('nan'):.2f}x (gmts <= {TARGET_GMTS:.2f}x; "
                     f"{', '.join(HIDDEN)}: memory <= {TARGET_MEM_HIDDEN:.2f}x, time reported); "
                     "each ratio as: vs none | vs the matched baseline (same engine functions)")
        lines.append(f"{'variant':<22} {'update peak':>11} {'process peak':>12} {'step time':>11} {'CPU time':>11} "
                     f"{'kernel s':>8}  {'log-prob kernel':<23} {'reused':>6}  {'matched':<22} verdict (vs none | "
                     "vs matched)")
        for v in (v for v in variants if v in rows):  # --report: a shape shows the variants it ran
            r = rows[v]
            selector = base_variant(v) in SELECTORS
            matched = matched_baseline(v, r) if selector or v in REFERENCES else ""
            cols, ratios = [], {}
            for field in ("peak_kb", "process_peak_kb", "seconds", "cpu_seconds"):
                pair = []
                for b in ("none", matched):
                    val = rows[b].get(field, float("nan")) if b in rows else float("nan")
                    pair.append(r.get(field, float("nan")) / val if val == val and val else float("nan"))
                ratios[field] = pair
                cols.append(f"{pair[0]:.2f}|{pair[1]:.2f}".replace("nan", " - "))
            r["ratios"] = {"vs_none": {f: p[0] for f, p in ratios.items()},
                           "vs_matched": {f: p[1] for f, p in ratios.items()}, "matched": matched}
            note = "(baseline)" if v in BASELINES else "(reference)" if v in REFERENCES else ""
            if selector:
                note = " | ".join(_verdict(v, hidden, ratios["peak_kb"][i], ratios["process_peak_kb"][i],
                                           ratios["seconds"][i]) for i in range(2))
                group = _group(v)
                mem = f" ({group})" if group in HIDDEN else ""
                for i, b in enumerate(("none", "matched")):
                    for tgt, val in ((f"update peak memory{mem}", ratios["peak_kb"][i]),
                                     (f"process peak memory{mem}", ratios["process_peak_kb"][i]),
                                     (f"step time ({group})", ratios["seconds"][i]),
                                     (f"step CPU time ({group})", ratios["cpu_seconds"][i])):
                        other = "(other" in tgt
                        if other and t_target is None:
                            continue
                        slot = (tgt, b, hidden if other else None)
                        if val == val and (slot not in worst or val > worst[slot][0]):
                            worst[slot] = (val, v, key)
            share = r.get("prepass_reused_share", float("nan"))
            lines.append(f"{v:<22} {cols[0]:>11} {cols[1]:>12} {cols[2]:>11} {cols[3]:>11} "
                         f"{r['kernel_seconds']:>8.1f}  "
                         f"{r.get('kernel', '-'):<23} {f'{share:.0%}' if share == share else '-':>6}  "
                         f"{matched or '-':<22} {note}")
        # a rule over the hidden states: what its passes cost, and what a cache of them holds
        for v in (v for v in variants if v in rows):
            r = rows[v]
            if base_variant(v) not in HIDDEN:
                continue
            knobs = split_variant(v)[1]
            fw, sec, tok, byt = (r.get(f, float("nan")) for f in HIDDEN_FIELDS)
            lines.append(f"  {v}: {fw:.0f} no-grad forward(s) over the step's batch before its update "
                         f"(delta_cache_gib {knobs.get('delta_cache_gib', 0)}), passes {sec:.1f} s; "
                         f"{tok:.0f} valid response tokens, their hidden states {byt / 2**20:.1f} MiB "
                         f"(tokens x H x bytes: what the cache holds when on)".replace("nan", "-"))
    lines.append("")
    nan = float("nan")
    runs = [(max(r[f]) / min(r[f]), v, key, r.get("allocator", "default")) for key, rows in results.items()
            if "killed" not in rows for v, r in rows.items() for f in ("peak_kb_runs", "process_peak_kb_runs")
            if len(r.get(f, [])) > 1]
    for alloc in sorted({a for *_, a in runs}):  # identical processes: what one reading is worth
        val, v, key, _ = max(r for r in runs if r[3] == alloc)
        lines.append(f"summary: peak memory over repeated identical processes (allocator {alloc}): widest spread "
                     f"(max/min) {val:.2f}x ({v}, {key})")
    for field, what in (("seconds", "step time"), ("cpu_seconds", "step CPU time")):
        spread = [rows["none(no-graph entropy)"].get(field, nan) / rows["none"][field] for rows in results.values()
                  if "killed" not in rows and "none(no-graph entropy)" in rows and rows["none"].get(field, 0) > 0]
        spread = [x for x in spread if x == x]
        if spread:  # both update with verl's log-prob kernel; only the no-graph entropy pass tells them apart
            lines.append(f"summary: none(no-graph entropy) vs none {what} over the shapes: {min(spread):.2f}x to "
                         f"{max(spread):.2f}x (the same update kernel; read the {what} ratios against this spread)")
    limits = {"update peak memory": TARGET_MEM, "process peak memory": TARGET_MEM,
              "step time (gmts)": TARGET_GMTS, "step CPU time (gmts)": TARGET_GMTS,
              **{f"{w} peak memory ({h})": TARGET_MEM_HIDDEN for w in ("update", "process") for h in HIDDEN},
              **{f"step {w}time ({h})": None for w in ("", "CPU ") for h in HIDDEN}}
    for (tgt, b, hidden), (val, v, key) in sorted(worst.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        limit = limits.get(tgt, TARGET_TIME.get(hidden))
        where = f" at hidden {hidden}" if hidden else ""
        against = "none" if b == "none" else "the matched baseline"
        verdict = ("no target (reported)" if limit is None else
                   f"target <= {limit:.2f}x: {'met' if val <= limit else 'NOT MET'}")
        lines.append(f"summary: {tgt}{where} vs {against}: worst {val:.2f}x ({v}, {key}), {verdict}")
    return lines


def merge(parts: list[dict]) -> dict:
    """Saved ``--json`` runs merged in order: a later run's shape replaces an earlier one's, except that a field
    it did not measure (NaN, or kernel ``-``: ``--no-time`` / ``--no-memory``) keeps the earlier value, so a
    memory-only rerun joins an earlier timing; a variant that only one of them ran keeps its row."""
    def measured(x) -> bool:
        return not (x == "-" or (isinstance(x, float) and x != x))

    out: dict = {}
    for part in parts:
        for key, rows in part.items():
            old = out.get(key)
            if old is None or "killed" in old or "killed" in rows:
                out[key] = rows
                continue
            out[key] = {**old, **{v: {**old.get(v, {}), **{f: x for f, x in r.items() if measured(x)}}
                                  for v, r in rows.items()}}  # a variant only the earlier run measured stays
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=None, help="hidden sizes (default 128 1024)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated TOKENSxMINIBATCHES: tokens per micro-batch, PPO mini-batches per step "
                         "(default 2304x2; --grid: " + ",".join(GRID_SHAPES) + ")")
    ap.add_argument("--grid", action="store_true",
                    help="every shape of the grid (" + ",".join(GRID_SHAPES) + ") at hidden 128 and 1024")
    ap.add_argument("--steps", type=int, default=3, help="interleaved timing rounds after a warm-up round (default 3)")
    ap.add_argument("--mem-steps", type=int, default=2,
                    help="measured steps per memory process after its warm-up step (default 2)")
    ap.add_argument("--mem-reps", type=int, default=1,
                    help="memory processes per variant: the max is reported, the spread in the summary (default 1)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="memory processes run at a time (default 1; each peak is its own process's RSS, so running "
                         "several only needs the host to hold them all; it changes no reading but their wall time)")
    ap.add_argument("--allocator", choices=sorted(ALLOCATORS), default="fixed",
                    help="glibc malloc of the memory processes: fixed (mmap threshold 128 KiB: RSS follows the live "
                         "tensors) or default (glibc's moving threshold: RSS also depends on earlier frees); "
                         "default fixed")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated subset of: " + ", ".join(VARIANTS) + " (default: all but the references "
                         + ", ".join(REFERENCES) + ")")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "verl_tokensel_bench_memory"))
    ap.add_argument("--json", default=None, help="also write the measurements here (rewritten after each shape)")
    ap.add_argument("--no-time", action="store_true", help="measure peak memory only (skip the timing process)")
    ap.add_argument("--no-memory", action="store_true",
                    help="measure step time only (skip the memory processes; --report joins it to a memory run)")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the tables and summary of saved --json files (merged in order) and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mini-batches", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kernel", type=int, default=None, metavar="ROWS",
                    help="only time the two log-prob kernels on ROWS x vocabulary logits (--steps rounds) and exit")
    args = ap.parse_args(argv)
    if args.kernel:
        child_kernel(args.kernel, args.steps)
        return 0
    if args.child == "time":
        print(json.dumps(child_time(args.variants.split(","), args.model, args.tokens, args.mini_batches,
                                    args.steps)))
        return 0
    if args.child:
        print(json.dumps(child_memory(args.child, args.model, args.tokens, args.mini_batches, args.mem_steps)))
        return 0
    if args.report:
        results = merge([json.loads(Path(path).read_text()) for path in args.report])
        measured = [rows for rows in results.values() if "killed" not in rows]
        seen = list(dict.fromkeys(v for rows in measured for v in rows))  # knob variants too, in VARIANTS' order
        shown = sorted((v for v in seen if base_variant(v) in VARIANTS),
                       key=lambda v: (VARIANTS.index(base_variant(v)), seen.index(v)))
        print("\n".join(report(results, shown)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    if args.no_time and args.no_memory:
        ap.error("--no-time and --no-memory: nothing left to measure; give at most one")
    if args.parallel < 1:
        ap.error(f"--parallel {args.parallel}: must be >= 1")
    if args.mem_reps < 1:
        ap.error(f"--mem-reps {args.mem_reps}: must be >= 1")
    bad = [v for v in variants if v not in VARIANTS and not (base_variant(v) in SELECTORS and split_variant(v)[1])]
    if bad or "none" not in variants:
        ap.error(f"--variants {args.variants!r}: must include none; valid: {', '.join(VARIANTS)}, or a selector with "
                 "token_selection knobs as NAME:KNOB=VALUE[:KNOB=VALUE] (e.g. delta:delta_cache_gib=4)")
    hiddens = args.hidden or GRID_HIDDEN
    shapes = [parse_shape(s) for s in (args.shapes or (",".join(GRID_SHAPES) if args.grid else "2304x2")).split(",")]
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for hidden in hiddens:
        model_dir = build_model_dir(root, hidden)
        for tokens, mbs in shapes:
            key = f"h{hidden}/{tokens}x{mbs}"

            def run_child(*extra, label, env=None):
                t0 = time.time()
                proc = subprocess.run([sys.executable, __file__, "--model", model_dir, "--tokens", str(tokens),
                                       "--mini-batches", str(mbs), "--steps", str(args.steps),
                                       "--mem-steps", str(args.mem_steps), *extra], capture_output=True, text=True,
                                      env=env)
                if proc.returncode == -signal.SIGKILL:  # the kernel's OOM killer: the shape does not fit here
                    print(f"  {key} {label}: killed (SIGKILL, out of memory on this host) after "
                          f"{time.time() - t0:.0f}s", file=sys.stderr, flush=True)
                    return None
                if proc.returncode != 0:
                    print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"{label} ({key}) failed with exit code {proc.returncode}")
                print(f"  {key} {label}: done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
                return json.loads(proc.stdout.strip().splitlines()[-1])

            rows, killed = {}, None
            env = {**{k: x for k, x in os.environ.items() if not k.startswith("MALLOC_")},  # glibc: only the choice
                   **ALLOCATORS[args.allocator]}
            jobs = [(v, rep) for v in (variants if not args.no_memory else []) for rep in range(args.mem_reps)]
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # fresh processes each, --parallel at a time
                done = list(pool.map(lambda job: run_child("--child", job[0], env=env, label=f"{job[0]} (memory "
                                                           f"{job[1] + 1}/{args.mem_reps})"), jobs))
            for v in (variants if not args.no_memory else []):
                runs = [r for (w, _), r in zip(jobs, done) if w == v]
                if any(r is None for r in runs):
                    killed = v
                    break
                rows[v] = {"variant": v, "allocator": args.allocator,
                           "peak_kb_runs": [r["peak_kb"] for r in runs],
                           "process_peak_kb_runs": [r["process_peak_kb"] for r in runs]}
                rows[v].update(peak_kb=max(rows[v]["peak_kb_runs"]),
                               process_peak_kb=max(rows[v]["process_peak_kb_runs"]),
                               **{f: runs[-1].get(f, float("nan")) for f in HIDDEN_FIELDS})
            if args.no_memory:
                rows = {v: {"variant": v, "peak_kb": float("nan"), "process_peak_kb": float("nan")} for v in variants}
            if killed:  # a shape this host cannot hold is recorded as such (report() prints it); the grid goes on
                results[key] = {"killed": f"{killed} (memory) was killed by the OOM killer "
                                          f"({_host_memory_gib():.1f} GiB host)"}
            else:
                nan = {"seconds": float("nan"), "cpu_seconds": float("nan"), "kernel_seconds": float("nan"),
                       "kernel": "-", "prepass_reused_share": float("nan"),
                       "hidden_sweep_seconds": float("nan")}  # the memory processes' passes are not timed
                timed = None if args.no_time else run_child("--child", "time", "--variants", ",".join(variants),
                                                            label="all variants (time)")
                for v in variants:
                    rows[v].update(nan if timed is None else timed[v])
                results[key] = rows
            print("\n".join(line for line in report({key: results[key]}, variants) if not line.startswith("summary")),
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    print("\n".join(line for line in report(results, variants) if line.startswith("summary") or not line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
