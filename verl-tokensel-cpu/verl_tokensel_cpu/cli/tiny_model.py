"""Build the embedded tiny model: a random-init Qwen2 and a byte-level BPE tokenizer, locally.

No download: the tokenizer is trained on a small synthetic math corpus and the model is initialised
from a seed. Useful to try ``analyze``, ``compare``, ``view`` and ``cpu-step`` anywhere.

Examples::

    verl-tokensel tiny-model --out /tmp/tiny
    verl-tokensel tiny-model --out /tmp/tiny_seed1 --seed 1    # a second, different model (compare)
"""

from __future__ import annotations

HELP = "build the embedded tiny model (random Qwen2 + local tokenizer, no download)"


def add_arguments(parser) -> None:
    parser.add_argument("--out", required=True, help="directory to write the model into (reused if complete)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")


def run(args) -> int:
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    print(build_tiny_model_dir(args.out, seed=args.seed))
    return 0
