"""The plugin on every node of a multi-node Ray cluster, simulated on this machine, installed from the wheel.

A head node (127.0.0.1: 2 CPUs, no GPU) and a second node (``ray start --address``, its own loopback IP
127.0.0.2, ports and temp dir, 16 CPUs and 1 logical GPU) form one Ray cluster; both run a venv WITHOUT
verl_tokensel (``import verl_tokensel`` fails there: :func:`helpers.wheel.make_venv`). The job is submitted
with ``examples/multi_node.sh`` (the 80/20 DAPO recipe, CPU-sized), as its header tells a user: the wheel
route (``TOKENSEL_WHEEL``: the runtime env pip-installs the built wheels, the product's and the CPU distribution's,
on each node), the preset, model and
data in ``TOKENSEL_*`` variables, the CPU switch and sizes (:data:`helpers.tiny_recipe.TINY_DAPO_RECIPE_SIZES`)
and the tiny run's settings as overrides (v0 driver, ``gmts``: pre-pass scores at each mini-batch start, top
20% of each prompt group). The job's driver and TaskRunner run on the head; every GPU bundle, so every actor,
rollout and vLLM worker, can only land on the second node.

- ``test_v0_gmts_job_from_the_wheel_on_two_nodes``: the run is correct (both steps, the preset's budget,
  vLLM and actor log-probs equal, parameters changed), and the actor workers on 127.0.0.2 say that they
  received the selecting loss from the package the runtime env installed in the second node's own folder
  (not from the checkout, not from the head's copy).
- ``test_v0_gmts_resumes_from_its_checkpoint``: a second job resumes from the first run's step-1
  checkpoint (``trainer.resume_mode=resume_path``): it logs step 2 only, with the same selection and budget.

About 3.5 minutes on 2 cores (198 s measured): one wheel build (shared with ``test_wheel_on_cpu.py``), two
pipeline runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from helpers.pipeline import (
    FULL_CHECKPOINT,
    check_selecting_run,
    loss_announcements,
    prepare_tiny_run,
    resume_overrides,
    with_overrides,
)
from helpers.scripts import run_script
from helpers.tiny_recipe import TINY_DAPO_RECIPE_SIZES
from helpers.wheel import ROOT, make_venv
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
from verl_tokensel_cpu.launch import start_ray_head

pytestmark = pytest.mark.requires("verl", "ray", "vllm", "build")

RUN_TIMEOUT_S = 600
NODE2_IP = "127.0.0.2"
#: the tiny run's overrides that multi_node.sh takes from the environment instead, as on a real cluster
FROM_ENV = {"actor_rollout_ref.actor.token_selector": "TOKENSEL_SELECTOR",
            "actor_rollout_ref.model.path": "TOKENSEL_MODEL_PATH",
            "data.train_files": "TOKENSEL_TRAIN_FILES", "data.val_files": "TOKENSEL_VAL_FILES"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model_dir(tmp_path_factory.mktemp("mn_model") / "tiny"))


@pytest.fixture(scope="module")
def cluster(built_wheel, built_cpu_wheel, tmp_path_factory):
    """(head, node 2, the nodes' env, a work dir outside the checkout, the two wheels, space-separated)."""
    wheel = f"{built_wheel[0]} {built_cpu_wheel}"
    py, env, cwd, _ = make_venv(tmp_path_factory.mktemp("mn_venv"))
    probe = subprocess.run([str(py), "-c", "import verl_tokensel"], env=env, cwd=str(cwd), capture_output=True)
    assert probe.returncode != 0, "the nodes' venv must not see the checkout's verl_tokensel"
    with start_ray_head(num_cpus=2, num_gpus=0, python=str(py), env=env) as head:
        node = head.add_node(num_cpus=16, num_gpus=1, resources={"tokensel_node2": 1}, node_ip=NODE2_IP)
        yield head, node, {**env, **head.client_env}, cwd, wheel


def _submit(cluster, overrides, log_path):
    """``examples/multi_node.sh`` with the wheel route, the :data:`FROM_ENV` values in its variables and the
    other overrides after the CPU switch and sizes; the environment is the nodes' venv only (no checkout)."""
    head, _, env, cwd, wheel = cluster
    values = dict(o.split("=", 1) for o in overrides)
    job_env = {**env, "RAY_ADDRESS": head.address, "TOKENSEL_WHEEL": wheel,
               **{var: values[key] for key, var in FROM_ENV.items()}}
    rest = [o for o in overrides if o.split("=", 1)[0] not in FROM_ENV]
    return run_script([ROOT / "examples" / "multi_node.sh", "trainer.device=cpu", *TINY_DAPO_RECIPE_SIZES, *rest],
                      env=job_env, inherit_env=False, timeout_s=RUN_TIMEOUT_S, log_path=log_path, cwd=cwd)


@pytest.fixture(scope="module")
def gmts_run(cluster, model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("mn_gmts")
    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector="gmts", use_v1=False, steps=2)
    overrides = with_overrides(overrides, FULL_CHECKPOINT)
    return _submit(cluster, overrides, work / "ray_job.log"), overrides, work


def test_v0_gmts_job_from_the_wheel_on_two_nodes(cluster, gmts_run, model_dir):
    node = cluster[1]
    result, _, work = gmts_run
    log = result.log_path.read_text(errors="replace")
    assert "succeeded" in log, result.describe()
    check_selecting_run(result, model_dir, work / "checkpoints", steps=[1, 2], prefix="actor/tokensel/prepass/")
    said = loss_announcements(log)
    on_node2 = [a for a in said if a["node"] == NODE2_IP]
    assert on_node2, f"no worker on {NODE2_IP} announced the selecting loss: {said}\n{result.describe()}"
    for a in said:
        package = Path(a["package"])
        assert not package.is_relative_to(ROOT), f"a worker used the checkout, not the wheel: {a}"
        assert "runtime_resources" in package.parts and "pip" in package.parts, a
    for a in on_node2:
        assert a["selector"] == "gmts", a
        # installed by the runtime env in the second node's own folder, i.e. on that node
        assert Path(a["package"]).is_relative_to(node.temp_dir), (a, node.temp_dir)
    # the composed config (Hydra's copy, from the job's driver): the recipe's DAPO with TOKENSEL_SELECTOR's preset
    cfg = yaml.safe_load((work / "hydra" / ".hydra" / "config.yaml").read_text())
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["token_selector"] == "gmts" and actor["clip_ratio_high"] == 0.28, actor
    assert cfg["reward"]["reward_manager"]["name"] == "dapo", cfg["reward"]
    print(f"{len(on_node2)} worker(s) on {NODE2_IP} run the wheel's selecting loss: {on_node2}")


@pytest.mark.slow  # ~100 s on top of the two-node job; the default suite's resume is test_e2e_on_cpu.py::
# test_random_draws_after_resume_equal_an_uninterrupted_run (the V1 driver's resume, checked against an uninterrupted
# run); the v0 resume with gmts's pre-pass runs here only (-m slow); the two-node job stays in the default suite
def test_v0_gmts_resumes_from_its_checkpoint(cluster, gmts_run, model_dir, tmp_path):
    first, overrides, work = gmts_run
    first.raise_for_status()
    resumed_dir = tmp_path / "checkpoints"
    overrides = resume_overrides(overrides, work / "checkpoints" / "global_step_1", tmp_path)
    result = _submit(cluster, overrides, tmp_path / "resume.log")
    log = result.log_path.read_text(errors="replace")
    # continues at step 2 only, with the same selection: the pre-pass budget of gmts
    check_selecting_run(result, model_dir, resumed_dir, steps=[2], prefix="actor/tokensel/prepass/")
    before = {k: v for k, v in first.steps[1].items() if k.startswith("actor/tokensel/prepass/") and "fraction" in k}
    after = {k: v for k, v in result.steps[0].items() if k.startswith("actor/tokensel/prepass/") and "fraction" in k}
    assert before.keys() == after.keys(), (before, after)
    assert {a["selector"] for a in loss_announcements(log)} == {"gmts"}
