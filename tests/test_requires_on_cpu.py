"""The ``requires`` marker (tests/conftest.py): a test module that needs a package names it in its ``pytestmark``;
without the package the module is reported skipped with the reason and never imported; no module skips itself."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

NEEDS_VERL = '''
import pytest

import verl  # fails here: the hook must not import the module

pytestmark = [pytest.mark.requires("verl", "ray"), pytest.mark.slow]


def test_never_runs():
    raise AssertionError("collected without verl")
'''
ONE_TEST_NEEDS_VERL = '''
import pytest


@pytest.mark.requires("verl")
def test_skipped():
    raise AssertionError("ran without verl")


def test_runs():
    pass
'''
UNKNOWN = '''
import pytest

pytestmark = pytest.mark.requires("verll")


def test_x():
    pass
'''


def _pytest_without_verl(tmp_path: Path, **modules: str) -> subprocess.CompletedProcess:
    """pytest over ``modules`` (name -> source) with the suite's conftest, in a process where ``verl`` is absent."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    requires: see conftest\n    slow: long\n")
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    code = ("import sys; sys.modules['verl'] = None  # importlib.util.find_spec('verl') is None\n"
            "import pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', sys.argv[1]]))")
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_a_module_needing_an_absent_package_is_skipped_with_the_reason_and_not_imported(tmp_path):
    res = _pytest_without_verl(tmp_path, test_needs_verl=NEEDS_VERL, test_one_needs_verl=ONE_TEST_NEEDS_VERL)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "1 passed, 2 skipped" in out, out
    reason = "needs verl, not installed (verl==0.9.1; the whole stack: bash scripts/install_cpu.sh)"
    assert f"SKIPPED [1] test_needs_verl.py:6: {reason}" in out, out  # its pytestmark line
    assert "SKIPPED [1] test_one_needs_verl.py:" in out and "ImportError" not in out, out


def test_an_unknown_package_name_is_a_usage_error(tmp_path):
    res = _pytest_without_verl(tmp_path, test_unknown=UNKNOWN)
    assert res.returncode != 0
    assert "unknown package(s) ['verll']" in res.stdout + res.stderr


def test_no_test_module_skips_itself():
    """A module-level ``pytest.skip(..., allow_module_level=True)`` or ``pytest.importorskip`` hides the reason from
    the marker's one table and needs the module's imports below it; ``pytestmark = pytest.mark.requires(...)``
    says the same before the module is imported."""
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                continue
            src = ast.unparse(node)
            if "allow_module_level" in src or "pytest.importorskip" in src:
                found.append(f"{path.name}:{node.lineno}")
    assert not found, f"module-level skips (use pytestmark = pytest.mark.requires(...)): {found}"
