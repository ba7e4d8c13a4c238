"""Recipes (package data under verl_tokensel/recipes/, launch scripts under recipes/).

A recipe is a primary config of a few dozen lines whose defaults name an engine part (base/fsdp, base/megatron),
a setup (base/dapo_8020, base/gmts, base/gmts_dapo, base/kl_cov, base/archer) and its model's cluster
(cluster/<model>). Checked here: each recipe's selection node composes to its snapshot
(tests/data/recipes_composed.json); every
recipe x every preset composes, resolves and passes verl's validate_config and our driver check, or is refused by
our validation naming the key when the recipe's settings cannot serve the preset; the paper hyperparameters; a
recipe file adds only its engine layout to its parts; the Megatron layouts fit the models and the clusters; a
missing env var is a clear error (Hydra and run.sh); every YAML file opens with a comment; no two recipe files
share 40 lines; recipes/README.md gives a source for exactly the keys the recipe files set; the scripts parse.

After a meant change of a recipe's values, rewrite the snapshot: python tests/test_recipes_on_cpu.py --write-snapshot
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_tokensel.core.config import ENGINE_SWITCHES, PRESETS, override
from verl_tokensel.core.rules import Ranking
from verl_tokensel.core.ranking.scores import SCORE_REGISTRY
from verl_tokensel.verl_glue.actor_config import TokenselFSDPActorConfig, TokenselMcoreActorConfig
from verl_tokensel.verl_glue.install import validate_driver_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "verl_tokensel" / "recipes"  # the recipe YAMLs and their parts, shipped in the wheel
YAMLS = sorted(p.relative_to(RECIPES).as_posix() for p in RECIPES.rglob("*.yaml"))
SCRIPTS = ROOT / "recipes"  # run.sh, submit_ray_job.sh, README.md
SNAPSHOT = ROOT / "tests" / "data" / "recipes_composed.json"
DUMMY_ENV = {"TOKENSEL_MODEL_PATH": "/dummy/model", "TOKENSEL_TRAIN_FILES": "/dummy/train.parquet",
             "TOKENSEL_VAL_FILES": "/dummy/val.parquet"}
DAPO_8020 = ["dapo_qwen3_8b", "dapo_qwen3_14b", "dapo_qwen3_32b"]  # FSDP engine
GMTS = [f"gmts_qwen2.5_math_{s}_{a}" for s in ("1.5b", "7b") for a in ("dapo", "grpo")]  # FSDP engine
KL_COV = ["kl_cov_qwen2.5_7b"]  # FSDP engine
ARCHER = ["archer_r1_distill_qwen_1.5b_code"]  # FSDP engine
FSDP = DAPO_8020 + GMTS + KL_COV + ARCHER
MEGATRON = [f"{n}_megatron" for n in FSDP]  # each FSDP recipe's Megatron twin
ALL = FSDP + MEGATRON
SEL = "actor_rollout_ref.actor.token_selector"
ABSENT = "<absent>"  # in a snapshot: a key of the trainer config that the recipe does not have

# (attention heads, KV heads, layers) of each recipe's model: num_attention_heads, num_key_value_heads and
# num_hidden_layers of the model's config.json on Hugging Face (Qwen/Qwen3-8B, Qwen/Qwen3-14B, Qwen/Qwen3-32B,
# whose -Base checkpoints share the architecture; Qwen/Qwen2.5-Math-1.5B, Qwen/Qwen2.5-Math-7B; Qwen/Qwen2.5-7B;
# deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B, a Qwen2.5-Math-1.5B fine-tune).
MODEL_SHAPES = {"qwen3_8b": (32, 8, 36), "qwen3_14b": (40, 8, 40), "qwen3_32b": (64, 8, 64),
                "qwen2.5_math_1.5b": (12, 2, 28), "qwen2.5_math_7b": (28, 4, 28), "qwen2.5_7b": (28, 4, 28),
                "r1_distill_qwen_1.5b": (12, 2, 28)}
# What a recipe file may set beside its defaults: the engine's layout and the run name; everything else
# comes from its parts, so a Megatron recipe holds its FSDP twin's hyperparameters by construction.
LAYOUT = {"fsdp": {"actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"},
          "megatron": {f"actor_rollout_ref.actor.megatron.{k}" for k in
                       ("tensor_model_parallel_size", "context_parallel_size", "sequence_parallel")}}
# What the recipes may change in actor.megatron: the layout and memory keys; everything else (attention
# backend, Megatron-Bridge, dtype, ...) stays verl's GPU default, never the CPU test bed's settings.
MEGATRON_RECIPE_KEYS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                        "sequence_parallel", "use_distributed_optimizer", "param_offload", "optimizer_offload"} | {
    f"override_transformer_config.recompute_{k}" for k in ("granularity", "method", "num_layers")}
VERL_MEGATRON_YAML = Path(verl.__file__).parent / "trainer" / "config" / "engine" / "megatron.yaml"  # verl's defaults


@pytest.fixture
def env(monkeypatch):
    for var, value in DUMMY_ENV.items():
        monkeypatch.setenv(var, value)


@functools.lru_cache(maxsize=None)
def _compose_cached(name, overrides=(), config_dir=RECIPES):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
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
    return {key: leaf for k, v in node.items() for key, leaf in
            (_flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) and v else [(f"{prefix}{k}", v)])}


def _raw(path):
    return yaml.safe_load((RECIPES / path).read_text())


def _model(name):
    return re.search(r"qwen3_\d+b|qwen2\.5_math_[\d.]+b|qwen2\.5_[\d.]+b|r1_distill_qwen_[\d.]+b", name).group(0)


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
    trainer = "tokensel_megatron_trainer" if megatron else "tokensel_trainer"
    return _leaves(_compose_cached(trainer, config_dir=ROOT / "verl_tokensel" / "config"))


#: what the snapshot holds of each recipe: its selection node (the recipes' other values are held by the paper
#: hyperparameter tests below, the values a user of a recipe would notice)
SNAPSHOT_KEYS = ("actor_rollout_ref.actor.token_selector", "actor_rollout_ref.actor.token_selection.")


def _selection_delta(name):
    return {k: v for k, v in _recipe_delta(name).items() if k.startswith(SNAPSHOT_KEYS)}


@functools.lru_cache(maxsize=None)
def _recipe_delta(name):
    """The leaves where the composed recipe differs from its trainer config (tokensel_trainer or
    tokensel_megatron_trainer, composed here): equal deltas mean equal configs under the installed verl, and a
    change of verl's defaults outside the keys the recipes set leaves them alone."""
    base, leaves = _trainer_leaves(name in MEGATRON), _leaves(_compose_cached(name, ()))
    delta = {k: v for k, v in leaves.items() if base.get(k, ABSENT) != v or type(base[k]) is not type(v)}
    delta.update({k: ABSENT for k in base if k not in leaves})
    return json.loads(json.dumps(delta))


