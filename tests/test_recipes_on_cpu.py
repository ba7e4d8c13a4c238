"""Recipes (package data under verl_tokensel/recipes/, launch scripts under recipes/): every recipe x every
preset composes, resolves and passes verl's own
validate_config and our driver check; the paper hyperparameters are what the recipes claim; a
missing env var is a clear error (Hydra and run.sh); every YAML key has a comment; scripts parse.
The Megatron recipes (``<fsdp recipe>_megatron``) hold their FSDP twin's hyperparameters with the same
"paper" / "chosen" marks, and a Megatron layout that fits the model (TP divides its heads and KV heads) and
the cluster (TP x PP x CP divides the GPUs), with verl's GPU engine defaults."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import sys
import subprocess
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl_tokensel.core.config import PRESETS
from verl_tokensel.verl_glue.actor_config import TokenselFSDPActorConfig, TokenselMcoreActorConfig
from verl_tokensel.verl_glue.install import validate_driver_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "verl_tokensel" / "recipes"  # the recipe YAMLs, shipped in the wheel
SCRIPTS = ROOT / "recipes"  # run.sh, submit_ray_job.sh
ENV_VARS = ("TOKENSEL_MODEL_PATH", "TOKENSEL_TRAIN_FILES", "TOKENSEL_VAL_FILES")
DAPO_8020 = ["dapo_qwen3_8b", "dapo_qwen3_14b", "dapo_qwen3_32b"]  # FSDP engine
GMTS = [f"gmts_qwen2.5_math_{s}_{a}" for s in ("1.5b", "7b") for a in ("dapo", "grpo")]  # FSDP engine
FSDP = DAPO_8020 + GMTS
MEGATRON = [f"{n}_megatron" for n in FSDP]  # each FSDP recipe's Megatron twin
TWIN = dict(zip(MEGATRON, FSDP))
DAPO_8020_ALL = DAPO_8020 + [f"{n}_megatron" for n in DAPO_8020]
GMTS_ALL = GMTS + [f"{n}_megatron" for n in GMTS]
ALL = FSDP + MEGATRON
SEL = "actor_rollout_ref.actor.token_selector"

# (attention heads, KV heads, layers) of each recipe's model: num_attention_heads, num_key_value_heads and
# num_hidden_layers of the model's config.json on Hugging Face (Qwen/Qwen3-8B, Qwen/Qwen3-14B, Qwen/Qwen3-32B,
# whose -Base checkpoints share the architecture; Qwen/Qwen2.5-Math-1.5B, Qwen/Qwen2.5-Math-7B).
MODEL_SHAPES = {
    "qwen3_8b": (32, 8, 36),
    "qwen3_14b": (40, 8, 40),
    "qwen3_32b": (64, 8, 64),
    "qwen2.5_math_1.5b": (12, 2, 28),
    "qwen2.5_math_7b": (28, 4, 28),
}

# Keys only one engine has: FSDP's engine block, its strategy-level grad_clip (Megatron clips with
# optim.clip_grad only), HF gradient checkpointing (Megatron recomputes per megatron.override_transformer_config)
# and the reference model's Ulysses size (megatron_ref follows the actor's TP/PP/CP); Megatron's engine block.
FSDP_ONLY = ("actor_rollout_ref.actor.fsdp_config.", "actor_rollout_ref.ref.", "actor_rollout_ref.actor.grad_clip",
             "actor_rollout_ref.model.enable_gradient_checkpointing")
MEGATRON_ONLY = ("actor_rollout_ref.actor.megatron.",)
NAMED = ("defaults", "trainer.experiment_name")  # differ by config / recipe name (checked on their own)
# What a Megatron recipe may set in actor.megatron: the layout and memory keys; everything else (attention
# backend, Megatron-Bridge, dtype, ...) stays verl's GPU default, never the CPU test bed's settings.
MEGATRON_RECIPE_KEYS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                        "sequence_parallel", "use_distributed_optimizer", "param_offload", "optimizer_offload",
                        "override_transformer_config"}
RECOMPUTE_KEYS = {"recompute_granularity", "recompute_method", "recompute_num_layers"}
VERL_MEGATRON_YAML = Path(verl.__file__).parent / "trainer" / "config" / "engine" / "megatron.yaml"  # verl's defaults
SNAPSHOT = ROOT / "tests" / "data" / "recipes_composed.json"
DUMMY_ENV = {"TOKENSEL_MODEL_PATH": "/dummy/model", "TOKENSEL_TRAIN_FILES": "/dummy/train.parquet",
             "TOKENSEL_VAL_FILES": "/dummy/val.parquet"}
ABSENT = "<absent>"  # a trainer key the recipe does not have


@pytest.fixture
def env(monkeypatch):
    for var, value in DUMMY_ENV.items():
        monkeypatch.setenv(var, value)


@functools.lru_cache(maxsize=None)
def _compose_cached(name, overrides):
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(name, overrides=list(overrides))


def _compose(name, overrides=()):
    """Hydra compose (cached: composition is the slow part; env vars resolve lazily, per copy)."""
    return copy.deepcopy(_compose_cached(name, tuple(overrides)))


def _with_preset(name, preset):
    """The recipe with ``token_selector=preset``: one composition per recipe, the preset set on a copy (the
    same config as the command-line override, see test_preset_on_a_copy_equals_the_hydra_override)."""
    cfg = _compose(name)
    OmegaConf.update(cfg, SEL, preset)
    return cfg


def _resolved(name):
    cfg = _compose(name)
    OmegaConf.resolve(cfg)
    return cfg


def _flat(node, prefix=""):
    """{dotted key: leaf value} of a raw YAML mapping."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _comments(name):
    """{dotted key: the first line of the comment above it} of a recipe YAML (block style, 2-space indents)."""
    out, stack = {}, []
    lines = (RECIPES / f"{name}.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if s and not s.startswith(("#", "-")) and ":" in s:
            depth = (len(line) - len(line.lstrip())) // 2
            del stack[depth:]
            stack.append(s.split(":", 1)[0])
            first = i - 1
            while first > 0 and lines[first - 1].strip().startswith("#"):
                first -= 1
            out[".".join(stack)] = lines[first].strip()
    return out


def _mark(comment):
    """``paper`` / ``chosen`` / None: how a value's comment says where it comes from."""
    m = re.match(r"# (paper|chosen)\b", comment)
    return m.group(1) if m else None


def _model(name):
    return re.search(r"qwen3_\d+b|qwen2\.5_math_[\d.]+b", name).group(0)


def test_recipe_set_is_complete():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(ALL)


@pytest.mark.parametrize("name", ["dapo_qwen3_14b", "gmts_qwen2.5_math_7b_dapo_megatron"])
def test_preset_on_a_copy_equals_the_hydra_override(env, name):
    hydra_cfg = _compose(name, [f"{SEL}=random"])
    assert OmegaConf.to_container(hydra_cfg, resolve=True) == OmegaConf.to_container(
        _with_preset(name, "random"), resolve=True)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", ALL)
def test_recipe_composes_and_validates(env, name, preset):
    cfg = _with_preset(name, preset)
    OmegaConf.resolve(cfg)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    validate_driver_config(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    megatron = name in MEGATRON
    assert cfg.model_engine == ("megatron" if megatron else "dp")
    assert type(actor) is (TokenselMcoreActorConfig if megatron else TokenselFSDPActorConfig)
    assert actor.selection == PRESETS[preset]
    assert cfg.actor_rollout_ref.model.path == "/dummy/model"
    assert cfg.data.train_files == "/dummy/train.parquet" and cfg.data.val_files == "/dummy/val.parquet"
    assert cfg.trainer.v1.trainer_mode == "tokensel_sync"
    assert cfg.trainer.experiment_name.endswith(f"_{preset}")


@pytest.mark.parametrize("name,default", [(n, "forking") for n in DAPO_8020_ALL] + [(n, "gmts") for n in GMTS_ALL])
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
    # Megatron clips with optim.clip_grad only; FSDP's strategy-level grad_clip must agree with it
    assert a.optim.clip_grad == 1.0 and a.get("grad_clip", 1.0) == 1.0
    assert ("grad_clip" in a) is (cfg.model_engine == "dp")
    assert a.ppo_mini_batch_size == 32 and cfg.data.train_batch_size == 512
    assert r.n == 16 and r.temperature == 1.0 and r.val_kwargs.top_p == 0.7 and r.val_kwargs.do_sample


@pytest.mark.parametrize("name", DAPO_8020_ALL)
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


@pytest.mark.parametrize("suffix", ["", "_megatron"])
def test_8020_only_layout_scales_with_size(suffix):
    engine_keys = ([("actor_rollout_ref", "actor", "megatron")] if suffix else
                   [("actor_rollout_ref", "actor", "fsdp_config", "ulysses_sequence_parallel_size"),
                    ("actor_rollout_ref", "ref", "fsdp_config", "ulysses_sequence_parallel_size")])
    layout_keys = [("trainer", "nnodes"), ("trainer", "experiment_name"),
                   ("actor_rollout_ref", "rollout", "tensor_model_parallel_size")] + engine_keys
    layouts, bodies = {}, {}
    for name in DAPO_8020:
        node = yaml.safe_load((RECIPES / f"{name}{suffix}.yaml").read_text())
        layout = []
        for keys in layout_keys:
            parent = node
            for k in keys[:-1]:
                parent = parent[k]
            layout.append(parent.pop(keys[-1]))
        layouts[name], bodies[name] = layout, node
    assert layouts["dapo_qwen3_14b"][0] == 16 and layouts["dapo_qwen3_14b"][2] == 4  # paper: 16 nodes, vLLM TP 4
    if not suffix:
        assert layouts["dapo_qwen3_14b"][3:] == [8, 8]  # paper: Ulysses SP 8
    assert bodies["dapo_qwen3_8b"] == bodies["dapo_qwen3_14b"] == bodies["dapo_qwen3_32b"]


@pytest.mark.parametrize("name", GMTS_ALL)
def test_gmts_setups(env, name):
    cfg = _compose(name)
    OmegaConf.resolve(cfg)
    _common_dapo_grpo(cfg)
    a = cfg.actor_rollout_ref.actor
    dapo = name.removesuffix("_megatron").endswith("_dapo")
    assert a.clip_ratio_high == (0.28 if dapo else 0.2)
    assert cfg.algorithm.filter_groups.enable is dapo
    assert cfg.reward.reward_manager.name == ("dapo" if dapo else "naive")
    assert cfg.data.max_prompt_length + cfg.data.max_response_length <= 4096  # Qwen2.5-Math context
    if dapo:
        kw = cfg.reward.reward_kwargs
        assert kw.max_resp_len == cfg.data.max_response_length
        assert 0 < kw.overlong_buffer_cfg.len < kw.max_resp_len


def test_recipes_inline_tokensel_trainer():
    """Hydra refuses tokensel_trainer (tokensel_megatron_trainer) as a non-primary default (it sets
    hydra.searchpath), so the recipes inline it; keep them in sync with it."""
    for name in ALL:
        config = "tokensel_megatron_trainer" if name in MEGATRON else "tokensel_trainer"
        base = yaml.safe_load((ROOT / "verl_tokensel" / "config" / f"{config}.yaml").read_text())
        node = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
        assert node["defaults"] == base["defaults"], name
        assert set(base["hydra"]["searchpath"]) <= set(node["hydra"]["searchpath"]), name
        assert "pkg://verl_tokensel.config" in node["hydra"]["searchpath"], name
        assert node["trainer"]["v1"]["trainer_mode"] == base["trainer"]["v1"]["trainer_mode"], name


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_twin_has_the_fsdp_hyperparameters(env, name):
    """Same values, same "paper" / "chosen" marks as the FSDP twin outside the engine's own keys; the
    paper's values resolve identically; the Megatron layout is marked chosen."""
    twin = TWIN[name]
    raw = {n: _flat(yaml.safe_load((RECIPES / f"{n}.yaml").read_text())) for n in (name, twin)}
    comments = {n: _comments(n) for n in (name, twin)}

    def shared(n, only):
        return {k: v for k, v in raw[n].items() if not k.startswith(only + NAMED)}

    assert shared(name, MEGATRON_ONLY) == shared(twin, FSDP_ONLY)
    assert raw[name]["trainer.experiment_name"] == raw[twin]["trainer.experiment_name"].replace(twin, name, 1)
    for key, comment in comments[twin].items():
        if key in comments[name]:
            assert _mark(comments[name][key]) == _mark(comment), f"{name}: {key}: {comments[name][key]!r}"
    megatron_keys = [k for k in raw[name] if k.startswith(MEGATRON_ONLY)]
    assert megatron_keys and all(_mark(comments[name][k]) == "chosen" for k in megatron_keys), name
    cfg, twin_cfg = _resolved(name), _resolved(twin)
    paper = [k for k, c in comments[twin].items() if _mark(c) == "paper" and k in raw[twin]
             and not k.startswith(FSDP_ONLY)]
    assert paper or twin.startswith("gmts_")
    for key in paper:
        assert OmegaConf.select(cfg, key) == OmegaConf.select(twin_cfg, key), key


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_layout(env, name):
    cfg = _resolved(name)
    assert cfg.model_engine == "megatron" and cfg.actor_rollout_ref.actor.strategy == "megatron"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, TokenselMcoreActorConfig)
    m = actor.megatron
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    assert gpus % (tp * pp * cp) == 0, (gpus, tp, pp, cp)
    dp = gpus // (tp * pp * cp)
    heads, kv_heads, layers = MODEL_SHAPES[_model(name)]
    assert heads % tp == 0 and kv_heads % tp == 0 and layers % pp == 0, (heads, kv_heads, layers, tp, pp)
    # every data-parallel rank gets whole mini-batches of responses
    n = cfg.actor_rollout_ref.rollout.n
    assert (cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n) % dp == 0
    assert m.sequence_parallel is (tp > 1) and m.use_distributed_optimizer is True
    # context parallelism for the 80/20 recipes' 20k-token responses; Megatron's CP needs packed sequences
    assert (cp > 1) is name.startswith("dapo_qwen3_")
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    # the reference model (used when a KL term is switched on) follows the actor's layout
    ref = cfg.actor_rollout_ref.ref.megatron
    assert (ref.tensor_model_parallel_size, ref.pipeline_model_parallel_size, ref.context_parallel_size) == (tp, pp, cp)
    # verl's GPU engine defaults stay: only layout / memory keys in the recipe, none of the CPU test bed's
    node = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["actor_rollout_ref"]["actor"]["megatron"]
    assert set(node) <= MEGATRON_RECIPE_KEYS, set(node) - MEGATRON_RECIPE_KEYS
    assert set(node.get("override_transformer_config", {})) <= RECOMPUTE_KEYS
    verl = yaml.safe_load(VERL_MEGATRON_YAML.read_text())
    for key in ("use_mbridge", "vanilla_mbridge", "dtype", "use_remove_padding"):
        assert cfg.actor_rollout_ref.actor.megatron[key] == verl[key], key
    transformer = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert set(transformer) <= set(verl["override_transformer_config"]) | RECOMPUTE_KEYS
    assert transformer.attention_backend == verl["override_transformer_config"]["attention_backend"] == "flash"


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


def test_run_sh_knows_the_megatron_recipes():
    # past the recipe check (the installed package lists it), stopped at the first missing env var
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSEL_")}
    env["TOKENSEL_PYTHON"] = sys.executable
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "dapo_qwen3_14b_megatron", "forking"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=str(ROOT))
    assert res.returncode == 2 and "no recipe" not in res.stderr and "TOKENSEL_MODEL_PATH" in res.stderr


