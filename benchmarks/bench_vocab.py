"""Vocabulary reductions (Lp-Reg's min-p proxy, SimKO's top-K log-probs): ours vs the releases' forms, CPU fp32.

Run (from the repository root; about 5 minutes for the whole grid on 2 busy cores)::

    nice -n 10 python benchmarks/bench_vocab.py [--quick]

Ours is ``verl_tokensel.core.seam.vocab.reduce_rows`` (chunks of ``CHUNK_ELEMENTS`` logits). The releases, restated
from their code (``tests/helpers/released_rules.py`` names the commits):

* SimKO (arXiv 2510.14807): the current top-K log-probs with gradient, from an ``(N*K, V)`` copy of the logits (each
  row repeated K times: ``unsqueeze(1).expand(N, K, V).reshape(N*K, V)``), log-softmax of the copy, gather at the
  rows' top-K ids. Ours: ``reduce_rows((VocabStat("top_k", "update", k=K),), ..., grad=True)``.
* Lp-Reg (arXiv 2510.03222): the min-p proxy log-prob in an extra no-grad forward, ``apply_min_p`` as released
  (chunks of 4096 rows: clone, softmax of the raw logits, entries with ``p < kappa * p_max`` set to ``-1e4``, the
  chunks concatenated), then ``div_(T)`` and verl's log-prob of the sampled token. Ours:
  ``reduce_rows((VocabStat("min_p", "old", kappa=kappa),), logits, labels, temperature)``.

Grid: tokens N in {512, 2048} x vocabulary V in {32000, 151936}, K = 3, kappa = 0.02, temperature 1.0 (the released
scripts' values), logits ~ N(0, 3^2), labels drawn among each row's 8 largest logits (one row in four: uniform over
the vocabulary, so some fall under the min-p filter). ``--quick``: only N=512, V=32000.

* Extra peak memory: each variant runs in a fresh subprocess (1 torch thread) that warms every code path up on tiny
  inputs, builds the logits and labels in place, then does one pass; ``ru_maxrss`` minus that of a baseline
  subprocess that does the same pass without the variant. The memory subprocesses run with
  ``MALLOC_MMAP_THRESHOLD_=65536``: every buffer of 64 KiB or more is its own mapping, returned at its free, so a peak
  counts live tensors (with glibc's default heap reuse, identical processes here differed by up to ~1.3 GB, the
  peak of ours' SimKO pass at N=2048, V=151936 landing at +0 or +1.3 GB). SimKO's rows sit in an update pass
  (baseline ``update``: the logits leaf, verl's log-prob of the sampled token, one backward of the loss; the variant
  adds the weighted sum of its top-K log-probs to that loss). Lp-Reg's rows sit in the no-grad old-log-prob pass
  (baseline ``old``: the logits and verl's log-prob, no grad), where the proxy is computed.
* Time: one subprocess per cell runs the four variants interleaved, one warm-up then ``--repeats`` (3) timed calls
  each; the median, and ours / release. SimKO's timing includes the backward of the weighted sum.
* Agreement: max |ours - release| of the top-K log-probs, their gradients to the logits, and the proxies.

Simplifications: verl's log-prob is its CPU path (``logprobs_from_logits_v2``, float32: gather minus a row-wise
logsumexp), restated here to keep verl's import out of the processes. Where the releases call verl's
``logprobs_from_logits`` we keep the CPU form that costs the release less: log-softmax + gather on SimKO's copy (verl's
row-wise form kept ~1.5x more there), the row-wise form for Lp-Reg's no-grad read. On GPU the releases run
flash-attn's cross-entropy instead, which keeps only SimKO's copy (its backward writes in place), so there the
release's SimKO extra is nearer ``(K + 1) * N * V`` floats than the ``~2 * K * N * V`` measured here. A cell variant
whose estimated peak exceeds ``--max-gb`` (12) is skipped and the output says why; where SimKO's release is skipped
the summary extrapolates its extra from the measured cells (MB per N*V float), marked as such.

Last run (2026-12-07, 2 shared cores; ``benchmarks/results/bench_vocab_cpu.md``): SimKO's top-3, ours 0.04x the
release's extra memory at the three cells where the release fits (+75 MB vs +1,854 MB at N=512, V=151936), +302 MB at
N=2048, V=151936 (the release's there: ~7.4 GB, extrapolated), 0.40-0.48x its time. Ours' backward allocates one
logits-sized gradient, but autograd adds verl's log-prob gradient into it in place, so it stands in for a buffer
verl's backward would have allocated: +0.25 N*V floats at every cell. Lp-Reg's proxy: ours ~410 MB once N*V > 2^25
(0.12x the release's 3,561 MB at the largest cell; 1.08x at N=512, V=32000, where one chunk holds every row), and
1.1-1.4x the release's time (slower; at the largest cell the ratio ranged 0.45-1.10x over four runs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = [(512, 32000), (512, 151936), (2048, 32000), (2048, 151936)]
QUICK = [(512, 32000)]
K = 3
KAPPA = 0.02
RELEASE_CHUNK_ROWS = 4096  # Lp-Reg's apply_min_p
VARIANTS = ("simko_release", "simko_ours", "lp_reg_release", "lp_reg_ours")
BASELINE = {"simko_release": "update", "simko_ours": "update", "lp_reg_release": "old", "lp_reg_ours": "old"}
MMAP_THRESHOLD = 65536  # bytes; glibc maps every larger buffer on its own (see the docstring's memory paragraph)
LIBRARIES_GB = 0.6  # torch and the interpreter, resident in every process


def _need_gb(variant: str, n: int, v: int) -> float:
    """Estimated peak resident GB of a variant's memory process, fitted to this script's runs at the smaller cells
    (baselines: ``old`` ~ 1 N*V floats, ``update`` ~ 3.7; the release's SimKO adds ~2.1 K N*V)."""
    nv = n * v * 4 / 1e9
    need = {
        "simko_release": 3.7 * nv + 2.1 * K * nv,  # the update pass + the copy, its log-softmax and their gradients
        "simko_ours": 4.7 * nv,  # the update pass + at most one logits-sized gradient
        "lp_reg_release": nv + 3.5 * min(n, RELEASE_CHUNK_ROWS) * v * 4 / 1e9,  # clone, softmax, masks, concatenation
        "lp_reg_ours": nv + 0.6,  # a few chunks of 2^25 logits
    }[variant]
    return LIBRARIES_GB + need


# --- the computations --------------------------------------------------------------------------------------------


def _verl_log_prob(logits, labels):
    """verl's ``logprobs_from_logits_v2`` float32 path (its CPU log-prob): gather minus a row-wise logsumexp."""
    import torch

    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])