def test_recipe_set_is_complete():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(ALL)


@pytest.mark.parametrize("name", ALL)
def test_recipe_equals_its_snapshot(env, name):
    want, got = json.loads(SNAPSHOT.read_text())["recipes"][name], _selection_delta(name)
    diff = sorted(k for k in want.keys() | got.keys() if json.dumps(want.get(k)) != json.dumps(got.get(k)))
    first = "; ".join(f"{k}: {want.get(k, 'trainer default')!r} -> {got.get(k, 'trainer default')!r}" for k in diff[:8])
    assert not diff, (f"{name}: {len(diff)} keys differ from {SNAPSHOT.relative_to(ROOT)}: {first}. If the change is "
                      f"meant, rewrite the snapshot: python {Path(__file__).relative_to(ROOT)} --write-snapshot")


@pytest.mark.parametrize("name", ["dapo_qwen3_14b", "gmts_qwen2.5_math_7b_dapo_megatron"])
def test_preset_on_a_copy_equals_the_hydra_override(env, name):
    hydra_cfg = _compose(name, [f"{SEL}=random"])
    assert OmegaConf.to_container(hydra_cfg, resolve=True) == OmegaConf.to_container(
        _with_preset(name, "random"), resolve=True)


def _knobs(cfg):
    """The token_selection knobs the recipe sets (the KL-Cov recipes: the script's ratio and coefficient)."""
    return {k: v for k, v in cfg.actor_rollout_ref.actor.token_selection.items()
            if v is not None and k not in ENGINE_SWITCHES and not k.startswith("_")}


