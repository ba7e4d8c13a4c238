"""Project hygiene that CI enforces: the README's test command is what .ci/run runs, the
CHANGELOG names the verl version the suite ran against, and the entry point is declared."""

from __future__ import annotations

import configparser
import re
from importlib.metadata import entry_points, version
from pathlib import Path

import verl_tokensel

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmds = re.findall(r"^(python -m pytest .*)$", readme, flags=re.M)
    assert cmds, "README has no test command"
    assert cmds[0] in ci


def test_changelog_names_the_tested_verl_version():
    installed = version("verl")
    assert installed == verl_tokensel.TESTED_VERL_VERSION, (
        f"suite ran against verl {installed}, TESTED_VERL_VERSION says {verl_tokensel.TESTED_VERL_VERSION}")
    assert f"Tested with verl {installed}." in (ROOT / "CHANGELOG.md").read_text()


def test_verl_plugin_entry_point_declared_and_loads():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "tokensel = verl_tokensel.plugin" in cfg["options.entry_points"]["verl.plugins"]
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
            "assert p.LOAD_ERROR is not None\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "verl_tokensel: the verl plugin failed to load, token selection is NOT active" in res.stderr
