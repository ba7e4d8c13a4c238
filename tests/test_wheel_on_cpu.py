"""The release wheel is the product: built as a release builds it, installed non-editable into its own
environment, alone (without the CPU distribution), and used from a directory outside the checkout.

- ``python -m build`` makes the sdist and, from it, the wheel (so the sdist is complete too);
- the wheel's file list equals the package tree (every tracked file under ``verl_tokensel/`` that the
  package needs at run time: modules, Hydra configs, recipes), with one ``verl.plugins`` entry point and no
  file of the CPU distribution; the CPU distribution's wheel holds ``verl_tokensel_cpu/`` and its entry points;
- a fresh venv gets the product wheel with ``pip install --no-deps``; its third-party dependencies are the
  pinned stack of this test run, shared through a path entry (not a site dir, without this repository's two
  distributions) to save a second 4 GB install;
- from a temp dir: ``verl-tokensel env``, ``python -m verl_tokensel.main_ppo --cfg job`` for the FSDP and
  Megatron configs, verl's stock ``main_ppo`` with ``--config-path=pkg://verl_tokensel.config``, a
  recipe through ``recipes/run.sh`` and through ``pkg://verl_tokensel.recipes``, ``recipes/submit_ray_job.sh``'s
  wheel route; ``trainer.device=cpu`` and ``verl-tokensel demo`` name the CPU distribution they need;
- a second venv with both wheels: ``verl-tokensel cpu-step`` (a real FSDP2 update per preset).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import zipfile
from pathlib import Path

import pytest

from helpers.wheel import CPU_ROOT, CPU_WHEEL_NAME, ROOT, WHEEL_NAME, make_venv
RUNTIME_SUFFIXES = {".py", ".yaml", ".toml"}  # what the package reads at run time


def _package_files(root: Path = ROOT, package: str = "verl_tokensel") -> list[str]:
    """Tracked files of the package (a clean clone's tree; untracked scratch files do not count), relative to
    ``root``, the folder of its distribution."""
    res = subprocess.run(["git", "ls-files", package], cwd=root, capture_output=True, text=True)
    if res.returncode == 0 and res.stdout.strip():
        files = res.stdout.split()
    else:  # not a git checkout (e.g. an unpacked sdist)
        files = [p.relative_to(root).as_posix() for p in (root / package).rglob("*") if p.is_file()
                 and "__pycache__" not in p.parts]
    return sorted(f for f in files if Path(f).suffix in RUNTIME_SUFFIXES)


def _entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    """``{group: {name: value}}`` of the wheel's entry points."""
    import configparser

    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(text)
    return {group: dict(parser[group]) for group in parser.sections()}


@pytest.fixture(scope="module")
def built(built_wheel):
    return built_wheel


@pytest.fixture(scope="module")
def wheel_env(built, tmp_path_factory):
    """A venv with the wheel installed non-editable; returns (python, env vars, a cwd outside the checkout)."""
    return make_venv(tmp_path_factory.mktemp("wheel_venv"), wheel=built[0])


def _run(wheel_env, argv, timeout=300, extra_env=None):
    py, env, cwd, _ = wheel_env
    env = {**env, **(extra_env or {})}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(cwd))
    assert res.returncode == 0, (f"{shlex.join(map(str, argv))} -> {res.returncode}\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def test_wheel_holds_the_whole_package(built):
    wheel, sdist = built
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    in_wheel = sorted(n for n in names if n.startswith("verl_tokensel/"))
    assert in_wheel == _package_files(), (
        f"missing from the wheel: {sorted(set(_package_files()) - set(in_wheel))}; "
        f"not in the package tree: {sorted(set(in_wheel) - set(_package_files()))}")
    assert not [n for n in names if n.startswith("verl_tokensel_cpu")], "the product wheel holds the CPU port"
    # one verl.plugins entry point, the command, nothing of the CPU distribution
    assert _entry_points(wheel) == {"verl.plugins": {"tokensel": "verl_tokensel.plugin"},
                                    "console_scripts": {"verl-tokensel": "verl_tokensel.cli.main:main"}}
    import tarfile

    with tarfile.open(sdist) as tf:
        top = tf.getnames()[0].split("/")[0]
        in_sdist = {n[len(top) + 1:] for n in tf.getnames()}
    assert set(_package_files()) <= in_sdist, sorted(set(_package_files()) - in_sdist)


def test_the_cpu_wheel_holds_the_cpu_distribution(built_cpu_wheel):
    assert built_cpu_wheel.name == CPU_WHEEL_NAME
    with zipfile.ZipFile(built_cpu_wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    in_wheel = sorted(n for n in names if n.startswith("verl_tokensel_cpu/"))
    assert in_wheel == _package_files(CPU_ROOT, "verl_tokensel_cpu"), in_wheel
    assert not [n for n in names if n.startswith("verl_tokensel/")], "the CPU wheel holds the product"
    import verl_tokensel

    assert f"Requires-Dist: verl-tokensel=={verl_tokensel.__version__}" in meta, meta[:2000]
    assert _entry_points(built_cpu_wheel) == {
        "verl.plugins": {"tokensel_cpu": "verl_tokensel_cpu.plugin"},
        "verl_tokensel.device_ports": {"cpu": "verl_tokensel_cpu.pipeline:apply_cpu_pipeline"},
        "verl_tokensel.commands": {"cpu-step": "verl_tokensel_cpu.cli.cpu_step", "demo": "verl_tokensel_cpu.cli.demo",
                                   "tiny-model": "verl_tokensel_cpu.cli.tiny_model"}}


def test_both_wheels_and_the_sdist_carry_the_license(built, built_cpu_wheel):
    """The Apache-2.0 text that setup.cfg's ``license`` names: at the repository root, in the CPU distribution's
    folder (its own build root; the same text), in both wheels' dist-info and in the sdist."""
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"], text[:200]
    assert "END OF TERMS AND CONDITIONS" in text
    assert (CPU_ROOT / "LICENSE").read_text() == text
    for wheel in (built[0], built_cpu_wheel):
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
            assert len(names) == 1, (wheel.name, zf.namelist()[-10:])
            assert zf.read(names[0]).decode() == text
            meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-File: LICENSE" in meta and "Apache-2.0" in meta, meta[:1500]
    import tarfile

    with tarfile.open(built[1]) as tf:
        assert any(n.endswith("/LICENSE") and n.count("/") == 1 for n in tf.getnames())


def test_wheel_env_imports_the_wheel_not_the_checkout(wheel_env):
    py, _, _, site = wheel_env
    code = ("import json, importlib.metadata as m, verl_tokensel; "
            "d = m.distribution('verl-tokensel'); "
            "print(json.dumps({'file': verl_tokensel.__file__, 'dist': str(d._path), "
            "'plugin': [str(e.value) for e in m.entry_points(group='verl.plugins') if e.name == 'tokensel']}))")
    info = json.loads(_run(wheel_env, [str(py), "-c", code]).stdout)
    assert Path(info["file"]).is_relative_to(site), info
    assert Path(info["dist"]).is_relative_to(site) and info["plugin"] == ["verl_tokensel.plugin"], info
    code = ("import json, importlib.util as u, importlib.metadata as m; print(json.dumps({"
            "'cpu': u.find_spec('verl_tokensel_cpu') is not None, "
            "'ours': sorted(e.name for e in m.entry_points(group='verl.plugins') if e.name.startswith('tokensel')), "
            "'ports': [e.name for e in m.entry_points(group='verl_tokensel.device_ports')]}))")
    info = json.loads(_run(wheel_env, [str(py), "-c", code]).stdout)
    assert info == {"cpu": False, "ours": ["tokensel"], "ports": []}, info  # the product alone


def test_the_product_alone_names_the_cpu_distribution_it_lacks(wheel_env):
    py, env, cwd, _ = wheel_env
    for argv in ([str(py), "-m", "verl_tokensel.main_ppo", "trainer.device=cpu",
                  "actor_rollout_ref.actor.token_selector=gmts"], ["verl-tokensel", "demo"]):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=str(cwd))
        assert res.returncode == 2, (argv, res.returncode, res.stderr[-3000:])
        assert "verl-tokensel-cpu" in res.stderr and "scripts/install_cpu.sh" in res.stderr, res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]


