"""``verl-tokensel analyze``: per-token entropy / gradient-norm analysis of responses under a local model.

Scores every response token of the data with the model (chunked over the vocabulary, so memory stays
bounded) and writes ``report.json``, ``report.md`` and PNG plots into ``--out``: entropy percentiles and the
share of near-zero-entropy tokens, the most frequent forking tokens (top 20% by entropy), the Spearman
correlation of entropy with the exact per-token gradient norm within vs across answers (the GMTS argument),
and the overlap of the entropy and GMTS top-20% sets. ``--data``: a verl rollout dump or a ``.parquet`` /
``.jsonl`` table; advantages from its ``advantage`` column, else GRPO from the rewards per prompt group, else
none (then the GMTS statistics are omitted). Inputs in full: ``docs/analysis.md``.

Examples::

    verl-tokensel tiny-model --out /tmp/tiny      # the embedded tiny model (random weights, no download)
    verl-tokensel analyze --model /tmp/tiny --data examples/data/rollouts --out /tmp/tiny_report

    # a real checkpoint on a GPU, bf16, the first 2000 responses of a parquet table
    verl-tokensel analyze --model Qwen3-8B/ --data samples.parquet --out report/ \\
        --device cuda --dtype bfloat16 --max-responses 2000 --chunk-size 16384
"""

from __future__ import annotations

import sys
import time

HELP = "per-token entropy / gradient-norm report of responses under a local model"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="local HF model directory (also the tokenizer)")
    parser.add_argument("--data", required=True, help="rollout dump dir, dump .jsonl, or .parquet/.jsonl table")
    parser.add_argument("--out", required=True, help="output directory for report.json, report.md, *.png")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    from verl_tokensel.cli.common import add_scoring_arguments

    add_scoring_arguments(parser, max_help="score only the first N responses (advantages still use whole groups)")


def run(args) -> int:
    from verl_tokensel.cli.common import check_common_args, error, fmt, score_with_progress
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
        return error(str(e))

    print(f"scoring {len(pairs)} responses ({sum(len(r) for _, r in pairs)} tokens) from {args.data} "
          f"under {args.model} on {args.device}", file=sys.stderr)
    try:
        scores = score_with_progress(model, pairs, desc="analyze", temperature=args.temperature,
                                     device=args.device, chunk_size=args.chunk_size)
    except ValueError as e:
        return error(f"{args.data}: {e}")

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
          + " / ".join(fmt(e["percentiles"][q]) for q in ("50", "80", "90", "99")))
    print(f"share of tokens with H < 0.01: {fmt(e['share_below_0.01'])}")
    print(f"top-20% entropy threshold: {fmt(e['top_threshold'])}")
    top = report["forking_tokens"][:8]
    if top:
        print("top forking tokens: " + ", ".join(f"{t['text']!r} x{t['count']}" for t in top))
    g = report.get("gmts")
    if g:
        c = g["entropy_vs_exact_grad_norm"]
        print(f"Spearman(entropy, exact grad norm): within answers {fmt(c['within_answer_mean'])} "
              f"(mean of {c['within_answers_used']} answers), across answers {fmt(c['across_answers'])}")
        print(f"Jaccard(entropy top-20%, GMTS top-20%): {fmt(g['jaccard_entropy_top_vs_gmts_top'])}")
    else:
        print(f"GMTS statistics omitted: {report['gmts_omitted_reason']}")
    return 0