def simko_release(logits, labels):
    """(N, V) scaled logits -> (N, K) top-K log-probs with grad, through the (N*K, V) copy as SimKO's release."""
    n, v = logits.shape
    ids = logits.detach().topk(K, dim=-1).indices
    copy = logits.unsqueeze(1).expand(n, K, v).reshape(n * K, v)
    return copy.log_softmax(-1).gather(-1, ids.reshape(n * K, 1)).view(n, K)


def simko_ours(logits, labels):
    from verl_tokensel.core.seam.vocab import VocabStat, reduce_rows

    return reduce_rows((VocabStat("top_k", "update", k=K),), logits, labels, grad=True)["update_top_k"]


def lp_reg_release(raw_logits, labels, temperature: float):
    """(N, V) raw logits -> (N,) min-p proxy log-prob, no grad, as Lp-Reg's release (``apply_min_p``, then
    ``div_(T)`` and verl's log-prob)."""
    import torch

    chunks = []
    for chunk in torch.split(raw_logits.detach(), RELEASE_CHUNK_ROWS, dim=0):
        chunk = chunk.clone()
        p = torch.softmax(chunk, dim=-1)
        chunk.masked_fill_(p < KAPPA * p.amax(dim=-1, keepdim=True), -1e4)
        chunks.append(chunk)
    filtered = torch.cat(chunks, dim=0)
    filtered.div_(temperature)
    return _verl_log_prob(filtered, labels)


def lp_reg_ours(scaled_logits, labels, temperature: float):
    import torch

    from verl_tokensel.core.seam.vocab import VocabStat, reduce_rows

    t = torch.full((scaled_logits.shape[0],), temperature)
    return reduce_rows((VocabStat("min_p", "old", kappa=KAPPA),), scaled_logits, labels, t)["old_min_p"]


TOP_K = {"simko_release": simko_release, "simko_ours": simko_ours}
PROXY = {"lp_reg_release": lp_reg_release, "lp_reg_ours": lp_reg_ours}


def _inputs(n: int, v: int, seed: int = 1234):
    """Logits (N, V) ~ N(0, 9) built in place, labels among each row's 8 largest (one row in four uniform), top-K
    weights (N, K). Row chunks keep every transient small, so no baseline is inflated."""
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(n, v).normal_(generator=g).mul_(3.0)
    labels = torch.empty(n, dtype=torch.long)
    for i in range(0, n, 16):
        top = logits[i:i + 16].topk(8, dim=-1).indices
        labels[i:i + 16] = top.gather(-1, torch.randint(0, 8, (top.shape[0], 1), generator=g)).squeeze(-1)
    uniform = torch.rand(n, generator=g) < 0.25
    labels[uniform] = torch.randint(0, v, (int(uniform.sum()),), generator=g)
    weights = torch.rand(n, K, generator=g)
    return logits, labels, weights


