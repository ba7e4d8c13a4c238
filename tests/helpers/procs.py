"""Processes seen through /proc, for the fault tests (helper, not a test)."""

from __future__ import annotations

import os
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int | None:
    """CPU time (user + system, in clock ticks) used so far by ``pid``; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_busy(pid: int, busy_s: float, stop=None, deadline_s: float = 600.0) -> bool:
    """Block until ``pid`` has used a CPU core for ``busy_s`` seconds without a pause (sampled every 0.1 s,
    busy = at least a quarter of a core: a process that computes on a shared 2-core machine gets less than a
    whole one, an idle one almost nothing); False if it vanished, ``stop`` (an Event) was set, or the deadline
    passed."""
    end = time.monotonic() + deadline_s
    busy, last = 0.0, cpu_ticks(pid)
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        time.sleep(0.1)
        now = cpu_ticks(pid)
        if now is None or last is None:
            return False
        busy = busy + 0.1 if (now - last) >= 0.25 * 0.1 * CLK_TCK else 0.0
        last = now
        if busy >= busy_s - 1e-9:
            return True
    return False