def _expected_refusal(cfg, preset):
    """The key our validation must name when the recipe's settings cannot serve ``preset`` (None: it runs)."""
    a, sel, knobs = cfg.actor_rollout_ref.actor, PRESETS[preset], _knobs(cfg)
    if sel is None:  # knobs with no selector would be ignored
        return f"token_selection.{sorted(knobs)[0]}" if knobs else None
    ranking = {f.name for f in dataclasses.fields(Ranking)}
    reads = {"kl_penalty_coef": sel.rule == "kl_cov", "cov_lb": sel.rule == "clip_cov",
             "cov_ub": sel.rule == "clip_cov"}  # knobs one rule reads: ignored by the others, so refused
    # a rule that does not rank has no ranking knobs: they are refused as the other rules' knobs are
    reads.update({k: isinstance(sel.knobs, Ranking) for k in ranking})
    ignored = sorted(k for k in knobs if not reads.get(k, True))
    unranked = isinstance(sel.knobs, Ranking) and not SCORE_REGISTRY[sel.score].ranks
    if not ignored and unranked and knobs.get("ratio", 1.0) != 1.0:  # a ranking by a score that ranks nothing
        return "token_selection.ratio"
    if ignored:
        return f"token_selection.{ignored[0]}"
    if sel.normaliser == "selected" and a.loss_agg_mode != "token-mean":  # a mean over selected tokens: token-mean
        return "token_selection.normaliser"
    if sel.rule == "archer" and sel.knobs.selected_kl_weight != 1 and not a.use_kl_loss:  # archer weights the KL
        return "use_kl_loss"
    return None


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", ALL)
def test_recipe_composes_and_validates(env, name, preset):
    cfg = _with_preset(name, preset)
    OmegaConf.resolve(cfg)

    def validate():  # verl's validate_config builds the actor config too
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        validate_driver_config(cfg)
        return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)

    refusal = _expected_refusal(cfg, preset)
    if refusal is not None:
        with pytest.raises(Exception, match=re.escape(refusal)):
            validate()
        return
    actor = validate()
    assert (cfg.model_engine, type(actor)) == (("megatron", TokenselMcoreActorConfig) if name in MEGATRON else
                                               ("dp", TokenselFSDPActorConfig))
    assert actor.selection == (None if PRESETS[preset] is None else override(PRESETS[preset], **_knobs(cfg)))
    assert cfg.actor_rollout_ref.model.path == "/dummy/model"
    assert cfg.data.train_files == "/dummy/train.parquet" and cfg.data.val_files == "/dummy/val.parquet"
    assert cfg.trainer.v1.trainer_mode == "tokensel_sync"
    assert cfg.trainer.experiment_name == f"{name}_{preset}"


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
    assert cfg.actor_rollout_ref.model.use_remove_padding is True and cfg.trainer.n_gpus_per_node == 8


@pytest.mark.parametrize("name", DAPO_8020 + [f"{n}_megatron" for n in DAPO_8020])
def test_8020_paper_hyperparameters(env, name):
    cfg = _resolved(name)
    _common_dapo_grpo(cfg)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert a.token_selector == "forking" and a.clip_ratio_high == 0.28
    assert cfg.data.max_prompt_length == 2048 and cfg.data.max_response_length == 20480
    assert cfg.data.gen_batch_size == 1536
    fg = cfg.algorithm.filter_groups
    assert fg.enable is True and fg.metric == "acc" and fg.max_num_gen_batches == 10
    assert cfg.reward.reward_manager.name == "dapo"
    kw = cfg.reward.reward_kwargs
    assert kw.max_resp_len == cfg.data.max_response_length
    assert kw.overlong_buffer_cfg.enable is True and kw.overlong_buffer_cfg.len == 4096
    assert kw.overlong_buffer_cfg.penalty_factor == 1.0
    assert r.name == "vllm" and r.val_kwargs.n == 32  # the paper's avg@32
    assert a.ppo_max_token_len_per_gpu >= cfg.data.max_prompt_length + cfg.data.max_response_length
    if _model(name) == "qwen3_14b":  # the script's layout: 16 nodes, vLLM TP 4, Ulysses SP 8
        assert cfg.trainer.nnodes == 16 and r.tensor_model_parallel_size == 4
        assert name.endswith("_megatron") or a.fsdp_config.ulysses_sequence_parallel_size == 8