def test_env_from_the_wheel(wheel_env):
    out = _run(wheel_env, ["verl-tokensel", "env"]).stdout
    assert re.search(r"^verl plugin +loaded$", out, flags=re.M), out
    assert re.search(r"^trainer modes +tokensel_sync, tokensel_colocate_async, tokensel_separate_async$", out,
                     flags=re.M), out


@pytest.mark.parametrize("config_name,strategy", [("tokensel_trainer", "fsdp"),
                                                  ("tokensel_megatron_trainer", "megatron")])
def test_main_ppo_composes_from_the_wheel(wheel_env, config_name, strategy):
    py = wheel_env[0]
    out = _run(wheel_env, [str(py), "-m", "verl_tokensel.main_ppo", f"--config-name={config_name}", "--cfg", "job",
                           "actor_rollout_ref.actor.token_selector=gmts"]).stdout
    assert re.search(r"^    token_selector: gmts$", out, flags=re.M), out[-2000:]
    assert re.search(rf"^    strategy: {strategy}", out, flags=re.M), out[-2000:]
    assert "trainer_mode: tokensel_sync" in out


def test_stock_main_ppo_with_our_config_from_the_wheel(wheel_env):
    py = wheel_env[0]
    out = _run(wheel_env, [str(py), "-m", "verl.trainer.main_ppo", "--config-path=pkg://verl_tokensel.config",
                           "--config-name=tokensel_trainer", "--cfg", "job",
                           "actor_rollout_ref.actor.token_selector=gmts"]).stdout
    assert re.search(r"^    token_selector: gmts$", out, flags=re.M), out[-2000:]
    # our actor config class
    assert re.search(r"^    _target_: verl_tokensel\.\S+_actor_config$", out, flags=re.M), out[-2000:]


