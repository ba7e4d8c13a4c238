"""``verl-tokensel view``: scored responses as one self-contained HTML page, every response token shaded by a
score and the tokens a preset would train on marked.

The responses are scored with the model (entropy, log-prob, exact logit-gradient norm per token, chunked over
the vocabulary) and the preset's selection is applied with the selector the loss uses, on-policy (ratio r = 1,
nothing clipped). The pool: a preset whose scope is ``sequence`` keeps ceil(ratio * n) per response; every
other preset (whatever its training scope) is shown with all rendered responses as one pool, as if one
micro-batch; ``--scope`` / ``--ratio`` override. Advantages: the data's ``advantage`` column, else GRPO from
``reward`` / ``score`` per prompt group as verl computes it, else A = 1 (the page says which). The ``random``
score uses the loss's seeded draw, keyed by the prompt + response ids. Inputs and page: ``docs/analysis.md``.

Examples::

    verl-tokensel view --model ./Qwen3-8B --data rollouts/12.jsonl --out step12.html   # local HF folder
    verl-tokensel view --model ./ckpt --data rollouts/ --out gmts.html --preset gmts --shade entropy \\
        --max-responses 32 --device cuda --dtype bfloat16
    verl-tokensel view --model ./ckpt --data answers.parquet --out seq.html --scope sequence --shade logp
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

HELP = "HTML page of responses: tokens shaded by a score, the preset's selected tokens marked"

def shade_choices() -> list[str]:
    from verl_tokensel.core.ranking.scores import SCORE_REGISTRY

    return ["logp"] + list(SCORE_REGISTRY)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (its tokenizer is used too)")
    parser.add_argument("--data", required=True,
                        help="rollout dump directory / <step>.jsonl, or a .jsonl/.parquet with prompt and response")
    parser.add_argument("--out", required=True, help="HTML file to write")
    parser.add_argument("--preset", default="forking", help="token_selector preset whose selection is marked "
                        "(default forking; 'none' marks nothing)")
    parser.add_argument("--shade", default=None,
                        help="per-token value for the background: logp or a score (entropy, gmts, grad_norm, random); "
                        "default: the preset's score, entropy for 'none'")
    parser.add_argument("--scope", default=None, choices=["micro_batch", "sequence"],
                        help="selection pool: all rendered responses (micro_batch) or each response (sequence); "
                        "default: the preset's")
    parser.add_argument("--ratio", type=float, default=None, help="override the preset's ratio, in (0, 1]")
    parser.add_argument("--max-responses", type=int, default=None, help="render only the first N responses")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (default 1.0)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (bfloat16 only on cuda)")


def run(args) -> int:
    from verl_tokensel.cli.common import error, score_with_progress
    from verl_tokensel.core.resolve.presets import selection_for, selectors

    if args.preset not in selectors():
        return error(f"--preset {args.preset!r} is unknown; valid: {', '.join(selectors())}")
    sel = selection_for(args.preset)
    shades = shade_choices()
    shade = args.shade if args.shade is not None else (sel.score if sel is not None and sel.score in shades
                                                       else "entropy")
    if shade not in shades:
        return error(f"--shade {shade!r} is unknown; valid: {', '.join(shades)}")
    if args.ratio is not None and not (0 < args.ratio <= 1):
        return error(f"--ratio {args.ratio!r} is invalid; valid: a number in (0, 1]")
    if sel is None and (args.ratio is not None or args.scope is not None):
        return error("--ratio/--scope set with --preset none, which selects nothing; pick a selector preset")
    if args.max_responses is not None and args.max_responses < 1:
        return error(f"--max-responses {args.max_responses} is invalid; valid: an integer >= 1")
    if not (args.temperature > 0):
        return error(f"--temperature {args.temperature!r} is invalid; valid: a number > 0")
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        return error(f"--model {model_dir}: no such directory")
    if not (model_dir / "config.json").is_file():
        return error(f"--model {model_dir}: not a HF model directory (no config.json)")
    data = Path(args.data)
    if not data.exists():
        return error(f"--data {data}: no such file or directory")
    out = Path(args.out)
    if out.exists() and out.is_dir():
        return error(f"--out {out} is a directory; give an .html file path")

    from verl_tokensel.analysis import io
    from verl_tokensel.analysis.page import build_page
    from verl_tokensel.analysis.stats import advantages_or_unit

    try:
        records = io.load_records(data)
    except io.AnalysisInputError as e:
        return error(f"--data {e}")
    if not records:
        return error(f"--data {data}: holds no responses")
    n_total = len(records)
    records = records[: args.max_responses] if args.max_responses else records
    try:
        tokenizer = io.load_tokenizer(model_dir)
        io.check_vocab(tokenizer, model_dir, model_dir)
        pairs = io.tokenize_records(tokenizer, records)
    except io.AnalysisInputError as e:
        return error(str(e))

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = io.load_model(model_dir, device=device, dtype=args.dtype)
    except io.AnalysisInputError as e:
        return error(str(e))
    advantages, adv_source = advantages_or_unit(records)

    scored = score_with_progress(model, pairs, desc="scoring", temperature=args.temperature, device=device)

    page = build_page(args, records, pairs, scored, advantages, adv_source, tokenizer, sel, shade, n_total)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed over --out; created with the mode open() gives a new file (0666 less the umask:
    # 0644 usually), not mkstemp's 0600
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    n_tok = sum(len(s.token_ids) for s in scored)
    print(f"wrote {out} ({len(records)} responses, {n_tok} response tokens)")
    return 0