@pytest.mark.parametrize("name", GMTS + [f"{n}_megatron" for n in GMTS])
def test_gmts_setups(env, name):
    cfg = _resolved(name)
    _common_dapo_grpo(cfg)
    a = cfg.actor_rollout_ref.actor
    dapo = name.removesuffix("_megatron").endswith("_dapo")
    assert a.token_selector == "gmts" and a.clip_ratio_high == (0.28 if dapo else 0.2)
    assert cfg.algorithm.filter_groups.enable is dapo
    assert cfg.reward.reward_manager.name == ("dapo" if dapo else "naive")
    assert cfg.data.max_prompt_length + cfg.data.max_response_length <= 4096  # Qwen2.5-Math context
    if dapo:
        kw = cfg.reward.reward_kwargs
        assert kw.max_resp_len == cfg.data.max_response_length
        assert 0 < kw.overlong_buffer_cfg.len < kw.max_resp_len


@pytest.mark.parametrize("name", KL_COV + [f"{n}_megatron" for n in KL_COV])
def test_kl_cov_script_hyperparameters(env, name):
    """PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_kl_cov.sh (its k_percent=0.2 is a percent: ratio 0.002)."""
    cfg = _resolved(name)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert a.token_selector == "kl_cov_global" and _knobs(cfg) == {"ratio": 0.002, "kl_penalty_coef": 1.0}
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.use_kl_in_reward is False
    assert a.use_kl_loss is False and not need_reference_policy(cfg)
    assert a.entropy_coeff == 0 and a.clip_ratio_low == a.clip_ratio_high == 0.2 and a.clip_ratio_c == 10.0
    assert a.loss_agg_mode == "token-mean" and a.use_dynamic_bsz is True and a.ppo_max_token_len_per_gpu == 30720
    assert a.optim.lr == 5e-7 and a.optim.weight_decay == 0 and a.optim.lr_warmup_steps == 0
    assert a.optim.lr_warmup_steps_ratio == 0 and a.optim.clip_grad == 1.0  # a constant learning rate
    assert cfg.data.train_batch_size == cfg.data.gen_batch_size == 256 and a.ppo_mini_batch_size == 32
    assert cfg.data.max_prompt_length == 2048 and cfg.data.max_response_length == 8192
    fg = cfg.algorithm.filter_groups
    assert fg.enable is True and fg.metric == "acc" and fg.max_num_gen_batches == 10
    assert cfg.reward.reward_manager.name == "dapo" and not cfg.reward.get("reward_kwargs")  # no overlong buffer
    assert r.n == 8 and r.temperature == 1.0 and r.top_p == 1.0 and r.gpu_memory_utilization == 0.85
    assert r.max_num_batched_tokens == 30720 and r.val_kwargs.do_sample is False and r.val_kwargs.n == 1
    assert cfg.trainer.nnodes == 4 and cfg.trainer.n_gpus_per_node == 8 and r.tensor_model_parallel_size == 2
    assert name.endswith("_megatron") or a.fsdp_config.ulysses_sequence_parallel_size == 1


@pytest.mark.parametrize("name", ARCHER + [f"{n}_megatron" for n in ARCHER])
def test_archer_script_hyperparameters(env, name):
    """wizard-III/ArcherCodeR scripts/train/run_archer_qwen2.5_1.5b_code.sh; its token-mean over micro-batches of
    one response is seq-mean-token-mean."""
    cfg = _resolved(name)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert a.token_selector == "archer" and not _knobs(cfg)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.use_kl_in_reward is False
    assert a.use_kl_loss is True and a.kl_loss_coef == 0.001 and a.kl_loss_type == "low_var_kl"
    assert need_reference_policy(cfg) and not need_critic(cfg)
    assert a.entropy_coeff == 0 and a.clip_ratio_low == a.clip_ratio_high == 0.2 and a.clip_ratio_c == 10.0
    assert a.loss_agg_mode == "seq-mean-token-mean" and a.ppo_epochs == 3
    assert a.ppo_max_token_len_per_gpu >= cfg.data.max_prompt_length + cfg.data.max_response_length
    assert a.optim.lr == 1e-6 and a.optim.lr_warmup_steps == 10 and a.optim.weight_decay == 0.1
    assert a.optim.clip_grad == 1.0
    assert cfg.data.train_batch_size == 64 and a.ppo_mini_batch_size == 32 and not cfg.data.get("gen_batch_size")
    assert cfg.data.max_prompt_length == 2048 and cfg.data.max_response_length == 32768
    assert not cfg.algorithm.filter_groups.enable and cfg.trainer.balance_batch is False
    assert r.n == 16 and r.temperature == 1.0 and r.top_p == 1.0 and r.gpu_memory_utilization == 0.75
    assert r.val_kwargs.n == 4 and r.val_kwargs.temperature == 0.8 and r.val_kwargs.top_p == 1.0
    assert cfg.trainer.nnodes == 2 and cfg.trainer.n_gpus_per_node == 8 and r.tensor_model_parallel_size == 1
    assert name.endswith("_megatron") or a.fsdp_config.ulysses_sequence_parallel_size == 1


