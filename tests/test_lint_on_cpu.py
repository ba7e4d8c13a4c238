"""The package, the tests and the benchmarks pass ``ruff`` with the repository's ``ruff.toml``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    pytest.importorskip("ruff", reason="ruff is in requirements/cpu-test.txt")
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "verl_tokensel", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, "ruff check failed:\n" + res.stdout + res.stderr


MAX_LINES = 400
REASON = "Why one file over 400 lines:"


def test_long_package_files_state_why_at_their_top():
    """No file in the package over ~400 lines unless its docstring says why (in its first 10 lines)."""
    long_without_reason = []
    for path in sorted((ROOT / "verl_tokensel").rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(REASON in line for line in lines[:10]):
            long_without_reason.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not long_without_reason, (
        f"over {MAX_LINES} lines without a '{REASON} ...' note at the top: {long_without_reason}. "
        "Fix: split the file, or state the reason in its docstring."
    )
