"""Tiny, download-free model assets for CPU tests (helper module, not a test file).

* :func:`build_tiny_tokenizer` trains a byte-level BPE (a few hundred tokens) with the ``tokenizers``
  trainer on a synthetic arithmetic corpus and saves it so that ``AutoTokenizer.from_pretrained(folder)``
  round-trips text. transformers 5.x loads a ``model_type=qwen2`` folder as ``Qwen2Tokenizer`` (a
  byte-level BPE that rebuilds its own pre-tokenizer from vocab + merges), so the tokenizer must be a real
  byte-level BPE: a WordLevel ``tokenizer.json`` would be ignored and words silently dropped.
* :func:`build_tiny_model_dir` writes that tokenizer plus a random-init Qwen2 (hidden 64, 2 layers,
  head_dim 32, fp32, eager attention, vocab = tokenizer size) with ``save_pretrained``. Cached by path:
  a complete folder is reused as is.

Everything is deterministic (fixed corpus, fixed seed) and takes ~1 s.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 384

# Minimal ChatML template (the format verl's RL datasets feed through apply_chat_template).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_sliding_window=False,
)

#: the Megatron test bed's variant: two key/value heads, so tensor parallelism of 2 divides them
MEGATRON_TINY_CONFIG = dict(num_key_value_heads=2)

_COMPLETE_MARKER = ".tiny_assets_complete"


def math_corpus(n_lines: int = 2000, seed: int = 0) -> list[str]:
    """A small synthetic arithmetic corpus (questions, answers, a little prose)."""
    rng = random.Random(seed)
    words = [
        "What", "is", "Compute", "the", "sum", "of", "and", "plus", "minus", "times", "answer",
        "Let", "think", "step", "by", "So", "result", "equals", "Therefore", "boxed", "Question",
        "Answer", "first", "then", "number", "product", "difference", "total",
    ]
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, sym, val = rng.choice([("plus", "+", a + b), ("minus", "-", a - b), ("times", "*", a * b)])
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(f"Question: What is {a} {op} {b}? Answer: {a} {sym} {b} = {val}. "
                         f"The answer is \\boxed{{{val}}}.")
        elif kind == 1:
            lines.append(f"Compute {a} {sym} {b}. Let's think step by step. {a} {sym} {b} = {val}. "
                         f"So the result is {val}.")
        elif kind == 2:
            lines.append(f"#### {val}\n{a}{sym}{b}={val}")
        else:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + f" {a}, {b}.")
    return lines


def _train_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text round-trips
        show_progress=False,
    )
    tok.train_from_iterator(math_corpus(), trainer=trainer)
    return tok


def build_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train and save a byte-level BPE tokenizer into ``path``; returns the loaded transformers tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _write_model(path: Path, vocab_size: int, eos_id: int, pad_id: int, seed: int,
                 overrides: dict | None = None) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        attn_implementation="eager",
        **{**TINY_MODEL_CONFIG, **(overrides or {})},
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.config.attn_implementation = "eager"
    model.save_pretrained(str(path), safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
        model.generation_config.save_pretrained(str(path))


def _is_complete(path: Path) -> bool:
    return (path / _COMPLETE_MARKER).exists() and (path / "config.json").exists()


def build_tiny_model_dir(path: str | os.PathLike | None = None, seed: int = 0, **config) -> str:
    """Build (once) a folder with the tiny tokenizer + random Qwen2 model; returns its path as str.

    ``config`` overrides :data:`TINY_MODEL_CONFIG` (e.g. :data:`MEGATRON_TINY_CONFIG`); a cached folder built
    with other overrides is refused (ValueError), not silently reused.

    Cached by path: if ``path`` already holds a complete build it is returned untouched. The build goes
    to a temporary sibling folder first and is renamed into place, so a crashed/concurrent build never
    leaves a half-written folder behind. ``path=None`` uses ``$TMPDIR/verl_tokensel_tiny_qwen2``.
    """
    path = Path(path) if path is not None else Path(tempfile.gettempdir()) / "verl_tokensel_tiny_qwen2"
    if _is_complete(path):
        built = json.loads((path / _COMPLETE_MARKER).read_text()).get("config", {})
        if built != config:
            raise ValueError(f"{path} holds a tiny model built with config overrides {built}, not {config}: "
                             "use another folder")
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".build-", dir=str(path.parent)))
    try:
        tokenizer = build_tiny_tokenizer(tmp)
        vocab_size = len(tokenizer)
        _write_model(tmp, vocab_size, tokenizer.convert_tokens_to_ids(EOS_TOKEN),
                     tokenizer.convert_tokens_to_ids(PAD_TOKEN), seed, config)
        (tmp / _COMPLETE_MARKER).write_text(json.dumps({"vocab_size": vocab_size, "seed": seed, "config": config}))
        try:
            os.replace(tmp, path)  # atomic when path does not exist (or is an empty dir)
        except OSError:
            if not _is_complete(path):  # someone else may have won the race; otherwise retry once
                import shutil

                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def load_tiny_tokenizer(model_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


if __name__ == "__main__":  # manual check: python -m verl_tokensel_cpu.tiny_model [dir]
    import sys
    import time

    t0 = time.time()
    d = build_tiny_model_dir(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    tok = load_tiny_tokenizer(d)
    text = "Question: What is 12 plus 30? Answer: 42. \\boxed{42} héllo"
    ids = tok(text)["input_ids"]
    print(d, type(tok).__name__, len(tok), len(ids), repr(tok.decode(ids)), f"{time.time() - t0:.2f}s")