@pytest.mark.parametrize("name", ALL)
def test_recipe_file_adds_only_its_layout(name):
    """The defaults: the engine part, then the setup and the model's cluster, the same for both engines; the
    file itself sets the search path, the engine layout and the run name."""
    engine = "megatron" if name in MEGATRON else "fsdp"
    node = _raw(f"{name}.yaml")
    twin = _raw(f"{name.removesuffix('_megatron')}.yaml")
    assert node["hydra"]["searchpath"] == ["pkg://verl_tokensel.config", "pkg://verl.trainer.config"]
    assert node["defaults"][0] == f"base/{engine}" and node["defaults"][-1] == "_self_"
    assert f"cluster/{_model(name)}" in node["defaults"] and node["defaults"][1:] == twin["defaults"][1:]
    keys = set(_flat(node)) - {"hydra.searchpath", "defaults", "trainer.experiment_name"}
    assert keys <= LAYOUT[engine], keys - LAYOUT[engine]


@pytest.mark.parametrize("engine,trainer", [("fsdp", "tokensel_trainer"), ("megatron", "tokensel_megatron_trainer")])
def test_engine_parts_inline_the_tokensel_trainers(engine, trainer):
    """Hydra refuses tokensel_trainer (tokensel_megatron_trainer) as a non-primary default (it sets
    hydra.searchpath), so base/fsdp (base/megatron) repeats its defaults and trainer_mode."""
    base = yaml.safe_load((ROOT / "verl_tokensel" / "config" / f"{trainer}.yaml").read_text())
    node = _raw(f"base/{engine}.yaml")
    def absolute(d):  # a default of a part names verl's and our groups from the root
        def key(k):
            return f"override /{k.removeprefix('override ')}" if k.startswith("override ") else f"/{k}"
        return d if d == "_self_" else {key(k): v for k, v in d.items()} if isinstance(d, dict) else f"/{d}"
    assert node["defaults"] == [absolute(d) for d in base["defaults"]]
    assert node["trainer"]["v1"]["trainer_mode"] == base["trainer"]["v1"]["trainer_mode"]
    assert base["hydra"]["searchpath"] == ["pkg://verl.trainer.config"]  # which each recipe file extends


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_layout(env, name):
    cfg = _resolved(name)
    assert cfg.model_engine == "megatron" and cfg.actor_rollout_ref.actor.strategy == "megatron"
    m = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).megatron
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    assert gpus % (tp * pp * cp) == 0, (gpus, tp, pp, cp)
    dp = gpus // (tp * pp * cp)
    heads, kv_heads, layers = MODEL_SHAPES[_model(name)]
    assert heads % tp == 0 and kv_heads % tp == 0 and layers % pp == 0, (heads, kv_heads, layers, tp, pp)
    # every data-parallel rank gets whole mini-batches of responses
    n = cfg.actor_rollout_ref.rollout.n
    assert (cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n) % dp == 0
    assert tp == cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    assert m.sequence_parallel is (tp > 1) and m.use_distributed_optimizer is True
    # context parallelism for the 80/20 recipes' 20k-token responses; Megatron's CP needs packed sequences
    assert (cp > 1) is name.startswith("dapo_qwen3_")
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    # the reference model (used when a KL term is switched on) follows the actor's layout
    ref = cfg.actor_rollout_ref.ref.megatron
    assert (ref.tensor_model_parallel_size, ref.pipeline_model_parallel_size, ref.context_parallel_size) == (tp, pp, cp)
    # verl's GPU engine defaults stay: the recipe changes only layout / memory keys, none of the CPU test bed's
    prefix = "actor_rollout_ref.actor.megatron."
    changed = {k.removeprefix(prefix) for k in _recipe_delta(name) if k.startswith(prefix)}
    assert changed <= MEGATRON_RECIPE_KEYS, changed - MEGATRON_RECIPE_KEYS
    verl_defaults = yaml.safe_load(VERL_MEGATRON_YAML.read_text())
    for key in ("use_mbridge", "vanilla_mbridge", "dtype", "use_remove_padding"):
        assert cfg.actor_rollout_ref.actor.megatron[key] == verl_defaults[key], key
    transformer = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert transformer.attention_backend == verl_defaults["override_transformer_config"]["attention_backend"] == "flash"


