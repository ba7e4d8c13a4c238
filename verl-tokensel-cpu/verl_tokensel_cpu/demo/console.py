"""The demo's console: its progress lines (:class:`Progress`, :func:`watch_run`), without the known third-party
noise, notices that say nothing about the run.

vLLM's and TransferQueue's thread-count and Triton notices, Megatron's Apex / TransformerEngine fallbacks, verl's
missing optional engines and its accelerator probe, transformers' deprecation and weight-loading bars. On the
console they are dropped (with the indented source line Python prints under a warning); the demo keeps them in
``<out>/logs/console_noise.log``, and every run's own log keeps its output whole. :func:`drop_noise` filters the
log tail the demo prints for a failed run. :func:`quiet_console` is the one filter: the examples that run verl in
their own process (``examples/custom_rule.py``) use it too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Optional

#: one regex per known notice (Ray's "(Actor pid=N)" prefix and ANSI colours are stripped before matching)
NOISE_PATTERNS: tuple[str, ...] = (
    r"target_num_threads \d+ should not exceed total physical CPU cores",  # TransferQueue
    r"Triton is installed, but|Model Runner V2 requires Triton",  # vLLM on CPU
    r"Inductor compilation was disabled by user settings|Enforce eager set, disabling torch\.compile",  # vLLM
    r"NUMA binding: Using MEMBIND policy|Failed to set NUMA affinity",  # torch / vLLM on CPU
    r"Transformer Engine and Apex are not installed|Apex is not installed|without Transformer Engine",  # Megatron
    r"(torchtitan|veomni|automodel) engine is not available",  # verl's optional engines
    r"No supported accelerator detected|is registered but not available",  # verl's accelerator probe
    r"`torch_dtype` is deprecated|requires torchvision \(not installed\)",  # transformers
    r"^Loading weights:|^Writing model shards:",  # transformers' weight-loading and -saving bars
    r"is_fx_tracing will return true for both fx\.symbolic_trace and torch\.export",  # torch, once per process
)
_NOISE = re.compile("|".join(f"(?:{p})" for p in NOISE_PATTERNS))
_PREFIX = re.compile(r"\x1b\[[0-9;]*m|^\(\S+ pid=\d+(?:, ip=[\d.]+)?\)\s?")


def is_noise(line: str) -> bool:
    """``line`` (one console line; a progress bar's ``\\r`` updates included) is a known notice."""
    return bool(_NOISE.search(_PREFIX.sub("", line.split("\r")[-1] or line)))


def drop_noise(lines: Iterable[str]) -> list[str]:
    """``lines`` without the known notices and the indented source lines Python prints under them."""
    out, dropping = [], False
    for line in lines:
        if is_noise(line):
            dropping = True
            continue
        if dropping and line[:1] in (" ", "\t") and line.strip():
            continue  # "  warnings.warn(...)" under a dropped warning
        dropping = False
        out.append(line)
    return out


class _Filtered(io.TextIOBase):
    """A text stream that passes whole lines to ``stream`` and diverts known notices to ``noise``."""

    def __init__(self, stream, noise):
        self._stream, self._noise, self._buf, self._dropping = stream, noise, "", False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._line(line + "\n")
        return len(text)

    def _line(self, line: str) -> None:
        if is_noise(line) or (self._dropping and line[:1] in (" ", "\t") and line.strip()):
            self._dropping = True
            self._noise.write(line)
            self._noise.flush()
            return
        self._dropping = False
        self._stream.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def close_buffer(self) -> None:
        if self._buf:
            self._line(self._buf)
            self._buf = ""
        self.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler]


@contextlib.contextmanager
def quiet_console(noise_log: Optional[Path] = None) -> Iterator[None]:
    """Inside, ``sys.stdout`` / ``sys.stderr`` (and the logging handlers already writing to them, such as the
    ones libraries set up at import) drop the known notices (:func:`is_noise`) into ``noise_log`` (None: nowhere).

    Use::

        from verl_tokensel_cpu.demo.console import quiet_console

        with quiet_console():
            main()
    """
    if noise_log is not None:
        noise_log.parent.mkdir(parents=True, exist_ok=True)
    with open(os.devnull if noise_log is None else noise_log, "a") as noise:
        saved = sys.stdout, sys.stderr
        filtered = {id(saved[0]): _Filtered(saved[0], noise), id(saved[1]): _Filtered(saved[1], noise)}
        sys.stdout, sys.stderr = filtered[id(saved[0])], filtered[id(saved[1])]
        handlers = [(h, h.stream) for h in _stream_handlers() if id(h.stream) in filtered]
        for h, stream in handlers:
            h.setStream(filtered[id(stream)])
        try:
            yield
        finally:
            for h, stream in handlers:
                h.setStream(stream)
            for stream in filtered.values():
                stream.close_buffer()
            sys.stdout, sys.stderr = saved


class Progress:
    """The demo's progress lines: ``[demo 1m05s] message`` on stderr."""

    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        el = int(time.monotonic() - self.t0)
        print(f"[demo {el // 60:d}m{el % 60:02d}s] {msg}", file=sys.stderr, flush=True)


def log_tail(path: Path, n: int = 25) -> str:
    """The last ``n`` lines of a run's log but the known third-party notices (the log keeps them)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(drop_noise(f), maxlen=n))
    except OSError as e:
        return f"(log not readable: {e})\n"


def watch_run(launch, log_path: Path, metrics_path: Path, steps: int, timeout_s: float, progress, label: str,
              stop: threading.Event) -> None:
    """Report each step as verl's file logger writes it, and the pipeline stage every 20 s meanwhile (``launch``:
    the launcher module, for its ``read_metrics`` and ``last_stage``)."""
    from verl_tokensel_cpu.demo.report import REWARD_KEYS, metric

    t0 = last_note = time.monotonic()
    seen = 0
    while not stop.wait(2.0):
        logged = launch.read_metrics(metrics_path)
        for m in logged[seen:]:
            reward = metric(m, *REWARD_KEYS)
            reward = "-" if reward is None else f"{reward:.3f}"
            progress(f"{label}: step {m.get('step', seen + 1)}/{steps} done, reward {reward} "
                     f"({time.monotonic() - t0:.0f} s into the run)")
            seen += 1
            last_note = time.monotonic()
        if time.monotonic() - last_note >= 20:
            last_note = time.monotonic()
            try:
                stage = launch.last_stage(log_path.read_text(errors="replace"), "cpu")
            except OSError:
                stage = None
            progress(f"{label}: {stage or 'starting'} ({time.monotonic() - t0:.0f} s into the run, "
                     f"timeout {timeout_s:.0f} s)")


__all__ = ["NOISE_PATTERNS", "Progress", "drop_noise", "is_noise", "log_tail", "quiet_console", "watch_run"]
