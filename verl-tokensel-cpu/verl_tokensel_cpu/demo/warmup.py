"""Supervised warm-up of the demo's tiny model, offline on CPU, cached by its settings.

The tiny Qwen2 and tokenizer come from :func:`verl_tokensel_cpu.tiny_model.build_tiny_model_dir`
(random init, local BPE). Plain next-token loss on the response tokens of templated traces
(:mod:`.task`) for the training problems, each trace's route drawn afresh per step (``think`` with
probability ``q``, :func:`.task.warmup_route`) and its value written accordingly (correct after ``think``,
a near miss after ``guess``, :func:`.task.warmup_value`). After it the model copies the template almost
surely (entropy << 0.01 nats) and is spread at the route, where it is partly right: RL has something to
sharpen, and the forking tokens are real.

Simplifications: no validation split during training, a fixed step count, one constant-then-cosine
learning-rate schedule; accuracy is measured once at the end by sampling (temperature 1) one answer
per training problem and scoring it with the demo's reward.

The multi-decision task (:mod:`.task_multi`) warms up the same way from a :class:`MultiWarmupConfig`: each
trace asks K training problems and draws each step's route independently, so the model is spread at K route
words per answer.

Cache: ``<cache_dir>/warm-<key>`` where ``key`` hashes every :class:`WarmupConfig` field and
:data:`WARMUP_VERSION` (``<cache_dir>/warm-multi-<key>`` for a :class:`MultiWarmupConfig`, whose key also
holds the task and :data:`MULTI_WARMUP_VERSION`); a complete folder is reused as is (``warmup.json`` holds the
measured accuracy). Use::

    from verl_tokensel_cpu.demo.warmup import WarmupConfig, warm_model_dir
    path, info = warm_model_dir(WarmupConfig(), cache_dir="~/.cache/verl_tokensel")
    info["accuracy"]   # share of correct sampled answers at temperature 1
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

#: bump when the warm-up's code changes what it produces (invalidates caches)
WARMUP_VERSION = 2
_INFO = "warmup.json"


@dataclass(frozen=True)
class WarmupConfig:
    """Settings of the supervised warm-up (all of them key the cache)."""

    #: probability that a warm-up trace takes the ``think`` route (correct value; else ``guess``, a near miss);
    #: the warmed model's accuracy at temperature 1 is about this times the share of problems it learned
    q: float = 0.5
    #: optimizer steps
    steps: int = 1000
    #: traces per step
    batch_size: int = 32
    #: peak AdamW learning rate (cosine-decayed to a tenth over the second half)
    lr: float = 3e-3
    #: seed of the model init, the label noise and the batches
    seed: int = 0
    #: validation problems held out of the warm-up (the demo's data split uses the same count)
    n_val: int = 32

    def __post_init__(self):
        if not 0 < self.q <= 1:
            raise ValueError(f"WarmupConfig.q={self.q}: must be in (0, 1]")
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"WarmupConfig: steps, batch_size and lr must be > 0, got {self}")

    def key(self) -> str:
        blob = json.dumps({"version": WARMUP_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


#: bump when the multi-decision warm-up's code changes what it produces (invalidates its caches only)
MULTI_WARMUP_VERSION = 1


@dataclass(frozen=True)
class MultiWarmupConfig:
    """Settings of the multi-decision task's warm-up (all of them, the task and :data:`MULTI_WARMUP_VERSION` key
    the cache). Calibration: ``benchmarks/results/bench_learning_multi_cpu.md``."""

    #: per step, the probability that the trace takes the ``think`` route (correct value; else ``guess``, a near
    #: miss): about ``q ** k`` of the warmed model's answers take ``think`` at every step
    q: float = 0.8
    #: decisions (problems, each with its own route word) per answer
    k: int = 4
    #: optimizer steps
    steps: int = 1500
    #: traces per step
    batch_size: int = 32
    #: peak AdamW learning rate (cosine-decayed to a tenth over the second half)
    lr: float = 3e-3
    #: seed of the model init, the label noise and the batches
    seed: int = 0
    #: validation problems held out (the task's data split uses the same count)
    n_val: int = 32

    def __post_init__(self):
        if not 0 < self.q <= 1:
            raise ValueError(f"MultiWarmupConfig.q={self.q}: must be in (0, 1]")
        if not 1 <= self.k <= 8:
            raise ValueError(f"MultiWarmupConfig.k={self.k}: must be in 1..8 (the answer must fit the demo's "
                             "response length)")
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"MultiWarmupConfig: steps, batch_size and lr must be > 0, got {self}")

    def key(self) -> str:
        blob = json.dumps({"task": "multi", "version": MULTI_WARMUP_VERSION, **dataclasses.asdict(self)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_name(cfg) -> str:
    """The cache folder's name of a warm-up config: ``warm-<key>``, ``warm-multi-<key>`` for the multi task."""
    return f"warm-multi-{cfg.key()}" if isinstance(cfg, MultiWarmupConfig) else f"warm-{cfg.key()}"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/verl_tokensel`` (``~/.cache/verl_tokensel``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verl_tokensel"


def train_problems(cfg: WarmupConfig) -> list[tuple[str, str]]:
    """The demo's training problems (the same split as :func:`.dataset.write_dataset`)."""
    from verl_tokensel_cpu.demo.dataset import split_problems

    return split_problems(n_val=cfg.n_val, seed=cfg.seed)[0]


def _encode_text(tokenizer, message: str, response: str) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                           tokenize=False)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p, r


