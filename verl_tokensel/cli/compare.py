"""Compare the per-token entropies of two models (e.g. base vs RL-trained) on the same responses.

Both models score the same tokenised responses (they must share the tokenizer). Writes
``report.json``, ``report.md`` and one PNG into ``--out``: the share of A's top-20% entropy positions
that are also in B's top 20% (the paper's "RL training keeps > 86% of the base model's forking
positions"), the Jaccard overlap of the two sets, and how entropy moved (``H_B - H_A``: mean, median,
share increased) for A's top-20% tokens vs the rest.

``--data`` takes the same inputs as ``verl-tokensel analyze`` (rollout dump directory or file,
``.parquet`` / ``.jsonl`` with ``prompt`` and ``response``).

Examples::

    # two tiny random models (seeds 0 and 1) built locally, no download
    verl-tokensel tiny-model --out /tmp/tiny && verl-tokensel tiny-model --out /tmp/tiny1 --seed 1
    verl-tokensel compare --model-a /tmp/tiny --model-b /tmp/tiny1 --data /path/to/rollout_data_dir --out /tmp/cmp

    # base vs RL checkpoint (HF format) on a GPU
    verl-tokensel compare --model-a Qwen3-8B-Base/ --model-b ckpt/global_step_200/hf/ \\
        --data rollouts/ --out cmp/ --device cuda --dtype bfloat16 --max-responses 1000
"""

from __future__ import annotations

import time

HELP = "compare per-token entropies of two models on the same responses (top-20%% overlap, entropy change)"


def add_arguments(parser) -> None:
    parser.add_argument("--model-a", required=True, help="model A (e.g. the base model), local HF directory")
    parser.add_argument("--model-b", required=True, help="model B (e.g. the RL-trained model), local HF directory")
    parser.add_argument("--data", required=True, help="rollout dump dir, dump .jsonl, or .parquet/.jsonl table")
    parser.add_argument("--out", required=True, help="output directory for report.json, report.md, the PNG")
    from verl_tokensel.cli.common import add_scoring_arguments

    add_scoring_arguments(parser)


def run(args) -> int:
    import torch

    from verl_tokensel.analysis import io
    from verl_tokensel.analysis.report import require_matplotlib, write_comparison
    from verl_tokensel.analysis.stats import compare_entropies, pooled_entropy, top_mask
    from verl_tokensel.cli.common import check_common_args, error, fmt, score_with_progress

    t0 = time.time()
    try:
        check_common_args(args)
        require_matplotlib()
        records = io.load_records(args.data)
        if args.max_responses is not None:
            records = records[: args.max_responses]
        tok_a = io.load_tokenizer(args.model_a)
        tok_b = io.load_tokenizer(args.model_b)
        if not io.same_tokenizer(tok_a, tok_b):
            raise io.AnalysisInputError(
                f"the two models do not share a tokenizer: {args.model_a} ({len(tok_a)} tokens) vs "
                f"{args.model_b} ({len(tok_b)} tokens); token positions would not be comparable"
            )
        io.check_vocab(tok_a, args.model_a, args.model_a)
        io.check_vocab(tok_b, args.model_b, args.model_b)
        pairs = io.tokenize_records(tok_a, records)
    except (io.AnalysisInputError, RuntimeError) as e:
        return error(str(e))

    scores = {}
    for name, path in (("A", args.model_a), ("B", args.model_b)):
        try:
            model = io.load_model(path, device=args.device, dtype=args.dtype)
        except io.AnalysisInputError as e:
            return error(str(e))
        try:
            scores[name] = score_with_progress(model, pairs, desc=f"model {name}", temperature=args.temperature,
                                               device=args.device, chunk_size=args.chunk_size)
        except ValueError as e:
            return error(f"{args.data} under {path}: {e}")
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()

    report = compare_entropies(scores["A"], scores["B"])
    report = {"model_a": str(args.model_a), "model_b": str(args.model_b), "data": str(args.data),
              "temperature": args.temperature, **report}
    h_a, h_b = pooled_entropy(scores["A"]), pooled_entropy(scores["B"])
    path = write_comparison(args.out, report, h_a, h_b, top_mask(h_a))

    o, d = report["overlap"], report["entropy_change"]
    print(f"report: {path}")
    print(f"responses {report['responses']}, tokens {report['token_count']}, {time.time() - t0:.1f}s")
    print(f"share of A's top-20% positions also in B's top-20%: {fmt(o['share_of_a_top_in_b_top'])} "
          f"(Jaccard {fmt(o['jaccard'])})")
    for key, name in (("a_top", "A's top-20%"), ("rest", "the rest")):
        g = d[key]
        print(f"H_B - H_A on {name}: mean {fmt(g['mean'])}, median {fmt(g['median'])}, "
              f"share increased {fmt(g['share_increased'])}")
    return 0
