"""The multi-decision task's dataset in verl's RL parquet format (no download).

Each prompt asks K distinct problems of the two-route task's problem space (:func:`.dataset.all_problems`):
training prompts draw them from its training problems, validation prompts from its validation problems (the
same split, :func:`.dataset.split_problems`), so no validation problem is ever trained on. One row per prompt::

    data_source   "tokensel_demo_multi"
    prompt        [{"role": "user",
                    "content": "What are 3 + 4, 5 * 2, 7 - 1 and 9 * 9? Put the final answers in \\boxed{}."}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "7,10,6,81"}
    extra_info    {"split": "train", "index": 0, "questions": ["3 + 4", "5 * 2", "7 - 1", "9 * 9"]}

Use::

    from verl_tokensel_cpu.demo.dataset_multi import write_dataset
    train_path, val_path = write_dataset("/tmp/demo_data", k=4)
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Sequence

from verl_tokensel_cpu.demo.dataset import split_problems
from verl_tokensel_cpu.demo.task_multi import ground_truth

DATA_SOURCE = "tokensel_demo_multi"
INSTRUCTION = "Put the final answers in \\boxed{}."
#: training prompts written (K-tuples of training problems); the runs' step counts never use them all
N_TRAIN = 512


def prompt_text(questions: Sequence[str]) -> str:
    """The user message (``"What are 3 + 4, 5 * 2 and 7 - 1? Put the final answers in \\boxed{}."``)."""
    if len(questions) == 1:
        return f"What is {questions[0]}? {INSTRUCTION}"
    return f"What are {', '.join(questions[:-1])} and {questions[-1]}? {INSTRUCTION}"


def draw_prompts(problems: Sequence[tuple[str, str]], k: int, n: int, seed: int) -> list[tuple[list[str], str]]:
    """``n`` distinct prompts of ``k`` distinct problems each: ``(questions, ground truth)``."""
    if not 0 < k <= len(problems):
        raise ValueError(f"k={k}: must be in 1..{len(problems)} (the problems available)")
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(100 * n):
        if len(out) == n:
            break
        picked = tuple(rng.sample(list(problems), k))
        if picked in seen:
            continue
        seen.add(picked)
        out.append(([q for q, _ in picked], ground_truth([a for _, a in picked])))
    return out


def split_prompts(k: int, n_train: int = N_TRAIN, n_val: int = 32,
                  seed: int = 0) -> tuple[list[tuple[list[str], str]], list[tuple[list[str], str]]]:
    """``(train, val)`` prompts: ``n_train`` from the training problems, ``n_val`` from the ``n_val`` validation
    problems of :func:`.dataset.split_problems` (same ``n_val`` and ``seed``)."""
    train_problems, val_problems = split_problems(n_val, seed)
    return (draw_prompts(train_problems, k, n_train, seed),
            draw_prompts(val_problems, k, n_val, seed + 1))


def make_rows(prompts: Sequence[tuple[Sequence[str], str]], split: str) -> list[dict]:
    """verl RL rows for ``prompts`` (see the module docstring for the schema)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(questions)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": i, "questions": list(questions)},
        }
        for i, (questions, truth) in enumerate(prompts)
    ]


def write_dataset(out_dir: str | os.PathLike, k: int, n_train: int = N_TRAIN, n_val: int = 32,
                  seed: int = 0) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` into ``out_dir``; returns their paths (rewritten every call)."""
    import pandas as pd

    train, val = split_prompts(k, n_train, n_val, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, part in (("train", train), ("val", val)):
        path = out / f"{split}.parquet"
        pd.DataFrame(make_rows(part, split)).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]