def _encode(tokenizer, question: str, value, route: str) -> tuple[list[int], list[int]]:
    from verl_tokensel_cpu.demo.dataset import prompt_text
    from verl_tokensel_cpu.demo.task import trace

    return _encode_text(tokenizer, prompt_text(question), trace(question, value, route))


def _multi_rows(tokenizer, problems, cfg: MultiWarmupConfig, rng: random.Random) -> list:
    from verl_tokensel_cpu.demo import dataset_multi, task_multi

    rows = []
    for _ in range(cfg.batch_size):
        questions, values, routes = task_multi.warmup_example(problems, cfg.k, cfg.q, rng)
        rows.append(_encode_text(tokenizer, dataset_multi.prompt_text(questions),
                                 task_multi.trace(questions, values, routes)))
    return rows


def _batch(tokenizer, problems, cfg: WarmupConfig, rng: random.Random, cache: dict):
    import torch

    from verl_tokensel_cpu.demo.task import warmup_route, warmup_value

    if isinstance(cfg, MultiWarmupConfig):
        rows = _multi_rows(tokenizer, problems, cfg, rng)
    else:
        rows = []
        for question, answer in (rng.choice(problems) for _ in range(cfg.batch_size)):
            route = warmup_route(cfg.q, rng)
            value = warmup_value(int(answer), route, rng)
            if (question, value, route) not in cache:
                cache[(question, value, route)] = _encode(tokenizer, question, value, route)
            rows.append(cache[(question, value, route)])
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        labels[i, len(p):n] = torch.tensor(r)
        attn[i, :n] = 1
    return ids, labels, attn


def sft(model, tokenizer, cfg: WarmupConfig, progress: Optional[Callable[[str], None]] = None) -> list[float]:
    """Train ``model`` in place with next-token loss on the task's traces; returns the loss per step."""
    import math

    import torch

    problems = train_problems(cfg)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    half = cfg.steps // 2

    def lr_at(step: int) -> float:  # constant, then cosine to lr/10 over the second half
        if step < half:
            return cfg.lr
        t = (step - half) / max(1, cfg.steps - half)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    losses, cache, t0 = [], {}, time.monotonic()
    for step in range(cfg.steps):
        _sft_step(model, opt, tokenizer, problems, cfg, rng, cache, lr_at(step), losses)
        if progress is not None and (step + 1) % 50 == 0:
            progress(f"warm-up step {step + 1}/{cfg.steps}, loss {sum(losses[-50:]) / 50:.3f} "
                     f"({time.monotonic() - t0:.0f} s)")
    model.eval()
    return losses


def _sft_step(model, opt, tokenizer, problems, cfg, rng, cache, lr, losses) -> None:
    import torch

    for group in opt.param_groups:
        group["lr"] = lr
    ids, labels, attn = _batch(tokenizer, problems, cfg, rng, cache)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())


def sample_texts(model, tokenizer, messages: list[str], *, seed: int = 0, max_new_tokens: int = 48,
                 batch_size: int = 32) -> list[str]:
    """One answer per user message at temperature 1 (HF ``generate``, batches of ``batch_size``, seeded)."""
    import torch

    tokenizer.padding_side = "left"
    texts = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for lo in range(0, len(messages), batch_size):
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                     tokenize=False) for m in messages[lo:lo + batch_size]]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    tokenizer.padding_side = "right"
    return texts


def sample_stats(model, tokenizer, problems, *, seed: int = 0, max_new_tokens: int = 48,
                 batch_size: int = 32) -> dict:
    """One sample per problem at temperature 1: ``accuracy`` (the demo's reward), ``think_share`` (share of
    answers on the ``think`` route) and ``think_accuracy`` (accuracy of those; None when there is none)."""
    from verl_tokensel_cpu.demo.dataset import DATA_SOURCE, prompt_text
    from verl_tokensel_cpu.demo.reward import compute_score
    from verl_tokensel_cpu.demo.task import route_of

    right = think = think_right = 0
    texts = sample_texts(model, tokenizer, [prompt_text(q) for q, _ in problems], seed=seed,
                         max_new_tokens=max_new_tokens, batch_size=batch_size)
    for t, (_, a) in zip(texts, problems):
        ok = compute_score(DATA_SOURCE, t, a)
        right += ok
        if route_of(t) == "think":
            think += 1
            think_right += ok
    n = len(problems)
    return {"accuracy": right / n, "think_share": think / n, "think_accuracy": think_right / think if think else None}