RECIPE_ENV = {"TOKENSEL_MODEL_PATH": "/models/Qwen3-14B-Base", "TOKENSEL_TRAIN_FILES": "/data/train.parquet",
              "TOKENSEL_VAL_FILES": "/data/val.parquet"}


def test_recipe_from_the_wheel(wheel_env):
    py = wheel_env[0]
    out = _run(wheel_env, ["bash", str(ROOT / "recipes" / "run.sh"), "dapo_qwen3_14b", "gmts", "--cfg", "job"],
               extra_env={**RECIPE_ENV, "TOKENSEL_PYTHON": str(py)}).stdout
    assert re.search(r"^    token_selector: gmts$", out, flags=re.M), out[-2000:]
    assert re.search(r"^  experiment_name: dapo_qwen3_14b_\$\{actor_rollout_ref.actor.token_selector\}$", out,
                     flags=re.M), out[-2000:]  # the recipe's own trainer block (--cfg job does not resolve)
    out = _run(wheel_env, [str(py), "-m", "verl_tokensel.main_ppo", "--config-path=pkg://verl_tokensel.recipes",
                           "--config-name=gmts_qwen2.5_math_7b_dapo", "--cfg", "job"], extra_env=RECIPE_ENV).stdout
    assert re.search(r"^    token_selector: gmts$", out, flags=re.M), out[-2000:]


@pytest.fixture(scope="module")
def cpu_env(built, built_cpu_wheel, tmp_path_factory):
    """A venv with both wheels installed non-editable (the product and the CPU distribution)."""
    return make_venv(tmp_path_factory.mktemp("cpu_wheel_venv"), built[0], built_cpu_wheel)


def test_cpu_step_from_the_two_wheels(cpu_env):
    res = _run(cpu_env, ["verl-tokensel", "cpu-step", "--workdir", str(cpu_env[2] / "cache")], timeout=600)
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) +([0-9.]+) ", res.stdout, flags=re.M)}
    assert rows.get("none") == 1.0, res.stdout
    for preset in ("forking", "random", "gmts", "grad_norm"):
        assert 0.19 <= rows[preset] <= 0.25, (preset, res.stdout)
    assert 0.79 <= rows["forking_bottom"] <= 0.85, res.stdout


def test_submit_ray_job_from_the_wheel_to_a_local_head(wheel_env):
    """recipes/submit_ray_job.sh (image route: the plugin is already installed on the node, here the wheel
    venv the head runs in) submits a recipe to a real Ray head; the job's working dir holds only run.sh, so
    the job can only have found the wheel-installed package."""
    from verl_tokensel_cpu.launch import start_ray_head

    py, env, cwd, _ = wheel_env
    with start_ray_head(num_cpus=2, num_gpus=0, python=str(py), env=env) as head:
        res = _run(wheel_env, ["bash", str(ROOT / "recipes" / "submit_ray_job.sh"), "dapo_qwen3_14b", "forking",
                               "--cfg", "job"], timeout=300,
                   extra_env={**RECIPE_ENV, **head.client_env, "RAY_ADDRESS": head.address, "TOKENSEL_PIP": ""})
    assert re.search(r"^    token_selector: forking$", res.stdout, flags=re.M), res.stdout[-3000:]
    assert "succeeded" in res.stdout, res.stdout[-3000:]


def test_submit_ray_job_wheel_route(built, wheel_env):
    wheel, _ = built
    res = _run(wheel_env, ["bash", str(ROOT / "recipes" / "submit_ray_job.sh"), "dapo_qwen3_14b", "forking"],
               extra_env={**RECIPE_ENV, "RAY_ADDRESS": "http://127.0.0.1:8265", "TOKENSEL_WHEEL": str(wheel),
                          "TOKENSEL_DRY_RUN": "1"})
    argv = shlex.split(res.stdout.strip())
    assert argv[:4] == ["ray", "job", "submit", "--address"]
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    assert runtime_env["pip"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}/" + WHEEL_NAME]
    assert runtime_env["env_vars"] == RECIPE_ENV
    assert argv[argv.index("--") + 1:] == ["bash", "run.sh", "dapo_qwen3_14b", "forking"]