def test_run_sh_unknown_recipe_and_usage():
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh")], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "usage" in res.stderr
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "no_such_recipe", "forking"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "no_such_recipe" in res.stderr


@pytest.mark.parametrize("name", ALL)
def test_every_key_has_a_comment(name):
    """A comment line above every key, and a blank line (or the key's list items) after it, as verl's YAMLs."""
    path = RECIPES / f"{name}.yaml"
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "-")) and ":" in stripped:
            assert i > 0 and lines[i - 1].strip().startswith("#"), f"{path.name}:{i + 1} key without a comment: {line}"
            after = lines[i + 1].strip() if i + 1 < len(lines) else ""
            assert not after or after.startswith("- "), f"{path.name}:{i + 2} no blank line after: {line}"


@pytest.mark.parametrize("script", ["run.sh", "submit_ray_job.sh"])
def test_scripts_parse(script):
    res = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_scripts_hold_no_secrets():
    for path in SCRIPTS.glob("*.sh"):
        text = path.read_text()
        for needle in ("API_KEY=", "TOKEN=", "SECRET", "PASSWORD"):
            assert needle not in text, f"{path.name} contains {needle}"


def _leaves(cfg):
    """{dotted key: value} of a composed config, interpolations resolved except ``${oc.env:...}`` (kept as written)."""
    def walk(raw, res, prefix):
        for k, r in raw.items():
            if isinstance(r, dict) and r:
                yield from walk(r, res[k], f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", r if isinstance(r, str) and "${oc.env:" in r else res[k]
    return dict(walk(OmegaConf.to_container(cfg), OmegaConf.to_container(cfg, resolve=True), ""))


@functools.lru_cache(maxsize=None)
def _trainer_leaves(megatron):
    with initialize_config_dir(config_dir=str(ROOT / "verl_tokensel" / "config"), version_base=None):
        return _leaves(compose("tokensel_megatron_trainer" if megatron else "tokensel_trainer"))


def _recipe_delta(name):
    """The leaves where the composed recipe differs from its trainer (tokensel_trainer or tokensel_megatron_trainer,
    composed here): equal deltas mean equal configs under the installed verl, and a change of verl's own defaults
    outside the recipes' keys leaves them alone."""
    trainer, leaves = _trainer_leaves(name in MEGATRON), _leaves(_compose(name))
    delta = {k: v for k, v in leaves.items() if trainer.get(k, ABSENT) != v or type(trainer[k]) is not type(v)}
    delta.update({k: ABSENT for k in trainer if k not in leaves})
    return json.loads(json.dumps(delta))


@pytest.mark.parametrize("name", ALL)
def test_recipe_equals_its_snapshot(env, name):
    want, got = json.loads(SNAPSHOT.read_text())["recipes"][name], _recipe_delta(name)
    diff = sorted(k for k in want.keys() | got.keys() if json.dumps(want.get(k)) != json.dumps(got.get(k)))
    first = "; ".join(f"{k}: {want.get(k, 'trainer default')!r} -> {got.get(k, 'trainer default')!r}" for k in diff[:8])
    assert not diff, (f"{name}: {len(diff)} keys differ from {SNAPSHOT.relative_to(ROOT)}: {first}. If the change is "
                      f"meant, rewrite the snapshot: python {Path(__file__).relative_to(ROOT)} --write-snapshot")


if __name__ == "__main__" and sys.argv[1:] == ["--write-snapshot"]:
    os.environ.update(DUMMY_ENV)
    recipes = {name: _recipe_delta(name) for name in sorted(ALL)}
    about = ("Each recipe's composed config (tests/test_recipes_on_cpu.py) as the leaves where it differs from its "
             "trainer config, interpolations resolved except ${oc.env:...}, with the test's dummy env vars.")
    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text(json.dumps({"about": about, "recipes": recipes}, indent=1) + "\n")
