"""Input side of the analysis subcommands: responses from files, tokenisation, models.

:func:`load_records` reads a verl rollout dump (``trainer.rollout_data_dir``: ``<step>.jsonl`` files with
``input``, ``output``, ``score``, ``step`` and, with the V1 driver, ``uid``), or a ``.parquet`` / ``.jsonl``
table with ``prompt``, ``response`` and optional ``reward`` (or ``score``), ``advantage``, ``uid`` (or
``group``). Responses are grouped by prompt (``uid``'s sample part, else identical prompt text; never across
steps). Every problem is raised as :class:`AnalysisInputError` naming the file (and the rows) before anything
is scored or written.

:func:`tokenize_records` re-tokenises prompt and response with ``add_special_tokens=False``. verl decodes its
dumps with ``skip_special_tokens=True``, so chat-template special tokens are not scored, and a few tokens may
split differently from the rollout: the scores are those of the visible text, which is what the papers'
entropy statistics describe. Formats in full: ``docs/analysis.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence


class AnalysisInputError(ValueError):
    """Bad input to the analysis: the message names the file and the problem."""


@dataclass
class ResponseRecord:
    """One response to score.

    Attributes:
        prompt / response: text.
        reward: scalar reward, or None when the input has none.
        advantage: scalar advantage, or None when the input has none.
        group: id of the prompt group (responses to the same prompt share it).
        source: ``file:line`` or ``file:row`` for messages.
    """

    prompt: str
    response: str
    reward: Optional[float]
    advantage: Optional[float]
    group: str
    source: str


_DUMP_KEYS = ("input", "output")
_TABLE_KEYS = ("prompt", "response")


def _rows_text(rows: Sequence[Any], limit: int = 10) -> str:
    rows = list(rows)
    head = ", ".join(str(r) for r in rows[:limit])
    return head + (f", ... ({len(rows)} in all)" if len(rows) > limit else "")


def _step_of(path: Path) -> Optional[int]:
    return int(path.stem) if re.fullmatch(r"-?\d+", path.stem) else None


def load_records(path: str | os.PathLike) -> list[ResponseRecord]:
    """Read responses from a rollout dump directory, a ``.jsonl`` (dump or table) or a ``.parquet``."""
    p = Path(path)
    if not p.exists():
        raise AnalysisInputError(f"{p}: no such file or directory")
    if p.is_dir():
        files = sorted(p.glob("*.jsonl"), key=lambda f: (_step_of(f) is None, _step_of(f) or 0, f.name))
        if not files:
            raise AnalysisInputError(f"{p}: directory holds no *.jsonl rollout dumps (trainer.rollout_data_dir)")
        out: list[ResponseRecord] = []
        for f in files:
            out.extend(_load_file(f))
        return out
    return _load_file(p)


def _load_file(p: Path) -> list[ResponseRecord]:
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return _load_parquet(p)
    if suffix in (".jsonl", ".json"):
        return _load_jsonl(p)
    raise AnalysisInputError(f"{p}: unsupported file type {p.suffix!r}; expected a .jsonl, a .parquet or a "
                             "rollout dump directory")


def _load_jsonl(p: Path) -> list[ResponseRecord]:
    rows: list[dict] = []
    lines: list[int] = []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise AnalysisInputError(f"{p}: not UTF-8 text ({e})") from None
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise AnalysisInputError(f"{p}: line {i} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise AnalysisInputError(f"{p}: line {i} is a JSON {type(obj).__name__}, expected an object")
        rows.append(obj)
        lines.append(i)
    if not rows:
        raise AnalysisInputError(f"{p}: empty file (no JSON lines)")
    keys = set().union(*(r.keys() for r in rows))
    if all(k in keys for k in _DUMP_KEYS):
        return _records_from_rows(p, rows, [f"line {i}" for i in lines], dump=True)
    if all(k in keys for k in _TABLE_KEYS):
        return _records_from_rows(p, rows, [f"line {i}" for i in lines], dump=False)
    raise AnalysisInputError(
        f"{p}: missing required columns: need 'prompt' and 'response' (table) or 'input' and 'output' "
        f"(verl rollout dump); found {sorted(keys)}"
    )


def _load_parquet(p: Path) -> list[ResponseRecord]:
    import pandas as pd

    try:
        df = pd.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - any reader failure is an input problem
        raise AnalysisInputError(f"{p}: cannot read as parquet ({type(e).__name__}: {e})") from None
    if len(df) == 0:
        raise AnalysisInputError(f"{p}: empty file (no rows)")
    cols = [str(c) for c in df.columns]
    dump = all(k in cols for k in _DUMP_KEYS) and not all(k in cols for k in _TABLE_KEYS)
    if not dump and not all(k in cols for k in _TABLE_KEYS):
        missing = [k for k in _TABLE_KEYS if k not in cols]
        raise AnalysisInputError(f"{p}: missing required columns {missing}: need 'prompt' and 'response' "
                                 f"(optional: reward or score, advantage, uid or group); found {cols}")
    rows = df.to_dict(orient="records")
    return _records_from_rows(p, rows, [f"row {i}" for i in range(len(rows))], dump=dump)


def _present(v: Any) -> bool:
    if v is None:
        return False
    try:
        import pandas as pd

        return not bool(pd.isna(v)) if not isinstance(v, (str, bytes, list, dict)) else True
    except (TypeError, ValueError):
        return True


def _numbers(p: Path, rows: list[dict], where: list[str], key: str) -> Optional[list[float]]:
    """The column ``key`` as floats, or None when no row has it. Missing / non-numeric / non-finite: error."""
    if not any(key in r for r in rows):
        return None
    values: list[float] = []
    missing, bad_type, non_finite = [], [], []
    for r, w in zip(rows, where):
        v = r.get(key)
        if v is None:
            missing.append(w)
            values.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            bad_type.append(w)
            values.append(math.nan)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            bad_type.append(w)
            values.append(math.nan)
            continue
        if not math.isfinite(f):
            non_finite.append(f"{w} ({f})")
        values.append(f)
    if bad_type:
        raise AnalysisInputError(f"{p}: column {key!r} is not a number in {_rows_text(bad_type)}")
    if missing and len(missing) < len(rows):
        # pandas turns a missing float into NaN; JSON may simply omit the key
        raise AnalysisInputError(f"{p}: column {key!r} is missing (null) in {_rows_text(missing)}")
    if missing:
        return None
    if non_finite:
        raise AnalysisInputError(f"{p}: non-finite (NaN/inf) {key} in {_rows_text(non_finite)}")
    return values


def _records_from_rows(p: Path, rows: list[dict], where: list[str], *, dump: bool) -> list[ResponseRecord]:
    pk, rk = ("input", "output") if dump else ("prompt", "response")
    for key in (pk, rk):
        missing = [w for r, w in zip(rows, where) if key not in r]
        if missing:
            raise AnalysisInputError(f"{p}: required column {key!r} is missing in {_rows_text(missing)}")
        bad = [f"{w} ({type(r[key]).__name__})" for r, w in zip(rows, where) if not isinstance(r[key], str)]
        if bad:
            raise AnalysisInputError(f"{p}: column {key!r} must be text (a string); not in {_rows_text(bad)}")
    # a NaN reward is reported as such even where pandas stored it as a float NaN
    reward_key = "reward" if any("reward" in r for r in rows) else "score"
    for r in rows:
        for key in (reward_key, "advantage"):
            if key in r and not _present(r[key]) and r[key] is not None:
                r[key] = float("nan")
    rewards = _numbers(p, rows, where, reward_key)
    advantages = _numbers(p, rows, where, "advantage")
    groups = _groups(p, rows, where, dump=dump, prompt_key=pk)
    return [
        ResponseRecord(
            prompt=r[pk], response=r[rk],
            reward=None if rewards is None else rewards[i],
            advantage=None if advantages is None else advantages[i],
            group=groups[i], source=f"{p}:{where[i]}",
        )
        for i, r in enumerate(rows)
    ]


def _groups(p: Path, rows: list[dict], where: list[str], *, dump: bool, prompt_key: str) -> list[str]:
    step_default = _step_of(p)
    out = []
    gkey = "uid" if any(_present(r.get("uid")) for r in rows) else (
        "group" if any(_present(r.get("group")) for r in rows) else None)
    for r, w in zip(rows, where):
        step = r.get("step", step_default) if dump else None
        if gkey is not None:
            g = r.get(gkey)
            if not _present(g):
                raise AnalysisInputError(f"{p}: column {gkey!r} is missing in {w} (other rows have it)")
            g = str(g)
            if dump:  # V1 driver: <sample>_<rollout>_<output>
                parts = g.rsplit("_", 2)
                g = parts[0] if len(parts) == 3 else g
        else:
            g = "prompt:" + r[prompt_key]
        out.append(f"{p.name}|step {step}|{g}" if dump else g)
    return out


# ----------------------------------------------------------------------------------------------------
# tokenisation and models


def tokenize_records(tokenizer, records: Sequence[ResponseRecord]) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, response_ids)`` per record, both without added special tokens.

    A prompt that tokenises to nothing cannot be scored (the first response token needs a preceding
    position): that is an error naming the record.
    """
    pairs = []
    empty = []
    for rec in records:
        prompt = tokenizer(rec.prompt, add_special_tokens=False)["input_ids"]
        response = tokenizer(rec.response, add_special_tokens=False)["input_ids"]
        if len(prompt) == 0:
            empty.append(rec.source)
        pairs.append((list(prompt), list(response)))
    if empty:
        raise AnalysisInputError(f"empty prompt (no tokens to condition on) in {_rows_text(empty)}")
    return pairs


