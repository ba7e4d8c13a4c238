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


# The layers of ARCHITECTURE.md: which part of the package may import which (every import, lazy ones included).
# "verl" is the verl package; entry points are the top-level modules.
ENTRY = {"verl_tokensel", "plugin", "main_ppo", "launch", "stack"}
MAY_IMPORT = {
    "core": set(),
    "analysis": {"core"},
    "verl_glue": {"verl", "core", "analysis", "plugin"},
    "cpu": {"verl", "core", "verl_glue", "plugin"},
    "demo": {"core", "analysis", "cpu"},
    "cli": {"verl", "core", "analysis", "verl_glue", "cpu", "demo", "config", "recipes"} | ENTRY,
    **{e: {"verl", "verl_glue", "cpu"} | ENTRY for e in ENTRY},
}
# the one module of analysis the verl glue may use (the reference-model scorer of score_source=rollout)
GLUE_MAY_USE_FROM_ANALYSIS = {"verl_tokensel.analysis.ray_scorer"}


def _package_imports():
    """``{(importing part, imported part, imported module)}`` over every .py of the package."""
    import ast

    pkg = ROOT / "verl_tokensel"

    def part(module: str) -> str:
        bits = module.split(".")
        return bits[1] if len(bits) > 1 else "verl_tokensel"

    out = set()
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        src = part(".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "verl_tokensel":
                    out.add((src, part(name), name))
                elif name.split(".")[0] == "verl":
                    out.add((src, "verl", name))
    return out


def test_imports_follow_the_layers_of_architecture_md():
    bad = sorted(f"{src} imports {mod}" for src, dst, mod in _package_imports()
                 if dst != src and dst not in MAY_IMPORT.get(src, set()))
    bad += sorted(f"verl_glue imports {mod}" for src, dst, mod in _package_imports()
                  if src == "verl_glue" and dst == "analysis" and mod not in GLUE_MAY_USE_FROM_ANALYSIS)
    assert not bad, "imports across layers that ARCHITECTURE.md does not allow: " + "; ".join(bad)
    assert {src for src, dst, _ in _package_imports() if dst == "cli"} <= {"cli"}, "nothing outside cli/ imports cli/"
