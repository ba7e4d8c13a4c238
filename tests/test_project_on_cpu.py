"""Project hygiene that CI enforces: the README's set-up block is what .ci/run runs, the
CHANGELOG names the verl version the suite ran against, and the entry point is declared."""

from __future__ import annotations

import configparser
import re
from importlib.metadata import entry_points, version
from pathlib import Path

import verl_tokensel

ROOT = Path(__file__).resolve().parents[1]


def _setup_block() -> list[str]:
    """The command lines of the README's set-up block (the fenced block after its marker comment)."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- set-up block:[^\n]*-->\n```bash\n(.*?)\n```", readme, flags=re.S)
    assert m, "README has no set-up block (marker '<!-- set-up block: ... -->' then a ```bash block)"
    return [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_ci_runs_the_readme_setup_block_verbatim():
    """.ci/run executes the README's set-up lines as they are, in order: one install, one truth."""
    block = _setup_block()
    assert len(block) == 2, f"the README's set-up is two commands (install + main job, tests), got {block}"
    assert "scripts/install_cpu.sh" in block[0] and "verl-tokensel demo" in block[0]
    assert block[1].startswith("python -m pytest tests ")
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
    positions = [ci_lines.index(ln) for ln in block if ln in ci_lines]
    assert len(positions) == len(block), f".ci/run lacks README set-up line(s): {set(block) - set(ci_lines)}"
    assert positions == sorted(positions), ".ci/run runs the README's set-up lines out of order"


def test_ci_installs_nothing_the_readme_does_not_show():
    """No private install variant: every pip/venv line of .ci/run is a README set-up line."""
    block = set(_setup_block())
    for ln in (ROOT / ".ci" / "run").read_text().splitlines():
        code = ln.split("#", 1)[0]
        if re.search(r"\bpip\b|-m venv|install_cpu", code):
            assert ln in block, f".ci/run installs outside the README's set-up block: {ln!r}"


def test_changelog_names_the_tested_verl_version():
    installed = version("verl")
    assert installed == verl_tokensel.TESTED_VERL_VERSION, (
        f"suite ran against verl {installed}, TESTED_VERL_VERSION says {verl_tokensel.TESTED_VERL_VERSION}")
    assert f"Tested with verl {installed}." in (ROOT / "CHANGELOG.md").read_text()


def test_verl_plugin_entry_point_declared_and_loads():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    # the product declares one verl.plugins entry point; the CPU distribution its own
    assert cfg["options.entry_points"]["verl.plugins"].split() == ["tokensel", "=", "verl_tokensel.plugin"]
    cpu = configparser.ConfigParser()
    cpu.read(ROOT / "verl-tokensel-cpu" / "setup.cfg")
    assert cpu["options.entry_points"]["verl.plugins"].split() == ["tokensel_cpu", "=", "verl_tokensel_cpu.plugin"]
    import verl_tokensel
    import verl_tokensel_cpu

    assert verl_tokensel_cpu.__version__ == verl_tokensel.__version__
    assert f"verl-tokensel=={verl_tokensel.__version__}" in cpu["options"]["install_requires"].split()
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "tokensel"]
    assert eps, "package not installed with its entry point (pip install -e .)"
    import verl  # noqa: F401  (loads the plugin)
    from verl.trainer.ppo.v1 import get_trainer_cls

    import verl_tokensel.plugin as plugin

    assert plugin.LOAD_ERROR is None
    assert get_trainer_cls("tokensel_sync").__name__ == "TokenselPPOTrainerSync"


def test_broken_plugin_import_is_loud():
    """verl swallows plugin import errors; ours must still reach the user's terminal."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['verl_tokensel.verl_glue.install'] = None\n"
            "import verl\n"
            "import verl_tokensel.plugin as p\n"
            "assert p.LOAD_ERROR is None  # registration waits for verl's trainer package\n"
            "import verl.trainer.ppo.v1\n"
            "assert p.LOAD_ERROR is not None\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "verl-tokensel: the verl plugin failed to load, token selection is NOT active" in res.stderr


def _default_suite_tests(path: Path) -> set[str]:
    """The test functions of a test file that the default suite runs (not marked ``slow``, itself or its module)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))

    def slow(decorators) -> bool:
        return any("mark.slow" in ast.unparse(d) for d in decorators)

    # the module's marks (pytestmark: one mark or a list, e.g. [pytest.mark.requires("verl"), pytest.mark.slow])
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
           and slow([n.value]) for n in tree.body):
        return set()
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
            and not slow(n.decorator_list)}


def test_every_seam_has_a_default_suite_test():
    """Each row of ARCHITECTURE.md's seams table names, in its last column, at least one test file (``test_x`` for
    ``tests/test_x_on_cpu.py``, or ``test_x::test_y`` for one test) that exists and that the default suite runs."""
    table = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").split("\n## Seams\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| verl symbol")]
    assert len(rows) >= 20, f"the seams table has {len(rows)} rows"
    without = []
    for row in rows:
        found = False
        for name, test in re.findall(r"`(test_[a-z0-9_]+)(?:::(test_[a-z0-9_]+))?`", row.rsplit("|", 2)[-2]):
            path = ROOT / "tests" / f"{name}_on_cpu.py"
            if path.exists():
                runs = _default_suite_tests(path)
                found = found or (test in runs if test else bool(runs))
        if not found:
            without.append(row.split("|")[1].strip()[:80])
    assert not without, f"seams without a default-suite test that names them: {without}"
