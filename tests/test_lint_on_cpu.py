"""Both packages, the tests and the benchmarks pass ``ruff`` with the repository's ``ruff.toml``; their imports keep
the contracts of ``pyproject.toml`` (the layers of ARCHITECTURE.md, ``lint-imports``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    pytest.importorskip("ruff", reason="ruff is in requirements/cpu-test.txt")
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "verl_tokensel", "verl-tokensel-cpu", "tests",
                          "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, "ruff check failed:\n" + res.stdout + res.stderr


MAX_LINES = 400
REASON = "Why one file over 400 lines:"


def test_long_package_files_state_why_at_their_top():
    """No file in the package over ~400 lines unless its docstring says why (in its first 10 lines)."""
    long_without_reason = []
    for path in sorted([*(ROOT / "verl_tokensel").rglob("*.py"), *(ROOT / "verl-tokensel-cpu").rglob("*.py")]):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(REASON in line for line in lines[:10]):
            long_without_reason.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert not long_without_reason, (
        f"over {MAX_LINES} lines without a '{REASON} ...' note at the top: {long_without_reason}. "
        "Fix: split the file, or state the reason in its docstring."
    )


# The layers of ARCHITECTURE.md are an import-linter contract (``[tool.importlinter]`` in pyproject.toml): both
# packages' layers, the product never importing the CPU distribution, verl only where the product meets it, a pure
# torch core, no import cycle (lazy imports count).
CONTRACTS = ("the product never imports the CPU distribution", "the product's layers", "the CPU distribution's layers",
             "verl only where the product meets it", "the selector core is pure torch", "no import cycle")


def _lint_imports(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    pytest.importorskip("importlinter", reason="import-linter is in requirements/cpu-test.txt")
    lint = Path(sys.executable).with_name("lint-imports")
    argv = [str(lint)] if lint.exists() else [sys.executable, "-c", "import sys; from importlinter.cli import "
                                                                   "lint_imports_command as c; sys.exit(c())"]
    return subprocess.run(argv + ["--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_the_import_contracts_of_pyproject_hold():
    res = _lint_imports(ROOT)
    assert res.returncode == 0, "lint-imports: a contract is broken:\n" + res.stdout[-4000:] + res.stderr[-2000:]
    for name in CONTRACTS:
        assert name in res.stdout, f"contract {name!r} was not checked:\n{res.stdout[-3000:]}"
    assert "BROKEN" not in res.stdout


@pytest.mark.parametrize("module,line,contract", [
    ("core/ranking/select.py", "import verl_tokensel_cpu.worker", "the product never imports the CPU distribution"),
    ("core/ranking/select.py", "from verl_tokensel.verl_glue import loss", "the product's layers"),
    ("core/ranking/scores.py", "import verl.utils", "the selector core is pure torch"),
    ("core/resolve/selection.py", "from verl_tokensel.core import step", "no import cycle"),
])
def test_the_contracts_fail_on_an_import_against_them(tmp_path, module, line, contract):
    """A copy of the product with one import against a contract (a lazy one: inside a function) breaks it."""
    import os
    import shutil

    shutil.copytree(ROOT / "verl_tokensel", tmp_path / "verl_tokensel", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "verl_tokensel" / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _against_the_contract():\n    {line}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the copy comes before the editable install
    res = _lint_imports(tmp_path, env=env)
    assert res.returncode != 0, res.stdout[-3000:]
    broken = res.stdout[res.stdout.index("Broken contracts"):]
    assert contract in broken, broken[-3000:]


MAX_FUNCTION_LINES = 80


def test_no_long_function_in_the_product():
    """core/ and verl_glue/ (the product) keep every function under 80 lines, so each reads in one screen."""
    import ast

    long = []
    for part in ("core", "verl_glue"):
        for path in sorted((ROOT / "verl_tokensel" / part).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}. Fix: split them."
