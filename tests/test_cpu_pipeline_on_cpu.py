"""The CPU switch ``trainer.device=cpu`` (verl_tokensel_cpu.pipeline), on the composed config, no Ray.

- fills every setting of its table (values verl-0.9.md item 6/7 lists) and forwards the env vars as strings;
- a user value that conflicts with CPU fails before Ray starts, naming the key (command line or YAML);
- a GPU recipe with many conflicts gets them all in one error, one line per key with its value and its fix, and
  ``main_ppo`` prints that list and exits 2;
- the table's ``default`` column is verl 0.9.1's real default (else the switch would silently skip a key);
- without the switch nothing changes.
"""

from __future__ import annotations

from pathlib import Path

import os

import pytest

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl_tokensel_cpu import pipeline as cpu_pipeline
from verl_tokensel_cpu.pipeline import (
    CONFIG_SETTINGS,
    ENV_VARS_KEY,
    CpuConflictError,
    apply_cpu_pipeline,
    cli_override_keys,
    wants_cpu,
)
from verl_tokensel_cpu.platform import MODULE_NAME

pytestmark = pytest.mark.requires("verl")


R = "actor_rollout_ref.rollout."
# verl's examples/grpo_trainer/run_qwen2_5_vl-7b-sglang.sh (text model), with the GPU-only keys of its other scripts:
# fused kernels, Liger, Ulysses 2, the FSDP strategy spelled out
GPU_FSDP_SCRIPT = [
    "algorithm.adv_estimator=grpo", "data.train_files=/data/gsm8k/train.parquet", "data.train_batch_size=512",
    "data.max_prompt_length=1024", "data.max_response_length=2048", "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.use_liger=True",
    "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    f"{R}tensor_model_parallel_size=2", f"{R}name=sglang", f"{R}gpu_memory_utilization=0.6", f"{R}enforce_eager=False",
    f"{R}free_cache_engine=True", f"{R}n=5", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
]
# its conflicts: key -> (the script's value, the CPU value the fix names); 8 logical GPUs and offload run on CPU
GPU_FSDP_CONFLICTS = {
    "actor_rollout_ref.model.use_fused_kernels": (True, False),
    "actor_rollout_ref.model.use_liger": (True, False),
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (2, 1),
    f"{R}tensor_model_parallel_size": (2, 1),
    f"{R}name": ("sglang", "vllm"),
    f"{R}enforce_eager": (False, True),
    f"{R}free_cache_engine": (True, False),
}


def _assert_lists_every_conflict(text: str, expected: dict) -> None:
    """The error's text in ``text``: its count, then one line per key of ``expected`` with its value and its fix."""
    header = f"trainer.device=cpu cannot honour {len(expected)} settings of this config:"
    lines = text.splitlines()
    assert header in lines, text[-3000:]
    listed = lines[lines.index(header) + 1:][:len(expected) + 1]
    assert len([ln for ln in listed if ln.startswith("  - ")]) == len(expected), listed  # each key once
    for key, (value, cpu_value) in expected.items():
        line = [ln for ln in listed if ln.startswith(f"  - {key}={value!r}: ")]
        assert len(line) == 1 and line[0].endswith(f"Fix: remove the setting (the CPU switch fills it) or set "
                                                   f"{key}={cpu_value}."), (key, listed)


def _compose(*overrides: str):
    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose("tokensel_trainer", overrides=list(overrides))


def _apply(*overrides: str, environ=None):
    cfg = _compose("trainer.device=cpu", *overrides)
    env = apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys(["trainer.device=cpu", *overrides]),
                             environ={} if environ is None else environ)
    return cfg, env


def test_switch_fills_every_setting_and_env():
    cfg, env = _apply()
    for s in CONFIG_SETTINGS:
        if s.fill:
            assert OmegaConf.select(cfg, s.key) == s.value, s.key
    assert cfg.actor_rollout_ref.ref.strategy == "fsdp2"  # follows the actor through verl's interpolation
    assert cfg.ray_kwargs.ray_init.num_gpus == 1
    assert cfg.ray_kwargs.ray_init.address == "local"  # never joins someone else's cluster on this host
    assert env["VERL_PLATFORM"] == "cpu" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",")[0] == MODULE_NAME
    forwarded = OmegaConf.to_container(OmegaConf.select(cfg, ENV_VARS_KEY))
    assert forwarded == env and all(isinstance(v, str) for v in forwarded.values())  # Ray needs str


def test_user_values_that_work_on_cpu_are_kept():
    cfg, env = _apply("trainer.n_gpus_per_node=2",
                      "+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE='3'",
                      "ray_kwargs.ray_init.num_cpus=8",
                      environ={"VERL_USE_EXTERNAL_MODULES": "my_plugin"})
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.ray_kwargs.ray_init.num_gpus == 2
    assert cfg.ray_kwargs.ray_init.num_cpus == 8
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VERL_USE_EXTERNAL_MODULES"] == f"{MODULE_NAME},my_plugin"


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.rollout.enforce_eager=False", "actor_rollout_ref.rollout.enforce_eager"),
    ("actor_rollout_ref.rollout.free_cache_engine=True", "actor_rollout_ref.rollout.free_cache_engine"),
    ("+actor_rollout_ref.rollout.enable_sleep_mode=True", "actor_rollout_ref.rollout.enable_sleep_mode"),
    ("actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.dtype"),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy"),
    ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy"),  # explicit verl default
    ("actor_rollout_ref.ref.strategy=fsdp", "actor_rollout_ref.ref.strategy"),
    ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"),
    ("+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
     "actor_rollout_ref.model.override_config.attn_implementation"),
    ("actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.use_fused_kernels"),
    ("transfer_queue.backend.SimpleStorage.num_data_storage_units=8",
     "transfer_queue.backend.SimpleStorage.num_data_storage_units"),
    ("+ray_kwargs.ray_init.num_gpus=0", "ray_kwargs.ray_init.num_gpus"),
    ("+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM=cuda", "VERL_PLATFORM"),
])
def test_conflicting_user_value_fails_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        _apply(override)
    assert "trainer.device=cpu" in str(err.value) and "Fix:" in str(err.value)
    assert len(err.value.conflicts) == 1 and "\n" not in str(err.value)  # one conflict: one sentence, no list


