"""The demo's tasks by name (``verl-tokensel demo --task``): what differs between them, in one registry.

* ``route`` (the default): one route word per answer decides it (:mod:`.task`, :mod:`.dataset`, :mod:`.reward`);
* ``multi``: K steps per answer, each with its own route word, all of which must be right (:mod:`.task_multi`,
  :mod:`.dataset_multi`, :mod:`.reward_multi`).

A task names its warm-up config, its dataset writer, its reward function (verl's
``reward.custom_reward_function.path``), the response length its answers need, its GRPO defaults, and how to
find its decisions in a response (:meth:`DemoTask.decision_mask`, :meth:`DemoTask.think_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class DemoTask:
    name: str
    #: one line for ``--help`` and the reports
    summary: str
    #: verl's reward.custom_reward_function.path
    reward_fn: str
    max_prompt_length: int
    max_response_length: int
    #: prompts per GRPO step (8 answers each) and per PPO mini-batch (two updates per step)
    train_batch_size: int
    ppo_mini_batch_size: int
    #: the demo's default GRPO steps and actor learning rate on this task
    default_steps: int
    default_lr: float
    #: seed -> the warm-up config (:mod:`.warmup`)
    warmup_config: Callable[[int], object]
    #: (out_dir, warm-up config) -> (train.parquet, val.parquet), the warm-up's data split
    write_dataset: Callable[[object, object], tuple[str, str]]
    #: (token texts, response, routes_only, forks_only) -> per-token bool: is it on a decision (a route word, the
    #: token where a route is chosen)?
    _decision_mask: Callable[..., list[bool]]
    #: response -> (steps on the think route, steps)
    think_counts: Callable[[str], tuple[int, int]]

    def decision_mask(self, token_texts: Sequence[str], response: str, *, routes_only: bool = False,
                      forks_only: bool = False) -> list[bool]:
        return self._decision_mask(token_texts, response, routes_only=routes_only, forks_only=forks_only)


def _route_task() -> DemoTask:
    from verl_tokensel_cpu.demo import dataset, task
    from verl_tokensel_cpu.demo.warmup import WarmupConfig

    from verl_tokensel_cpu.demo.task_multi import spans_token_mask

    def mask(token_texts, response, routes_only=False, forks_only=False):
        if not (routes_only or forks_only):
            return task.decision_token_mask(token_texts, response)
        # the route word's span comes first in decision_spans when the response has one; its fork is the space before
        spans = task.decision_spans(response)[:1] if task.route_of(response) else []
        if forks_only:
            spans = [(a - 1, a) for a, _ in spans]
        return spans_token_mask(token_texts, spans)

    def think_counts(response):
        route = task.route_of(response)
        return int(route == "think"), int(route is not None)

    # Actor learning rate: on the single-decision warm start of WARMUP_VERSION 1 the reward fell at 1e-3 (0.29 -> 0.12
    # in 12 forking steps) and rose at 1e-4..3e-4; on the two-route task, 3e-4 raises it by 0.11-0.15 in 12 steps
    # (benchmarks/results/bench_learning_cpu.md).
    return DemoTask(
        name="route", summary="one route word per answer (think: the right value; guess: a near miss)",
        reward_fn="pkg://verl_tokensel_cpu.demo.reward", max_prompt_length=64, max_response_length=48,
        train_batch_size=16, ppo_mini_batch_size=8, default_steps=12, default_lr=3e-4,
        warmup_config=lambda seed: WarmupConfig(seed=seed),
        write_dataset=lambda out, cfg: dataset.write_dataset(out, n_val=cfg.n_val, seed=cfg.seed),
        _decision_mask=mask, think_counts=think_counts)


# Multi task: 8 prompts x 8 answers per step and 8 steps keep one run near 4 min on 2 cores (its answers are ~70
# tokens); the warm start's reward 0.40 rose to 0.83 within 9 steps of 16 prompts with none at 3e-4
# (benchmarks/results/bench_learning_multi_cpu.md).
def _multi_task() -> DemoTask:
    from verl_tokensel_cpu.demo import dataset_multi, task_multi
    from verl_tokensel_cpu.demo.warmup import MultiWarmupConfig

    return DemoTask(
        name="multi", summary="K steps per answer, each with its own route word; every step must be right",
        reward_fn="pkg://verl_tokensel_cpu.demo.reward_multi", max_prompt_length=80, max_response_length=96,
        train_batch_size=8, ppo_mini_batch_size=4, default_steps=8, default_lr=3e-4,
        warmup_config=lambda seed: MultiWarmupConfig(seed=seed),
        write_dataset=lambda out, cfg: dataset_multi.write_dataset(out, k=cfg.k, n_val=cfg.n_val, seed=cfg.seed),
        _decision_mask=task_multi.decision_token_mask, think_counts=task_multi.think_counts)


_BUILDERS = {"route": _route_task, "multi": _multi_task}
#: the task names, the default first
TASK_NAMES = tuple(_BUILDERS)
DEFAULT_TASK = "route"


def get_task(name: str) -> DemoTask:
    """The task called ``name``; a ValueError naming the valid ones otherwise."""
    if name not in _BUILDERS:
        raise ValueError(f"task={name!r} is not a demo task; valid: {', '.join(TASK_NAMES)}. Fix: pass one of them "
                         "(verl-tokensel demo --task multi).")
    return _BUILDERS[name]()
