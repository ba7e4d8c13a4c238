"""The product wheel next to a plain ``pip install torch==2.13.0 verl==0.9.1 'transformers<5.11'``: the README's
"Next to your own verl", without the CPU distribution's stack (no uvicorn, fastapi, TransferQueue, cachetools,
vLLM, Megatron), which the other wheel tests install beside the wheel.

- ``verl-tokensel env`` exits 0 with the plugin loaded and a line naming the packages verl needs to run;
- both entry points' ``--cfg job`` compose the FSDP and Megatron configs and a recipe with the key;
- a run names the missing packages and their install command in one line (exit 2), before any traceback;
- ``token_selector=gmtss`` without the micro-batch overrides gets our error ("did you mean gmts?"), not verl's
  micro-batch assertion.

Two venvs run the same checks:

- default: the wheel in a venv whose dependencies are exactly the requirement closure of ``verl``, ``torch`` and
  ``transformers`` in this run's pinned stack (:func:`helpers.wheel.requirement_closure`, the same 124
  distributions that ``pip install torch==2.13.0 verl==0.9.1 'transformers<5.11'`` installs, linked, not
  copied): no download, 35-55 s of commands on 2 cores;
- ``slow``: that ``pip install`` itself into a fresh venv (101 s in all from a warm pip cache on 2 cores, the
  install alone 64 s; minutes and ~1.9 GB from a cold cache, and it needs the package index), so it stays out of
  the default suite; the default test above runs the same commands on the same set of packages.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.wheel import ROOT, make_venv

SEL = "actor_rollout_ref.actor.token_selector"
RECIPE_ENV = {"TOKENSEL_MODEL_PATH": "/models/Qwen2.5-Math-7B", "TOKENSEL_TRAIN_FILES": "/data/train.parquet",
              "TOKENSEL_VAL_FILES": "/data/val.parquet"}
#: verl imports these to run; `pip install verl` does not install them (its verl-core extra)
RUN_PACKAGES = ("uvicorn", "fastapi", "cachetools", "TransferQueue")


def _run(venv, argv, rc=0, extra_env=None, timeout=300):
    py, env, cwd, _ = venv
    res = subprocess.run([str(py) if a == "PY" else a for a in argv], capture_output=True, text=True,
                         timeout=timeout, env={**env, **(extra_env or {})}, cwd=str(cwd))
    assert res.returncode == rc, (f"{shlex.join(argv)} -> {res.returncode} (want {rc})\n"
                                  f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def check_product_next_to_verl(venv) -> None:
    py, _, _, site = venv
    # the venv is what it should be: the wheel, verl, no CPU distribution and none of the run packages
    probe = ("import importlib.util as u, verl_tokensel; print(verl_tokensel.__file__); print(' '.join(m for m in "
             "('verl_tokensel_cpu', 'uvicorn', 'fastapi', 'transfer_queue', 'vllm', 'megatron') if u.find_spec(m)))")
    out = _run(venv, ["PY", "-c", probe]).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1:] in ([], [""]), out

    env = _run(venv, ["verl-tokensel", "env"])
    assert re.search(r"^verl +0\.9\.1$", env.stdout, flags=re.M), env.stdout
    assert re.search(r"^verl plugin +loaded$", env.stdout, flags=re.M), env.stdout
    assert re.search(r"^trainer modes +not registered here: verl's V1 trainer needs TransferQueue", env.stdout,
                     flags=re.M), env.stdout
    assert re.search(rf"^run packages +missing {', '.join(RUN_PACKAGES)} .*python -m pip install "
                     rf"{' '.join(RUN_PACKAGES)}$", env.stdout, flags=re.M), env.stdout
    assert "broken environment" not in env.stdout + env.stderr and "Traceback" not in env.stderr, env.stdout

    # --cfg job: our entry point (FSDP config, a recipe), verl's (the Megatron config)
    out = _run(venv, ["PY", "-m", "verl_tokensel.main_ppo", "--cfg", "job", f"{SEL}=forking"]).stdout
    assert re.search(r"^    token_selector: forking$", out, flags=re.M) and "strategy: fsdp" in out, out[-2000:]
    out = _run(venv, ["PY", "-m", "verl.trainer.main_ppo", "--config-path=pkg://verl_tokensel.config",
                      "--config-name=tokensel_megatron_trainer", "--cfg", "job", f"{SEL}=gmts"]).stdout
    assert re.search(r"^    token_selector: gmts$", out, flags=re.M) and "strategy: megatron" in out, out[-2000:]
    out = _run(venv, ["PY", "-m", "verl_tokensel.main_ppo", "--config-path=pkg://verl_tokensel.recipes",
                      "--config-name=gmts_qwen2.5_math_7b_dapo", "--cfg", "job"], extra_env=RECIPE_ENV).stdout
    assert re.search(r"^    token_selector: gmts$", out, flags=re.M), out[-2000:]

    # a run: one line naming what verl needs and the install command, before Ray and before any traceback
    res = _run(venv, ["PY", "-m", "verl_tokensel.main_ppo", f"{SEL}=gmts",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"], rc=2)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("verl-tokensel:")]
    assert len(lines) == 1 and f"python -m pip install {' '.join(RUN_PACKAGES)}" in lines[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "ray init kwargs" not in res.stdout + res.stderr, res.stderr[-3000:]

    # a misspelt preset without verl's micro-batch overrides: our error first, one line with the closest name, exit 2
    res = _run(venv, ["PY", "-m", "verl_tokensel.main_ppo", f"{SEL}=gmtss"], rc=2)
    assert "verl-tokensel: actor_rollout_ref.actor.token_selector='gmtss' is invalid (did you mean gmts?)" in \
        res.stderr, res.stderr[-3000:]
    assert "ppo_micro_batch_size" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


def test_the_wheel_next_to_verl_alone(built_wheel, tmp_path):
    check_product_next_to_verl(make_venv(tmp_path, built_wheel[0], deps_of=("verl", "torch", "transformers")))


@pytest.mark.slow  # a real pip install (network or a warm cache, ~1.9 GB); the default test above runs the same
def test_the_wheel_next_to_a_pip_installed_verl(built_wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", PYTHONNOUSERSITE="1",
               VERL_USE_EXTERNAL_MODULES="", VERL_PLATFORM="", VERL_ENGINE_DEVICE="")
    for argv in (["-m", "pip", "install", "-q", "-U", "pip"],
                 ["-m", "pip", "install", "-q", "torch==2.13.0", "verl==0.9.1", "transformers<5.11"],
                 ["-m", "pip", "install", "-q", "--no-deps", str(built_wheel[0])]):
        res = subprocess.run([str(py), *argv], capture_output=True, text=True, timeout=1800, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()
    work = tmp_path / "work"
    work.mkdir()
    check_product_next_to_verl((py, env, work, Path(site)))


def test_readme_names_the_install_next_to_verl():
    readme = (ROOT / "README.md").read_text()
    assert "pip install build" in readme and "pip install torch==2.13.0 verl==0.9.1 'transformers<5.11'" in readme
