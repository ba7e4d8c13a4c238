"""What ``python -m verl_tokensel.main_ppo`` does with a config it refuses, run as a user runs it (subprocess, a fresh
working folder): one line on stderr, exit 2, for a run and for ``--cfg job`` alike; nothing before that line (verl's
platform probe logs two warnings on a host without a GPU when its trainer modules are imported); no Hydra
``outputs/`` folder left behind. And the README says what each entry point does (verl's own: Hydra's wrapped error,
exit 1, measured here too). Each call is one ``main_ppo`` start (~8 s on 2 cores, no Ray).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.wheel import ROOT

SEL = "actor_rollout_ref.actor.token_selector"
#: the one line both a run and --cfg job print for a misspelt preset
GMTSS_LINE = re.compile(r"^verl-tokensel: actor_rollout_ref\.actor\.token_selector='gmtss' is invalid "
                        r"\(did you mean gmts\?\); valid values: none, forking, .*\.$")


def _run(cwd: Path, *args: str, module: str = "verl_tokensel.main_ppo") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    env.update(HYDRA_FULL_ERROR="0", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=str(cwd), env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("mode", [[], ["--cfg", "job"]], ids=["run", "cfg_job"])
def test_a_refused_config_is_one_line_exit_2_and_leaves_no_folder(tmp_path, mode):
    res = _run(tmp_path, f"{SEL}=gmtss", *mode)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and GMTSS_LINE.match(lines[0]), res.stderr[-3000:]  # no "Falling back to 'nvidia'"
    assert res.stdout == ""  # --cfg job printed no config
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/<time>/ of Hydra


def test_a_cpu_switch_conflict_is_refused_by_cfg_job_too(tmp_path):
    res = _run(tmp_path, f"{SEL}=gmts", "trainer.device=cpu", "actor_rollout_ref.actor.strategy=megatron",
               "--cfg", "job")
    assert res.returncode == 2 and res.stdout == "", res.stdout[-2000:] + res.stderr[-3000:]
    assert "actor_rollout_ref.actor.strategy='megatron' cannot run with trainer.device=cpu" in res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []


def test_the_readme_says_what_each_entry_point_does_with_an_invalid_value(tmp_path):
    """Ours: one line, exit 2 (above); verl's own entry with our config: the same message wrapped by Hydra, exit 1,
    and its --cfg job prints the config unchecked. The README says exactly that."""
    res = _run(tmp_path, "--config-path=pkg://verl_tokensel.config", "--config-name=tokensel_trainer",
               f"{SEL}=gmtss", module="verl.trainer.main_ppo")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Error executing job with overrides:" in res.stderr
    assert "Error in call to target 'verl_tokensel.verl_glue.actor_config.TokenselFSDPActorConfig'" in res.stderr
    assert "token_selector='gmtss' is invalid (did you mean gmts?)" in res.stderr
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert ("`python -m verl_tokensel.main_ppo` prints that one line on stderr and exits 2, for a run and for "
            "`--cfg job` alike, before Hydra creates its `outputs/` folder.") in readme
    assert ("verl's own `python -m verl.trainer.main_ppo` raises the same message from our actor config inside Hydra, "
            "which prints `Error executing job with overrides: [...]` and the message wrapped in `Error in call to "
            "target '...TokenselFSDPActorConfig'`, and exits 1; its `--cfg job` prints the config unchecked.") in readme
    assert "the closest one and the fix (exit 2)" not in readme  # it said so of both entry points


def test_the_entry_point_and_the_cpu_distribution_print_one_prefix():
    """Messages start with the command's name, ``verl-tokensel:``, never ``verl_tokensel:``."""
    files = [*sorted((ROOT / "verl_tokensel").rglob("*.py")),
             *sorted((ROOT / "verl-tokensel-cpu" / "verl_tokensel_cpu").rglob("*.py"))]
    old = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"""["'(]verl_tokensel: """, line)]
    assert not old, old