def _warm_up(temperature: float) -> None:
    """Every code path once on tiny inputs: libraries and allocator state alike in every process."""
    import torch

    logits, labels, weights = _inputs(8, 4096, seed=0)
    logits.requires_grad_(True)
    loss = _verl_log_prob(logits, labels).sum()
    for fn in TOP_K.values():
        loss = loss + (weights * fn(logits, labels)).sum()
    loss.backward()
    with torch.no_grad():
        for fn in PROXY.values():
            fn(logits.detach(), labels, temperature)


# --- the subprocesses --------------------------------------------------------------------------------------------


def _child_memory(args) -> dict:
    import torch

    torch.set_num_threads(1)
    _warm_up(args.temperature)
    logits, labels, weights = _inputs(args.n, args.v)
    if args.variant in ("update", *TOP_K):
        logits.requires_grad_(True)
        loss = _verl_log_prob(logits, labels).sum()
        if args.variant in TOP_K:
            loss = loss + (weights * TOP_K[args.variant](logits, labels)).sum()
        loss.backward()
        assert bool(torch.isfinite(logits.grad).all())
    else:
        with torch.no_grad():
            lp = _verl_log_prob(logits, labels)  # one tensor stands for the raw and the scaled logits (same memory)
            if args.variant in PROXY:
                lp = PROXY[args.variant](logits, labels, args.temperature)
        assert bool(torch.isfinite(lp).all())
    return {"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def _child_speed(args) -> dict:
    import torch

    torch.set_num_threads(1)
    _warm_up(args.temperature)
    raw, labels, weights = _inputs(args.n, args.v)
    scaled = raw / args.temperature if args.temperature != 1.0 else raw
    leaf = scaled.requires_grad_(True)
    skip = set(filter(None, args.skip.split(",")))

    def top_k(name):
        leaf.grad = None
        out = TOP_K[name](leaf, labels)
        (weights * out).sum().backward()
        return out.detach(), leaf.grad

    def proxy(name):
        with torch.no_grad():
            return PROXY[name](raw.detach() if name == "lp_reg_release" else leaf.detach(), labels, args.temperature)

    calls = {name: (lambda name=name: top_k(name)) if name in TOP_K else (lambda name=name: proxy(name))
             for name in VARIANTS if name not in skip}
    outs = {name: fn() for name, fn in calls.items()}  # warm-up (also first-touch of the pages)
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    diff = {}
    if "simko_release" in outs:
        (v_rel, g_rel), (v_ours, g_ours) = outs["simko_release"], outs["simko_ours"]
        diff["top_k"] = float((v_ours - v_rel).abs().max())
        diff["top_k_grad"] = float((g_ours - g_rel).abs().max())
    p_rel, p_ours = outs["lp_reg_release"], outs["lp_reg_ours"]
    diff["min_p"] = float((p_ours - p_rel).abs().max())
    kept = p_rel > -1e3 / args.temperature  # tokens the filter kept (a filtered one reads about -1e4 / T)
    diff["min_p_kept"] = float((p_ours - p_rel)[kept].abs().max()) if bool(kept.any()) else 0.0
    diff["filtered_share"] = float(1 - kept.float().mean())
    return {"times": times, "diff": diff}


def _run_child(mode: str, n: int, v: int, args, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", mode, "--n", str(n), "--v", str(v),
           "--repeats", str(args.repeats), "--temperature", str(args.temperature)]
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"child {mode} N={n} V={v} {extra} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- the driver --------------------------------------------------------------------------------------------------


def _measure_cell(n: int, v: int, args) -> dict:
    skipped = {name: _need_gb(name, n, v) for name in VARIANTS if _need_gb(name, n, v) > args.max_gb}
    kb = {}
    for name in ("update", "old", *[x for x in VARIANTS if x not in skipped]):
        print(f"  N={n} V={v}: memory, {name} ...", file=sys.stderr, flush=True)
        kb[name] = _run_child("memory", n, v, args, variant=name)["maxrss_kb"]
    print(f"  N={n} V={v}: time, {args.repeats} repeats ...", file=sys.stderr, flush=True)
    speed = _run_child("speed", n, v, args, skip=",".join(skipped))
    extra_mb = {name: (kb[name] - kb[BASELINE[name]]) / 1024 for name in VARIANTS if name in kb}
    time_s = {name: statistics.median(ts) for name, ts in speed["times"].items()}
    return {"n": n, "v": v, "skipped": skipped, "extra_mb": extra_mb, "time_s": time_s, "diff": speed["diff"],
            "baseline_mb": {b: kb[b] / 1024 for b in ("update", "old")}}


def _ratio(a, b) -> str:
    return f"{a / b:.3f}x" if a is not None and b not in (None, 0) else "-"


def _extrapolated_release_mb(cells: list, c: dict) -> float:
    """SimKO's release extra at a skipped cell: the measured cells' MB per N*V float, times this cell's N*V."""
    per = [x["extra_mb"]["simko_release"] / (x["n"] * x["v"]) for x in cells if "simko_release" in x["extra_mb"]]
    return statistics.mean(per) * c["n"] * c["v"] if per else float("nan")


def _report(cells: list, args) -> None:
    print(f"vocabulary reductions, ours (reduce_rows) vs the releases' forms: fp32 logits on CPU, 1 thread, K={K}, "
          f"kappa={KAPPA}, T={args.temperature}")
    print("extra peak MB: ru_maxrss of a fresh process minus its baseline's (update: logits leaf, verl log-prob, "
          "backward; old: logits, verl log-prob, no grad)")
    print(f"time s: median of {args.repeats} after a warm-up, four variants interleaved in one process per cell; "
          "max |diff|: |ours - release|, top-K log-probs / proxies\n")
    head = (f"{'cell':<15} {'variant':<15} {'baseline':>8} {'extra MB':>9} {'time s':>8} {'MB ours/rel':>11} "
            f"{'time ours/rel':>13} {'max |diff|':>10}")
    print(head)
    print("-" * len(head))
    for c in cells:
        cell = f"N={c['n']} V={c['v']}"
        for family, (rel, ours, key) in {"simko": ("simko_release", "simko_ours", "top_k"),
                                         "lp_reg": ("lp_reg_release", "lp_reg_ours", "min_p")}.items():
            for name in (rel, ours):
                label = name.replace("_", " ").replace("lp reg", "lp_reg")
                if name in c["skipped"]:
                    print(f"{cell:<15} {label:<15} {BASELINE[name]:>8}  skipped: needs ~{c['skipped'][name]:.1f} GB "
                          f"> --max-gb {args.max_gb:g}")
                    cell = ""
                    continue
                mb, t = c["extra_mb"][name], c["time_s"][name]
                is_ours = name == ours
                mem_r = _ratio(mb, c["extra_mb"].get(rel)) if is_ours else ""
                time_r = _ratio(t, c["time_s"].get(rel)) if is_ours else ""
                d = f"{c['diff'][key]:.1e}" if is_ours and key in c["diff"] else ""
                print(f"{cell:<15} {label:<15} {BASELINE[name]:>8} {mb:>9.0f} {t:>8.3f} {mem_r:>11} {time_r:>13} "
                      f"{d:>10}".rstrip())
                cell = ""
    print()
    for c in cells:
        e, t, d = c["extra_mb"], c["time_s"], c["diff"]
        if "simko_release" in e:
            simko = (f"SimKO top-{K} {e['simko_ours']:+.0f} MB ours vs {e['simko_release']:+.0f} MB the release's copy "
                     f"({_ratio(e['simko_ours'], e['simko_release'])}), "
                     f"time {_ratio(t['simko_ours'], t['simko_release'])}, "
                     f"values agree to {d['top_k']:.1e} (gradients {d['top_k_grad']:.1e})")
        else:
            simko = (f"SimKO top-{K} {e['simko_ours']:+.0f} MB ours in {t['simko_ours']:.2f} s; the release's copy "
                     f"skipped (needs ~{c['skipped']['simko_release']:.1f} GB), its extra extrapolated from the "
                     f"measured cells: ~{_extrapolated_release_mb(cells, c):.0f} MB")
        print(f"N={c['n']} V={c['v']}: {simko}; Lp-Reg proxy {e['lp_reg_ours']:+.0f} MB ours vs "
              f"{e['lp_reg_release']:+.0f} MB released ({_ratio(e['lp_reg_ours'], e['lp_reg_release'])}), time "
              f"{_ratio(t['lp_reg_ours'], t['lp_reg_release'])}, agree to {d['min_p']:.1e} ({d['min_p_kept']:.1e} "
              f"on the {1 - d['filtered_share']:.0%} of tokens the filter keeps)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the smallest cell (N=512, V=32000)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per variant after the warm-up")
    ap.add_argument("--temperature", type=float, default=1.0, help="the rows' temperature (the releases' scripts: 1)")
    ap.add_argument("--max-gb", type=float, default=12.0, help="skip a variant whose estimated peak exceeds this")
    ap.add_argument("--json", default=None, help="also write the measurements here")
    ap.add_argument("--_child", choices=["memory", "speed"], help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--v", type=int, default=32000, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="update", help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._child:
        print(json.dumps(_child_memory(args) if args._child == "memory" else _child_speed(args)))
        return 0

    t0 = time.perf_counter()
    cells = [_measure_cell(n, v, args) for n, v in (QUICK if args.quick else GRID)]
    _report(cells, args)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
