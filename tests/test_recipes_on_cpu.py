"""Recipes (package data under verl_tokensel/recipes/, launch scripts under recipes/): every recipe x every
preset composes, resolves and passes verl's own
validate_config and our driver check; the paper hyperparameters are what the recipes claim; a
missing env var is a clear error (Hydra and run.sh); every YAML key has a comment; scripts parse."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl_tokensel.core.config import PRESETS
from verl_tokensel.verl_glue.install import validate_driver_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "verl_tokensel" / "recipes"  # the recipe YAMLs, shipped in the wheel
SCRIPTS = ROOT / "recipes"  # run.sh, submit_ray_job.sh
ENV_VARS = ("TOKENSEL_MODEL_PATH", "TOKENSEL_TRAIN_FILES", "TOKENSEL_VAL_FILES")
DAPO_8020 = ["dapo_qwen3_8b", "dapo_qwen3_14b", "dapo_qwen3_32b"]
GMTS = [f"gmts_qwen2.5_math_{s}_{a}" for s in ("1.5b", "7b") for a in ("dapo", "grpo")]
ALL = DAPO_8020 + GMTS
SEL = "actor_rollout_ref.actor.token_selector"


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("TOKENSEL_MODEL_PATH", "/dummy/model")
    monkeypatch.setenv("TOKENSEL_TRAIN_FILES", "/dummy/train.parquet")
    monkeypatch.setenv("TOKENSEL_VAL_FILES", "/dummy/val.parquet")


@functools.lru_cache(maxsize=None)
def _compose_cached(name, overrides):
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(name, overrides=list(overrides))


def _compose(name, overrides=()):
    """Hydra compose (cached: composition is the slow part; env vars resolve lazily, per copy)."""
    return copy.deepcopy(_compose_cached(name, tuple(overrides)))


def test_recipe_set_is_complete():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(ALL)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", ALL)
def test_recipe_composes_and_validates(env, name, preset):
    cfg = _compose(name, [f"{SEL}={preset}"])
    OmegaConf.resolve(cfg)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    validate_driver_config(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.selection == PRESETS[preset]
    assert cfg.actor_rollout_ref.model.path == "/dummy/model"
    assert cfg.data.train_files == "/dummy/train.parquet" and cfg.data.val_files == "/dummy/val.parquet"
    assert cfg.trainer.v1.trainer_mode == "tokensel_sync"
    assert cfg.trainer.experiment_name.endswith(f"_{preset}")


@pytest.mark.parametrize("name,default", [(n, "forking") for n in DAPO_8020] + [(n, "gmts") for n in GMTS])
def test_default_preset(env, name, default):
    cfg = _compose(name)
    assert cfg.actor_rollout_ref.actor.token_selector == default
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).selection == PRESETS[default]


def _common_dapo_grpo(cfg):
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.use_kl_in_reward is False and a.use_kl_loss is False
    assert not need_reference_policy(cfg) and not need_critic(cfg)
    assert a.entropy_coeff == 0 and a.clip_ratio_low == 0.2 and a.clip_ratio_c == 10.0
    assert a.loss_agg_mode == "token-mean" and a.use_dynamic_bsz is True
    assert a.optim.lr == 1e-6 and a.optim.lr_warmup_steps == 10 and a.optim.weight_decay == 0.1
    assert a.optim.clip_grad == 1.0 and a.grad_clip == 1.0
    assert a.ppo_mini_batch_size == 32 and cfg.data.train_batch_size == 512
    assert r.n == 16 and r.temperature == 1.0 and r.val_kwargs.top_p == 0.7 and r.val_kwargs.do_sample


@pytest.mark.parametrize("name", DAPO_8020)
def test_8020_paper_hyperparameters(env, name):
    cfg = _compose(name)
    OmegaConf.resolve(cfg)
    _common_dapo_grpo(cfg)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert a.clip_ratio_high == 0.28
    assert cfg.data.max_prompt_length == 2048 and cfg.data.max_response_length == 20480
    assert cfg.data.gen_batch_size == 1536
    fg = cfg.algorithm.filter_groups
    assert fg.enable is True and fg.metric == "acc" and fg.max_num_gen_batches == 10
    assert cfg.reward.reward_manager.name == "dapo"
    kw = cfg.reward.reward_kwargs
    assert kw.max_resp_len == cfg.data.max_response_length
    assert kw.overlong_buffer_cfg.enable is True and kw.overlong_buffer_cfg.len == 4096
    assert kw.overlong_buffer_cfg.penalty_factor == 1.0
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    assert r.name == "vllm" and cfg.trainer.n_gpus_per_node == 8
    assert a.ppo_max_token_len_per_gpu >= cfg.data.max_prompt_length + cfg.data.max_response_length


def test_8020_only_layout_scales_with_size():
    layout_keys = [("trainer", "nnodes"), ("trainer", "experiment_name"),
                   ("actor_rollout_ref", "actor", "fsdp_config", "ulysses_sequence_parallel_size"),
                   ("actor_rollout_ref", "ref", "fsdp_config", "ulysses_sequence_parallel_size"),
                   ("actor_rollout_ref", "rollout", "tensor_model_parallel_size")]
    layouts, bodies = {}, {}
    for name in DAPO_8020:
        node = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
        layout = []
        for keys in layout_keys:
            parent = node
            for k in keys[:-1]:
                parent = parent[k]
            layout.append(parent.pop(keys[-1]))
        layouts[name], bodies[name] = layout, node
    assert layouts["dapo_qwen3_14b"][0] == 16 and layouts["dapo_qwen3_14b"][2:] == [8, 8, 4]  # paper's 14B layout
    assert bodies["dapo_qwen3_8b"] == bodies["dapo_qwen3_14b"] == bodies["dapo_qwen3_32b"]


@pytest.mark.parametrize("name", GMTS)
def test_gmts_setups(env, name):
    cfg = _compose(name)
    OmegaConf.resolve(cfg)
    _common_dapo_grpo(cfg)
    a = cfg.actor_rollout_ref.actor
    dapo = name.endswith("_dapo")
    assert a.clip_ratio_high == (0.28 if dapo else 0.2)
    assert cfg.algorithm.filter_groups.enable is dapo
    assert cfg.reward.reward_manager.name == ("dapo" if dapo else "naive")
    assert cfg.data.max_prompt_length + cfg.data.max_response_length <= 4096  # Qwen2.5-Math context
    if dapo:
        kw = cfg.reward.reward_kwargs
        assert kw.max_resp_len == cfg.data.max_response_length
        assert 0 < kw.overlong_buffer_cfg.len < kw.max_resp_len


def test_recipes_inline_tokensel_trainer():
    """Hydra refuses tokensel_trainer as a non-primary default (it sets hydra.searchpath), so the
    recipes inline it; keep them in sync with it."""
    base = yaml.safe_load((ROOT / "verl_tokensel" / "config" / "tokensel_trainer.yaml").read_text())
    for name in ALL:
        node = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
        assert node["defaults"] == base["defaults"], name
        assert set(base["hydra"]["searchpath"]) <= set(node["hydra"]["searchpath"]), name
        assert "pkg://verl_tokensel.config" in node["hydra"]["searchpath"], name
        assert node["trainer"]["v1"]["trainer_mode"] == base["trainer"]["v1"]["trainer_mode"], name


@pytest.mark.parametrize("var", ENV_VARS)
def test_missing_env_var_names_it_when_resolving(env, monkeypatch, var):
    monkeypatch.delenv(var)
    cfg = _compose("dapo_qwen3_14b", [f"{SEL}=forking"])
    with pytest.raises(Exception, match=var):
        OmegaConf.resolve(cfg)


@pytest.mark.parametrize("var", ENV_VARS)
def test_run_sh_missing_env_var(var):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSEL_")}
    env.update({k: f"/dummy/{k}" for k in ENV_VARS if k != var})
    # a python that would fail loudly if reached: nothing may start before the env check
    env["TOKENSEL_PYTHON"] = "/nonexistent/python-must-not-run"
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "dapo_qwen3_14b", "forking"],
                         capture_output=True, text=True, timeout=30, env=env, cwd=str(ROOT))
    assert res.returncode != 0
    assert var in res.stderr
    assert "must-not-run" not in res.stderr
    assert all(k not in res.stderr for k in ENV_VARS if k != var)


def test_run_sh_unknown_recipe_and_usage():
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh")], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "usage" in res.stderr
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "no_such_recipe", "forking"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "no_such_recipe" in res.stderr


@pytest.mark.parametrize("name", ALL)
def test_every_key_has_a_comment(name):
    path = RECIPES / f"{name}.yaml"
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "-")) and ":" in stripped:
            assert i > 0 and lines[i - 1].strip().startswith("#"), f"{path.name}:{i + 1} key without a comment: {line}"


@pytest.mark.parametrize("script", ["run.sh", "submit_ray_job.sh"])
def test_scripts_parse(script):
    res = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_scripts_hold_no_secrets():
    for path in SCRIPTS.glob("*.sh"):
        text = path.read_text()
        for needle in ("API_KEY=", "TOKEN=", "SECRET", "PASSWORD"):
            assert needle not in text, f"{path.name} contains {needle}"