def test_gpu_recipe_gets_every_conflict_in_one_error():
    """A GPU script tried on CPU: all its conflicts at once, each key once (the actor's strategy is checked twice),
    before this process's env changes."""
    environ = {}
    with pytest.raises(CpuConflictError) as err:
        _apply(*GPU_FSDP_SCRIPT, environ=environ)
    _assert_lists_every_conflict(str(err.value), GPU_FSDP_CONFLICTS)
    assert {c.key: c.value for c in err.value.conflicts} == {k: v for k, (v, _) in GPU_FSDP_CONFLICTS.items()}
    assert environ == {}


def test_every_kind_of_conflict_joins_the_list():
    """The engine choice, the settings table, the reference's strategy, Ray's GPUs and the forwarded env."""
    with pytest.raises(CpuConflictError) as err:
        _apply("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=fsdp",
               "+ray_kwargs.ray_init.num_gpus=0", "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM=cuda")
    assert [c.key for c in err.value.conflicts] == [
        "actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "ray_kwargs.ray_init.num_gpus",
        f"{ENV_VARS_KEY}.VERL_PLATFORM"]
    assert str(err.value).startswith("trainer.device=cpu cannot honour 4 settings of this config:\n")


def test_conflict_set_in_a_yaml_is_caught_too():
    """Not on the command line (no explicit key) but different from verl's default: a recipe set it."""
    cfg = _compose("trainer.device=cpu", "actor_rollout_ref.rollout.enforce_eager=False",
                   "actor_rollout_ref.rollout.dtype=float16")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.dtype='float16'"):
        apply_cpu_pipeline(cfg, explicit_keys=["trainer.device"], environ={})


def test_defaults_column_is_verls_default():
    """Each setting's `default` must be what verl 0.9.1 composes, or the switch would not fill it."""
    stock = _compose()
    for s in CONFIG_SETTINGS:
        raw = cpu_pipeline._raw(stock, s.key)
        if raw is cpu_pipeline._ABSENT or raw is None:
            assert s.default in (cpu_pipeline._ABSENT, None), s.key
        elif s.fill:
            assert raw == s.default, (s.key, raw, s.default)


def test_no_switch_no_change():
    stock = _compose()
    assert not wants_cpu(stock)
    with pytest.raises(ValueError, match="trainer.device=cpu"):
        apply_cpu_pipeline(stock, environ={})
    assert OmegaConf.select(stock, "actor_rollout_ref.rollout.enforce_eager") is False


def test_cli_override_keys():
    assert cli_override_keys(["+a.b=1", "++c=2", "~d", "hydra.run.dir=x", "e.f=[1,2]"]) == {"a.b", "c", "d", "e.f"}


def test_joining_a_running_cluster_leaves_ray_resources_alone():
    """ray job submit / RAY_ADDRESS: Ray refuses num_cpus/num_gpus when connecting; the cluster's count."""
    cfg, _ = _apply(environ={"RAY_ADDRESS": "http://127.0.0.1:8265"})
    assert cfg.ray_kwargs.ray_init.num_cpus is None and "num_gpus" not in cfg.ray_kwargs.ray_init
    assert "address" not in cfg.ray_kwargs.ray_init
    cfg, _ = _apply("++ray_kwargs.ray_init.address=local", environ={"RAY_ADDRESS": "http://127.0.0.1:8265"})
    assert cfg.ray_kwargs.ray_init.num_gpus == 1


def test_docs_table_lists_every_setting():
    """docs/cpu.md, the switch's manual, has a row for every setting it fills."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cpu.md").read_text()
    short = {"actor_rollout_ref.actor.": "actor.", "actor_rollout_ref.rollout.": "rollout.",
             "actor_rollout_ref.ref.": "ref."}
    for s in CONFIG_SETTINGS:
        key = s.key
        for long, abbrev in short.items():
            key = key.replace(long, abbrev)
        if ".mixed_precision." in key:
            key = key.rsplit(".", 1)[0] + ".{param,reduce,buffer}_dtype"
        assert f"`{key}`" in doc, f"{s.key} is missing from the settings table of docs/cpu.md"
    for name, _, _ in cpu_pipeline.ENV_SETTINGS:
        assert f"`{name}`" in doc, f"{name} is missing from the settings table of docs/cpu.md"


def test_main_ppo_cli_lists_every_conflict_before_ray(tmp_path):
    """The real entry point on the GPU script: `strategy=fsdp` is verl's default, so only Hydra's record of the
    command line shows the user chose it; stderr has the whole list, no traceback, exit 2, and no Ray instance
    is started."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "verl_tokensel.main_ppo", "trainer.device=cpu", *GPU_FSDP_SCRIPT,
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    _assert_lists_every_conflict(res.stderr, GPU_FSDP_CONFLICTS)
    assert "Traceback" not in out and "ray init kwargs" not in out