def model_vocab_size(config) -> Optional[int]:
    v = getattr(config, "vocab_size", None)
    if v is None and hasattr(config, "get_text_config"):
        v = getattr(config.get_text_config(), "vocab_size", None)
    return v


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.exists():
        raise AnalysisInputError(f"{p}: tokenizer/model directory does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001
        raise AnalysisInputError(f"{p}: cannot load a tokenizer ({type(e).__name__}: {e})") from None


def check_vocab(tokenizer, tokenizer_path, model_path) -> int:
    """Refuse a tokenizer larger than the model's vocabulary; returns the model's vocab size."""
    from transformers import AutoConfig

    mp = Path(model_path)
    if not mp.exists():
        raise AnalysisInputError(f"{mp}: model directory does not exist")
    try:
        config = AutoConfig.from_pretrained(str(mp))
    except Exception as e:  # noqa: BLE001
        raise AnalysisInputError(f"{mp}: cannot load a model config ({type(e).__name__}: {e})") from None
    vocab = model_vocab_size(config)
    if vocab is None:
        raise AnalysisInputError(f"{mp}: model config has no vocab_size")
    if len(tokenizer) > vocab:
        raise AnalysisInputError(
            f"tokenizer/model vocab mismatch: tokenizer {tokenizer_path} has {len(tokenizer)} tokens but model "
            f"{model_path} has a vocabulary of {vocab}; they do not belong together"
        )
    return int(vocab)


def load_model(path: str | os.PathLike, *, device: str = "cpu", dtype: str = "float32"):
    """AutoModelForCausalLM in eval mode: float32 on CPU; bfloat16 only on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in ("float32", "bfloat16"):
        raise AnalysisInputError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    if dtype == "bfloat16" and not str(device).startswith("cuda"):
        raise AnalysisInputError("--dtype bfloat16 is only allowed with --device cuda (CPU scoring is float32)")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise AnalysisInputError("--device cuda requested but torch sees no CUDA device")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001
        raise AnalysisInputError(f"{path}: cannot load the model ({type(e).__name__}: {e})") from None
    model.to(device)
    model.eval()
    return model


def same_tokenizer(tok_a, tok_b) -> bool:
    """True when two tokenizers map every token string to the same id (and agree on special tokens)."""
    if len(tok_a) != len(tok_b):
        return False
    if tok_a.get_vocab() != tok_b.get_vocab():
        return False
    return list(getattr(tok_a, "all_special_ids", [])) == list(getattr(tok_b, "all_special_ids", []))


__all__ = [
    "AnalysisInputError",
    "ResponseRecord",
    "check_vocab",
    "load_model",
    "load_records",
    "load_tokenizer",
    "model_vocab_size",
    "same_tokenizer",
    "tokenize_records",
]
