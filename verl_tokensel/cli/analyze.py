"""Per-token entropy / gradient-norm analysis of responses under a local model, with a report.

Scores every response token of the data with the model (chunked over the vocabulary, so memory stays
bounded) and writes ``report.json``, ``report.md`` and PNG plots into ``--out``: entropy percentiles
and the share of near-zero-entropy tokens, the most frequent forking tokens (top 20% by entropy),
Spearman correlation of entropy with the exact per-token gradient norm within vs across answers
(the GMTS argument), and the overlap of the entropy and GMTS top-20% sets.

``--data`` is a verl rollout dump directory (``trainer.rollout_data_dir``), one dump ``<step>.jsonl``,
or a ``.parquet`` / ``.jsonl`` with string columns ``prompt`` and ``response`` and optional
``reward`` (or ``score``), ``advantage``, ``uid`` (or ``group``). Advantages: the ``advantage`` column,
else GRPO from the rewards per prompt group, else none (then the GMTS statistics are omitted). Dumps
are decoded with ``skip_special_tokens``, so chat-template special tokens are not scored.

Examples::

    # the embedded tiny model (random weights, no download) on a rollout dump
    python -c "from verl_tokensel.cpu.tiny_model import build_tiny_model_dir; print(build_tiny_model_dir('/tmp/tiny'))"
    verl-tokensel analyze --model /tmp/tiny --data /path/to/rollout_data_dir --out /tmp/tiny_report

    # a real checkpoint on a GPU, bf16, the first 2000 responses of a parquet table
    verl-tokensel analyze --model Qwen3-8B/ --data samples.parquet --out report/ \\
        --device cuda --dtype bfloat16 --max-responses 2000 --chunk-size 16384
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HELP = "per-token entropy / gradient-norm report of responses under a local model"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="local HF model directory (also the tokenizer)")
    parser.add_argument("--data", required=True, help="rollout dump dir, dump .jsonl, or .parquet/.jsonl table")
    parser.add_argument("--out", required=True, help="output directory for report.json, report.md, *.png")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    add_scoring_arguments(parser, max_help="score only the first N responses (advantages still use whole groups)")


def add_scoring_arguments(parser, max_help: str = "score only the first N responses") -> None:
    """The scorer options shared by analyze and compare."""
    from verl_tokensel.analysis.scorer import DEFAULT_CHUNK

    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK,
                        help=f"vocabulary chunk of the scorer (default {DEFAULT_CHUNK})")
    parser.add_argument("--max-responses", type=int, default=None, help=max_help)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to score (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (bfloat16 only with --device cuda)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="rollout temperature: entropies are of softmax(logits / T) (default 1.0)")


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def check_common_args(args) -> None:
    from verl_tokensel.analysis.io import AnalysisInputError

    if args.chunk_size <= 0:
        raise AnalysisInputError(f"--chunk-size must be > 0, got {args.chunk_size}")
    if not args.temperature > 0:
        raise AnalysisInputError(f"--temperature must be > 0, got {args.temperature}")
    if args.max_responses is not None and args.max_responses <= 0:
        raise AnalysisInputError(f"--max-responses must be > 0, got {args.max_responses}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise AnalysisInputError(f"{out}: --out exists and is not a directory")


def score_with_progress(model, pairs, *, desc: str, temperature: float, device, chunk_size=None):
    """:func:`~verl_tokensel.analysis.scorer.score_responses` with a progress bar on stderr."""
    from tqdm import tqdm

    from verl_tokensel.analysis.scorer import DEFAULT_CHUNK, score_responses

    with tqdm(total=len(pairs), desc=desc, unit="resp", file=sys.stderr, mininterval=0.5) as bar:
        done = [0]

        def progress(i: int) -> None:
            bar.update(i - done[0])
            done[0] = i

        return score_responses(model, pairs, temperature=temperature, chunk_size=chunk_size or DEFAULT_CHUNK,
                               device=device, progress=progress)


def _f(v, digits: int = 4) -> str:
    return "n/a" if v is None or v != v else f"{v:.{digits}g}"


def run(args) -> int:
    from verl_tokensel.analysis import io
    from verl_tokensel.analysis.report import require_matplotlib, write_analysis
    from verl_tokensel.analysis.stats import build_report, resolve_advantages

    t0 = time.time()
    try:
        check_common_args(args)
        require_matplotlib()
        records = io.load_records(args.data)
        advantages, adv_source = resolve_advantages(records)
        if args.max_responses is not None:
            records = records[: args.max_responses]
            advantages = None if advantages is None else advantages[: args.max_responses]
        tok_path = args.tokenizer or args.model
        tokenizer = io.load_tokenizer(tok_path)
        io.check_vocab(tokenizer, tok_path, args.model)
        pairs = io.tokenize_records(tokenizer, records)
        model = io.load_model(args.model, device=args.device, dtype=args.dtype)
    except (io.AnalysisInputError, RuntimeError) as e:
        return _error(str(e))

    print(f"scoring {len(pairs)} responses ({sum(len(r) for _, r in pairs)} tokens) from {args.data} "
          f"under {args.model} on {args.device}", file=sys.stderr)
    try:
        scores = score_with_progress(model, pairs, desc="analyze", temperature=args.temperature,
                                     device=args.device, chunk_size=args.chunk_size)
    except ValueError as e:
        return _error(f"{args.data}: {e}")

    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id])

    report = build_report(scores, advantages, decode=decode, advantage_source=adv_source)
    report = {"model": str(args.model), "tokenizer": str(tok_path), "data": str(args.data),
              "temperature": args.temperature, "device": args.device, "dtype": args.dtype, **report}
    path = write_analysis(args.out, report, scores, advantages)

    e = report["entropy"]
    print(f"report: {path}")
    print(f"responses {report['responses']}, tokens {report['token_count']}, {time.time() - t0:.1f}s")
    print("entropy P50/P80/P90/P99 (nats): "
          + " / ".join(_f(e["percentiles"][q]) for q in ("50", "80", "90", "99")))
    print(f"share of tokens with H < 0.01: {_f(e['share_below_0.01'])}")
    print(f"top-20% entropy threshold: {_f(e['top_threshold'])}")
    top = report["forking_tokens"][:8]
    if top:
        print("top forking tokens: " + ", ".join(f"{t['text']!r} x{t['count']}" for t in top))
    g = report.get("gmts")
    if g:
        c = g["entropy_vs_exact_grad_norm"]
        print(f"Spearman(entropy, exact grad norm): within answers {_f(c['within_answer_mean'])} "
              f"(mean of {c['within_answers_used']} answers), across answers {_f(c['across_answers'])}")
        print(f"Jaccard(entropy top-20%, GMTS top-20%): {_f(g['jaccard_entropy_top_vs_gmts_top'])}")
    else:
        print(f"GMTS statistics omitted: {report['gmts_omitted_reason']}")
    return 0
