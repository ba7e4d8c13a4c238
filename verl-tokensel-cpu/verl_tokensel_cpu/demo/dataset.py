"""A synthetic, verifiable arithmetic dataset in verl's RL parquet format (no download).

Every problem is ``a op b`` with single-digit operands (``+``, ``-`` with a non-negative result,
``*``), so answers are short integers (0-81) that a tiny model can emit and
:mod:`verl_tokensel_cpu.demo.reward` can check. The problem space (255 problems) is enumerated, shuffled
with a seed and split, so train and val never share a problem and every build is identical.

One row per problem, the columns verl's ``RLHFDataset`` and reward managers read::

    data_source   "tokensel_demo_arith"
    prompt        [{"role": "user", "content": "What is 3 + 4? Put the final answer in \\boxed{}."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "7"}
    extra_info    {"split": "train", "index": 0, "question": "3 + 4"}

Use::

    from verl_tokensel_cpu.demo.dataset import write_dataset
    train_path, val_path = write_dataset("/tmp/demo_data")
"""

from __future__ import annotations

import os
import random
from pathlib import Path

DATA_SOURCE = "tokensel_demo_arith"
INSTRUCTION = "Put the final answer in \\boxed{}."


def all_problems() -> list[tuple[str, str]]:
    """Every ``(question, answer)`` pair of the problem space, in a fixed order (255 problems)."""
    problems = []
    for a in range(10):
        for b in range(10):
            problems.append((f"{a} + {b}", str(a + b)))
            if a >= b:
                problems.append((f"{a} - {b}", str(a - b)))
            problems.append((f"{a} * {b}", str(a * b)))
    return problems


def prompt_text(question: str) -> str:
    """The user message of ``question`` (``"What is 3 + 4? Put the final answer in \\boxed{}."``)."""
    return f"What is {question}? {INSTRUCTION}"


def split_problems(n_val: int = 32, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, val)`` problems: the problem space shuffled with ``seed``, the first ``n_val`` for val."""
    problems = all_problems()
    if not 0 < n_val < len(problems):
        raise ValueError(f"n_val={n_val}: must be in 1..{len(problems) - 1} (the problem space has "
                         f"{len(problems)} problems)")
    random.Random(seed).shuffle(problems)
    return problems[n_val:], problems[:n_val]


def make_rows(problems: list[tuple[str, str]], split: str) -> list[dict]:
    """verl RL rows for ``problems`` (see the module docstring for the schema)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(question)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i, "question": question},
        }
        for i, (question, answer) in enumerate(problems)
    ]


def write_dataset(out_dir: str | os.PathLike, n_val: int = 32, seed: int = 0) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` into ``out_dir``; returns their paths.

    The shuffled problem space is split into ``n_val`` validation problems and the rest for training
    (223 with the default). Rewritten on every call (~10 ms).
    """
    import pandas as pd

    train, val = split_problems(n_val, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, part in (("train", train), ("val", val)):
        path = out / f"{split}.parquet"
        pd.DataFrame(make_rows(part, split)).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]
