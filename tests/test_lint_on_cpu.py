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


# The layers of ARCHITECTURE.md, read from its layer table (the one source): rows from the bottom up, each with
# its files and the layers it may import, which must all be rows above it. "verl" is the verl package.
LAYER_TABLE_HEADER = "| layer | files | what it is | may import |"


def _layer_table() -> list[tuple[str, set[str], set[str], bool]]:
    """``[(layer, its parts of the package, the layers it may import, may it import verl)]`` from the bottom up.

    A part is a folder of ``verl_tokensel/`` or a top-level module (``verl_tokensel`` for the package's own
    ``__init__.py``); ``analysis.ray_scorer`` in the "may import" column allows that one module of a layer.
    """
    import re

    lines = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").splitlines()
    assert LAYER_TABLE_HEADER in lines, f"ARCHITECTURE.md has no layer table (header {LAYER_TABLE_HEADER!r})"
    rows = []
    for line in lines[lines.index(LAYER_TABLE_HEADER) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4, f"ARCHITECTURE.md layer table: a row with {len(cells)} cells: {line}"
        name = cells[0].strip("`")
        parts = set()
        for path in re.findall(r"`([^`]+)`", cells[1]):
            path = path.removeprefix("verl_tokensel/")
            if not path.startswith("tests/"):
                parts.add("verl_tokensel" if path == "__init__.py" else path.rstrip("/").removesuffix(".py"))
        may = set(re.findall(r"`([^`]+)`", cells[3]))
        rows.append((name, parts, may, re.search(r"\bverl\b", re.sub(r"`[^`]*`", "", cells[3])) is not None))
    return rows


def _package_modules() -> dict[str, Path]:
    """``{dotted module name: path}`` of every .py of the package (a package's ``__init__.py`` under its own name)."""
    out = {}
    for path in sorted((ROOT / "verl_tokensel").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports_of(module: str, path: Path, modules) -> set[str]:
    """Every module ``module`` imports, at any depth of its code (lazy and TYPE_CHECKING ones too): the package's
    own as module names (``from pkg import submodule`` -> ``pkg.submodule``; ``from mod import name`` -> ``mod``),
    others as written (``verl.trainer.ppo.v1``)."""
    import ast

    def resolve(name: str) -> str:
        while name.split(".")[0] == "verl_tokensel" and name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(resolve(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else resolve(base) for a in node.names)
    return out


def _package_graph() -> dict[str, set[str]]:
    """The import graph of the package's modules: ``{module: the package's modules it imports}``."""
    modules = _package_modules()
    return {module: {name for name in _imports_of(module, path, modules) if name in modules and name != module}
            for module, path in modules.items()}


def _part(module: str) -> str:
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else "verl_tokensel"


def test_layer_table_of_architecture_md_imports_only_downward():
    rows = _layer_table()
    below: set[str] = set()
    bad = []
    for name, _, may, _ in rows:
        upward = {m for m in may if m.split(".")[0] not in below}
        if upward:
            bad.append(f"{name} may import {sorted(upward)}")
        below.add(name)
    assert not bad, ("ARCHITECTURE.md's layer table (rows from the bottom up) lets a layer import one that is not "
                     "below it: " + "; ".join(bad) + ". Fix: move the code, not the rule.")
    parts = [p for _, ps, _, _ in rows for p in ps]
    modules = _package_modules()
    in_package = {_part(m) for m in modules}
    assert len(parts) == len(set(parts)), f"a part in two rows of the layer table: {sorted(parts)}"
    assert set(parts) == in_package, (
        f"ARCHITECTURE.md's layer table does not place {sorted(in_package - set(parts))} "
        f"(and names {sorted(set(parts) - in_package)}, which the package does not have). Fix: add the new file or "
        "folder to the row of its layer.")


def test_imports_follow_the_layers_of_architecture_md():
    rows = _layer_table()
    layer_of = {part: name for name, parts, _, _ in rows for part in parts}
    allowed = {name: may for name, _, may, _ in rows}
    verl_ok = {name for name, _, _, uses_verl in rows if uses_verl}
    modules = _package_modules()
    bad = []
    for module, path in modules.items():
        src = layer_of[_part(module)]
        for name in sorted(_imports_of(module, path, modules)):
            top = name.split(".")[0]
            if top == "verl" and src not in verl_ok:
                bad.append(f"{module} imports {name}")
            elif top == "verl_tokensel" and layer_of[_part(name)] != src:
                dst = layer_of[_part(name)]
                # `a.b` in the column allows the one module verl_tokensel.a.b of layer a
                if dst not in allowed[src] and name.removeprefix("verl_tokensel.") not in allowed[src]:
                    bad.append(f"{module} ({src}) imports {name} ({dst})")
    assert not bad, "imports across layers that ARCHITECTURE.md's layer table does not allow: " + "; ".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # the shortest way back to the component's first module
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append(paths[last] + [start])
    return cycles


def test_cycle_finder_reports_the_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_package_import_graph_has_no_cycle():
    """No module of the package imports, directly or through others, one that imports it back (lazy imports too)."""
    cycles = _cycles(_package_graph())
    assert not cycles, ("import cycles in the package: " + "; ".join(" -> ".join(c) for c in cycles)
                        + ". Fix: move what one side needs so the dependency runs one way.")


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
