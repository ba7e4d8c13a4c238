"""The README's main-job command and `verl-tokensel env`, run as a user would (subprocess)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest


def _cli(*args, timeout=600):
    cmd = [sys.executable, "-m", "verl_tokensel.cli.main", *args]
    # a fresh process, as a user's shell would start it: no rank/rendezvous variables that other tests'
    # in-process verl workers put into this process's environment
    leaked = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in leaked}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_cpu_step_runs_every_preset_and_reports_the_selected_fraction(tmp_path):
    res = _cli("cpu-step", "--workdir", str(tmp_path), "--presets", "none", "forking", "forking_bottom", "gmts",
               "lopti", "stapo")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(update pass 2)" in res.stderr  # the two update passes of a step (lopti)
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+)\s+([0-9.]+)\s", res.stdout, flags=re.M)}
    assert rows["none"] == 1.0
    # ceil(0.2 N) over micro-batch pools of a few dozen tokens: a little above 0.2 / 0.8
    assert 0.2 <= rows["forking"] < 0.3 and 0.2 <= rows["gmts"] < 0.3
    assert 0.8 <= rows["forking_bottom"] < 0.9
    assert rows["lopti"] == 1.0 and 0.5 < rows["stapo"] <= 1.0  # no budget: every token, or all but the spurious


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_cpu_step_on_the_megatron_engine(tmp_path):
    res = _cli("cpu-step", "--engine", "megatron", "--workdir", str(tmp_path),
               "--presets", "none", "forking", "gmts", "forking_paper")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TrainingWorker (Megatron, CPU)" in res.stderr
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+)\s+([0-9.]+)\s", res.stdout, flags=re.M)}
    assert rows["none"] == 1.0
    assert 0.2 <= rows["forking"] < 0.3 and 0.2 <= rows["gmts"] < 0.3 and 0.19 <= rows["forking_paper"] < 0.3


def test_cpu_step_rejects_unknown_preset(tmp_path):
    res = _cli("cpu-step", "--workdir", str(tmp_path), "--presets", "bogus")
    assert res.returncode == 2
    assert "bogus" in res.stderr and "forking" in res.stderr


def test_env_reports_versions_and_plugin():
    res = _cli("env")
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert re.search(r"^verl\s+0\.9\.", res.stdout, flags=re.M)
    assert re.search(r"^verl plugin\s+loaded$", res.stdout, flags=re.M)


@pytest.mark.parametrize("sub", ["env", "cpu-step"])
def test_help_has_worked_examples(sub):
    res = _cli(sub, "--help")
    assert res.returncode == 0 and "verl-tokensel " + sub in res.stdout
