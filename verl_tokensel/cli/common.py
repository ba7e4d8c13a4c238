"""What the analysis subcommands (``analyze``, ``compare``, ``view``) share: scorer options, argument checks,
the error line and the scoring progress bar."""

from __future__ import annotations

import sys
from pathlib import Path


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


def error(msg: str) -> int:
    """Print ``error: msg`` on stderr; the exit code of a usage or input error (2)."""
    print(f"error: {msg}", file=sys.stderr)
    return 2


def check_common_args(args) -> None:
    """Refuse bad scorer options or an ``--out`` that is a file (:class:`AnalysisInputError`)."""
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


def fmt(v, digits: int = 4) -> str:
    """A number for a one-line summary (``n/a`` for None or NaN)."""
    return "n/a" if v is None or v != v else f"{v:.{digits}g}"