#: the multi task's prompts the warm-up's accuracy is measured on (the first of the dataset's training prompts)
MULTI_STATS_PROMPTS = 256


def multi_prompts(cfg: MultiWarmupConfig, n: Optional[int] = None) -> list[tuple[list[str], str]]:
    """The first ``n`` (default :data:`MULTI_STATS_PROMPTS`) training prompts of the multi task's dataset for
    ``cfg`` (``(questions, ground truth)``)."""
    from verl_tokensel_cpu.demo.dataset_multi import split_prompts

    return split_prompts(cfg.k, n_val=cfg.n_val, seed=cfg.seed)[0][:MULTI_STATS_PROMPTS if n is None else n]


def sample_stats_multi(model, tokenizer, prompts, *, seed: int = 0, max_new_tokens: int = 96,
                       batch_size: int = 32) -> dict:
    """One sample per multi-task prompt at temperature 1: ``accuracy`` (the task's reward), ``think_share`` (share
    of the steps on the ``think`` route), ``all_think_share`` (share of answers on ``think`` at every step),
    ``think_accuracy`` (accuracy of those; None when there is none) and ``on_template_share``."""
    from verl_tokensel_cpu.demo.dataset_multi import DATA_SOURCE, prompt_text
    from verl_tokensel_cpu.demo.reward_multi import compute_score
    from verl_tokensel_cpu.demo.task_multi import route_of, think_counts

    texts = sample_texts(model, tokenizer, [prompt_text(q) for q, _ in prompts], seed=seed,
                         max_new_tokens=max_new_tokens, batch_size=batch_size)
    right = think_steps = steps = all_think = all_think_right = on_template = 0
    for t, (_, truth) in zip(texts, prompts):
        ok = compute_score(DATA_SOURCE, t, truth)
        right += ok
        th, n_steps = think_counts(t)
        think_steps, steps, on_template = think_steps + th, steps + n_steps, on_template + (n_steps > 0)
        if route_of(t) == "think":
            all_think += 1
            all_think_right += ok
    n = len(prompts)
    return {"accuracy": right / n, "think_share": think_steps / steps if steps else None,
            "all_think_share": all_think / n, "think_accuracy": all_think_right / all_think if all_think else None,
            "on_template_share": on_template / n}


def sample_accuracy(model, tokenizer, problems, **kwargs) -> float:
    """Share of ``problems`` answered right by one sample each at temperature 1 (the demo's reward)."""
    return sample_stats(model, tokenizer, problems, **kwargs)["accuracy"]


def _is_complete(path: Path) -> bool:
    return (path / _INFO).is_file() and (path / "config.json").is_file()


def warm_model_dir(cfg: WarmupConfig = WarmupConfig(), cache_dir: str | os.PathLike | None = None,
                   progress: Optional[Callable[[str], None]] = None) -> tuple[str, dict]:
    """The warmed model's folder (built once per ``cfg``) and its ``warmup.json`` record.

    Built in a temporary sibling folder and renamed into place, so an interrupted build never
    leaves a half-written cache entry.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = root / cache_name(cfg)
    if _is_complete(path):
        return str(path), json.loads((path / _INFO).read_text())
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".build-", dir=str(root)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and far faster on a busy machine
    try:
        t0 = time.monotonic()
        build_tiny_model_dir(tmp / "init", seed=cfg.seed)
        tokenizer = AutoTokenizer.from_pretrained(str(tmp / "init"))
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(str(tmp / "init"), torch_dtype=torch.float32)
        losses = sft(model, tokenizer, cfg, progress)
        sft_s = time.monotonic() - t0
        if isinstance(cfg, MultiWarmupConfig):
            measured = multi_prompts(cfg)
            stats = sample_stats_multi(model, tokenizer, measured, seed=cfg.seed)
        else:
            measured = train_problems(cfg)
            stats = sample_stats(model, tokenizer, measured, seed=cfg.seed)
        out = tmp / "model"
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        info = {"config": dataclasses.asdict(cfg), **stats,
                "final_loss": sum(losses[-50:]) / min(50, len(losses)), "sft_seconds": round(sft_s, 1),
                "problems": len(measured)}
        if isinstance(cfg, MultiWarmupConfig):
            info = {"task": "multi", "version": MULTI_WARMUP_VERSION, **info}
        else:
            info = {"config": info.pop("config"), "version": WARMUP_VERSION, **info}
        (out / _INFO).write_text(json.dumps(info, indent=1))
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
        os.replace(out, path)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path), info