@pytest.mark.parametrize("var", DUMMY_ENV)
def test_missing_env_var_names_it_when_resolving(env, monkeypatch, var):
    monkeypatch.delenv(var)
    cfg = _compose("dapo_qwen3_14b")
    with pytest.raises(Exception, match=var):
        OmegaConf.resolve(cfg)


@pytest.mark.parametrize("var", DUMMY_ENV)
def test_run_sh_missing_env_var(var):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSEL_")}
    env.update({k: f"/dummy/{k}" for k in DUMMY_ENV if k != var})
    # a python that would fail loudly if reached: nothing may start before the env check
    env["TOKENSEL_PYTHON"] = "/nonexistent/python-must-not-run"
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "dapo_qwen3_14b", "forking"],
                         capture_output=True, text=True, timeout=30, env=env, cwd=str(ROOT))
    assert res.returncode != 0 and var in res.stderr and "must-not-run" not in res.stderr
    assert all(k not in res.stderr for k in DUMMY_ENV if k != var)


def test_run_sh_knows_the_megatron_recipes():
    # past the recipe check (the installed package lists it), stopped at the first missing env var
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENSEL_")}
    env["TOKENSEL_PYTHON"] = sys.executable
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "dapo_qwen3_14b_megatron", "forking"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=str(ROOT))
    assert res.returncode == 2 and "no recipe" not in res.stderr and "TOKENSEL_MODEL_PATH" in res.stderr


def test_run_sh_unknown_recipe_and_usage():
    env = {**os.environ, "TOKENSEL_PYTHON": sys.executable}
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh")], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode != 0 and "usage" in res.stderr
    # the usage lists the installed recipes (not their parts) and presets
    assert re.search(r"recipes: (.*)", res.stderr).group(1).split() == sorted(ALL), res.stderr
    assert re.search(r"presets: (.*)", res.stderr).group(1).split() == list(PRESETS), res.stderr
    res = subprocess.run(["bash", str(SCRIPTS / "run.sh"), "no_such_recipe", "forking"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode != 0 and "no recipe 'no_such_recipe'" in res.stderr


@pytest.mark.parametrize("path", YAMLS)
def test_every_recipe_file_says_what_it_is(path):
    """A recipe file opens with a comment (what it is, where its values come from)."""
    first = (RECIPES / path).read_text().lstrip().splitlines()[0]
    assert first.startswith("#") and len(first) > 10, f"{path}: no opening comment ({first!r})"


def test_no_two_recipe_files_share_40_lines():
    """Composed, not copied: the lines two files have in common (as a multiset, comments included, blank lines
    not) stay under 40."""
    lines = {p: Counter(s.strip() for s in (RECIPES / p).read_text().splitlines() if s.strip()) for p in YAMLS}
    shared = {(a, b): sum((lines[a] & lines[b]).values()) for a, b in itertools.combinations(YAMLS, 2)}
    worst = max(shared, key=shared.get)
    assert shared[worst] < 40, (worst, shared[worst])


def test_readme_gives_every_recipe_key_a_source():
    text = (SCRIPTS / "README.md").read_text()
    section = text.split("## Where each value comes from", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \|", section, flags=re.M)
    set_keys = {k for p in YAMLS for k in _flat(_raw(p)) if k not in ("hydra.searchpath", "defaults")}
    assert len(rows) == len(set(rows)) and set(rows) == set_keys, (set_keys - set(rows), set(rows) - set_keys)


@pytest.mark.parametrize("script", ["run.sh", "submit_ray_job.sh"])
def test_scripts_parse(script):
    res = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_scripts_hold_no_secrets():
    for path in SCRIPTS.glob("*.sh"):
        text = path.read_text()
        for needle in ("API_KEY=", "TOKEN=", "SECRET", "PASSWORD"):
            assert needle not in text, f"{path.name} contains {needle}"


if __name__ == "__main__" and sys.argv[1:] == ["--write-snapshot"]:
    os.environ.update(DUMMY_ENV)
    about = ("Each recipe's selection node, composed (tests/test_recipes_on_cpu.py): the leaves where it differs from "
             "its trainer config, interpolations resolved except ${oc.env:...}, with the test's dummy env vars.")
    recipes = {name: _selection_delta(name) for name in sorted(ALL)}
    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text(json.dumps({"about": about, "recipes": recipes}, indent=1) + "\n")
