"""The package's one post-import hook (verl_tokensel.import_hook) on a throwaway package: the callback runs right
after the module's code, once or at every import, a mere look-up changes nothing, hooks are idempotent by key,
two hooks on one module both run, and the module keeps its own loader."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import uuid

import pytest

from verl_tokensel.import_hook import AfterImport, after_each_import, after_import, installed


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A fresh package ``<name>`` with modules ``a`` and ``b`` (each sets ``RAN = True``); sys.meta_path and
    sys.modules are restored afterwards."""
    name = f"hookpkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    for mod in ("a", "b"):
        (tmp_path / name / f"{mod}.py").write_text("RAN = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    meta_path = list(sys.meta_path)
    yield name
    sys.meta_path[:] = meta_path
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def _reimport(name: str):
    del sys.modules[name]
    return importlib.import_module(name)


def _keeps_own_loader(module) -> bool:
    own = type(module.__loader__).__module__ != "verl_tokensel.import_hook"
    return own and module.__spec__.loader is module.__loader__


def test_once_runs_after_the_module_code_then_leaves(pkg):
    seen = []
    after_import(f"{pkg}.a", lambda m: seen.append(m.RAN))
    assert installed(f"{pkg}.a") is not None and seen == []
    module = importlib.import_module(f"{pkg}.a")
    assert seen == [True] and _keeps_own_loader(module)
    assert installed(f"{pkg}.a") is None
    _reimport(f"{pkg}.a")
    assert seen == [True]


def test_a_look_up_neither_fires_nor_disarms(pkg):
    seen = []
    after_import(f"{pkg}.a", lambda m: seen.append(m.__name__))
    assert importlib.util.find_spec(f"{pkg}.a") is not None
    assert seen == [] and installed(f"{pkg}.a") is not None
    importlib.import_module(f"{pkg}.a")
    assert seen == [f"{pkg}.a"]


def test_an_imported_module_is_called_at_once_without_a_hook(pkg):
    module = importlib.import_module(f"{pkg}.a")
    seen = []
    after_import(f"{pkg}.a", seen.append)
    assert seen == [module] and installed(f"{pkg}.a") is None


def test_every_import_and_idempotent_by_key(pkg):
    seen = []
    for _ in range(2):
        after_each_import("both", lambda n: n.startswith(pkg + "."), lambda m: seen.append(m.__name__))
    assert sum(isinstance(f, AfterImport) and f.key == "both" for f in sys.meta_path) == 1
    importlib.import_module(f"{pkg}.a")
    importlib.import_module(f"{pkg}.b")
    module = _reimport(f"{pkg}.a")
    assert seen == [f"{pkg}.a", f"{pkg}.b", f"{pkg}.a"] and _keeps_own_loader(module)


def test_two_hooks_on_one_module_both_run(pkg):
    seen = []
    after_import(f"{pkg}.a", lambda m: seen.append("once"))
    after_each_import("each", lambda n: n == f"{pkg}.a", lambda m: seen.append("each"))
    module = importlib.import_module(f"{pkg}.a")
    assert sorted(seen) == ["each", "once"] and _keeps_own_loader(module)
    _reimport(f"{pkg}.a")
    assert sorted(seen) == ["each", "each", "once"]
