"""verl's WHOLE ``main_ppo`` pipeline with the Megatron engine on CPU: ``trainer.device=cpu model_engine=megatron``.

driver -> Ray -> TaskRunner -> vLLM-CPU rollout -> reward -> old log-probs (Megatron) -> Megatron update -> weight
sync into vLLM through verl's own export path (mbridge), on the tiny Qwen2 with two KV heads
(``tiny_model.MEGATRON_TINY_CONFIG``).

Default suite (seconds, no Ray):

- the switch fills the Megatron settings (``MEGATRON_SETTINGS``: mbridge, local attention, no fusions, no sequence
  parallelism, fp32 through ``CpuMcoreEngineConfig``) and the Megatron env vars, adds none of FSDP's keys, and the
  result converts into our ``TokenselMcoreActorConfig``; what cannot work on CPU is refused before Ray starts,
  naming the key and the fix (``actor.strategy=megatron`` on verl's FSDP actor node names ``model_engine=megatron``),
  a GPU Megatron script's conflicts all in one error;
  each setting's ``default`` is verl 0.9.1's;
- the loading step: a process with ``VERL_PLATFORM=cpu VERL_TOKENSEL_CPU_MEGATRON=1`` has the shims right after
  it imports ``megatron.core`` (``import verl`` first, as a Ray worker does); without the variable nothing is armed;
- what a resume does to the engine, without Ray (~15 s): a fresh Megatron engine loads a checkpoint and holds the
  saved weights, Adam moments and step, and its next update equals the saving engine's.

``slow`` (each run 100-150 s alone on 2 cores, ~7 GB RAM: Ray, the vLLM-CPU server, the Megatron build; the CI
budget is spent, so none is in the default suite): 2 GRPO steps each, checked like the FSDP2 runs
(``helpers.pipeline.check_selecting_run``: exit 0, the preset's budget in ``tokensel/*``, vLLM's log-probs equal
to the actor's after every weight sync, the saved HF weights moved) and the actor worker that ran the loss had
the Megatron shims installed by the loading step:

- V1 driver: ``none``, ``forking`` (in the loss), ``forking_paper`` (the driver's mask), ``gmts`` (the pre-pass
  through Megatron's forward-only schedule);
- ``trainer.use_v1=false`` (the deprecated driver) with ``forking``;
- two actor ranks, ``forking``: tensor parallelism 2, pipeline parallelism 2, data parallelism 2 (vLLM gets the
  weights gathered over the shards and stages);
- a run resumed from the Megatron checkpoint of step 1 with ``forking`` on (greedy rollouts): its step 2 equals an
  uninterrupted run's, rollouts, selection and weights (so Adam's moments and step were restored);
- the Megatron actor worker killed during the update: the run ends with a message naming it.

Measured on 2 cores (``-m slow``, 10 tests, 2026-12-02): 22 min; 99-149 s per test (v0 99 s, V1 109-125 s, TP 2 /
PP 2 / DP 2 130 / 123 / 149 s, the killed worker 121 s), the resume (two runs) 214 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from verl_tokensel_cpu import pipeline as cpu_pipeline
from verl_tokensel_cpu.megatron import SHIMS_ANNOUNCEMENT, SHIMS_ENV, install_on_megatron_import
from verl_tokensel_cpu.pipeline import (
    ENV_VARS_KEY,
    FSDP_SETTINGS,
    MEGATRON_ENV_SETTINGS,
    MEGATRON_SETTINGS,
    CpuConflictError,
    apply_cpu_pipeline,
    cli_override_keys,
)
from verl_tokensel_cpu.launch import ENGINE_OVERRIDES

pytestmark = pytest.mark.requires("verl", "megatron", "mbridge")

(MEGATRON,) = ENGINE_OVERRIDES["megatron"]  # model_engine=megatron, as the demo's --engine megatron passes it


def _compose(*overrides: str, config_name: str = "tokensel_trainer"):
    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose(config_name, overrides=list(overrides))


def _apply(*overrides: str, config_name: str = "tokensel_trainer"):
    cfg = _compose("trainer.device=cpu", *overrides, config_name=config_name)
    env = apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys(["trainer.device=cpu", *overrides]), environ={})
    return cfg, env


# ------------------------------------------------------------------------------------------------ the switch


@pytest.mark.parametrize("config_name, overrides", [("tokensel_trainer", (MEGATRON,)),
                                                    ("tokensel_megatron_trainer", ())],
                         ids=["model_engine", "config_name"])
def test_switch_fills_the_megatron_settings(config_name, overrides):
    from verl.utils.config import omega_conf_to_dataclass

    from verl_tokensel_cpu.megatron_config import CpuMcoreEngineConfig
    from verl_tokensel.verl_glue.actor_config import TokenselMcoreActorConfig

    cfg, env = _apply(*overrides, "actor_rollout_ref.actor.token_selector=forking",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", config_name=config_name)
    for s in MEGATRON_SETTINGS:
        if s.fill:
            assert OmegaConf.select(cfg, s.key) == s.value, s.key
    for s in FSDP_SETTINGS:  # the Megatron actor node has no fsdp_config: nothing of FSDP's may be added
        assert OmegaConf.select(cfg, s.key) in (None, "megatron"), s.key
    for name, value, _ in MEGATRON_ENV_SETTINGS:
        assert env[name] == value
    assert OmegaConf.to_container(OmegaConf.select(cfg, ENV_VARS_KEY)) == env
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # what the driver and every worker do
    assert isinstance(actor, TokenselMcoreActorConfig) and actor.selection is not None
    assert isinstance(actor.megatron, CpuMcoreEngineConfig) and actor.megatron.dtype == "float32"
    assert actor.megatron.sequence_parallel is False and actor.megatron.vanilla_mbridge is True


def test_fsdp_run_gets_no_megatron_env():
    _, env = _apply()
    assert not {name for name, _, _ in MEGATRON_ENV_SETTINGS} & set(env)


def test_bf16_engine_is_kept_when_asked():
    """verl's GPU default runs too; fp32 is only the CPU switch's default (exact weight sync into fp32 vLLM)."""
    cfg, _ = _apply(MEGATRON, "actor_rollout_ref.actor.megatron.dtype=bfloat16")
    assert cfg.actor_rollout_ref.actor.megatron.dtype == "bfloat16"


@pytest.mark.parametrize("override, key, fix", [
    ("actor_rollout_ref.actor.megatron.vanilla_mbridge=False", "actor_rollout_ref.actor.megatron.vanilla_mbridge",
     "vanilla_mbridge=True"),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=flash",
     "override_transformer_config.attention_backend", "attention_backend=local"),
    ("actor_rollout_ref.actor.megatron.context_parallel_size=2",
     "actor_rollout_ref.actor.megatron.context_parallel_size", "context_parallel_size=1"),
    ("actor_rollout_ref.actor.megatron.dtype=float16", "actor_rollout_ref.actor.megatron.dtype", "dtype=float32"),
    ("actor_rollout_ref.actor.megatron.sequence_parallel=True", "actor_rollout_ref.actor.megatron.sequence_parallel",
     "sequence_parallel=False"),
    ("actor_rollout_ref.actor.megatron.use_megatron_fsdp=True", "use_megatron_fsdp", "use_megatron_fsdp=False"),
])
def test_megatron_value_that_cannot_run_on_cpu_fails_naming_the_key(override, key, fix):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        _apply(MEGATRON, override)
    message = str(err.value)
    assert "trainer.device=cpu" in message and "Fix: remove the setting (the CPU switch fills it)" in message
    assert fix in message


def test_megatron_strategy_on_the_fsdp_node_names_model_engine():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.strategy='megatron'") as err:
        _apply("actor_rollout_ref.actor.strategy=megatron")
    assert "Fix: replace actor_rollout_ref.actor.strategy=megatron with model_engine=megatron" in str(err.value)


_TC = "actor_rollout_ref.actor.megatron.override_transformer_config."
_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
            "gradient_accumulation_fusion")
# the GPU keys of verl's Megatron example scripts (examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh with
# COMMON_CP=2; the TP 2 / PP 2 of run_qwen2-7b_math_megatron.sh, which run on CPU), verl's config name as they pass it
GPU_MEGATRON_SCRIPT = [
    "--config-name=ppo_megatron_trainer", "actor_rollout_ref.model.use_fused_kernels=False",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.context_parallel_size=2", "actor_rollout_ref.actor.megatron.param_offload=True",
    *(f"+{_TC}{name}=True" for name in (*_FUSIONS, "persist_layer_norm")),
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.free_cache_engine=True",
    "trainer.n_gpus_per_node=8",
]


def test_gpu_megatron_script_gets_every_conflict_in_one_error():
    """One error, one line per conflicting key with its value and the fix's CPU value; what runs on CPU (TP/PP 2,
    offload, eager rollout, persist_layer_norm) is not listed."""
    from verl_tokensel.verl_glue.routes import our_config_args

    args, _ = our_config_args(GPU_MEGATRON_SCRIPT)  # as main_ppo reads the script: tokensel_megatron_trainer
    (config_name,) = [a.split("=", 1)[1] for a in args if a.startswith("--config-name=")]
    with pytest.raises(CpuConflictError) as err:
        _apply(*[a for a in args if not a.startswith("--")], config_name=config_name)
    expected = {"actor_rollout_ref.rollout.tensor_model_parallel_size": (4, 1),
                "actor_rollout_ref.rollout.free_cache_engine": (True, False),
                "actor_rollout_ref.actor.megatron.context_parallel_size": (2, 1),
                **{f"{_TC}{name}": (True, False) for name in _FUSIONS}}
    lines = str(err.value).splitlines()
    assert lines[0] == f"trainer.device=cpu cannot honour {len(expected)} settings of this config:"
    assert {c.key: c.value for c in err.value.conflicts} == {k: v for k, (v, _) in expected.items()}
    assert len(lines) == 1 + len(expected)
    for key, (value, cpu_value) in expected.items():
        assert f"  - {key}={value!r}: " in str(err.value) and f" or set {key}={cpu_value}." in str(err.value), key


def test_megatron_defaults_column_is_verls_default():
    stock = _compose(MEGATRON)
    for s in MEGATRON_SETTINGS:
        raw = cpu_pipeline._raw(stock, s.key)
        if raw is cpu_pipeline._ABSENT or raw is None:
            assert s.default in (cpu_pipeline._ABSENT, None), s.key
        else:
            assert raw == s.default, (s.key, raw, s.default)


def test_docs_table_lists_every_megatron_setting():
    """docs/cpu.md, the switch's manual, has a row for every Megatron setting and variable (its abbreviations:
    ``tc.``, ``actor.``, ``ref.``)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cpu.md").read_text()
    short = {"actor_rollout_ref.actor.megatron.override_transformer_config.": "tc.",
             "actor_rollout_ref.actor.": "actor.", "actor_rollout_ref.ref.": "ref."}
    for s in MEGATRON_SETTINGS:
        key = s.key
        for long, abbrev in short.items():
            key = key.replace(long, abbrev)
        assert f"`{key}`" in doc, f"{s.key} is missing from the Megatron settings table of docs/cpu.md"
    for name, value, _ in MEGATRON_ENV_SETTINGS:
        assert f"`{name}` = {value}" in doc, f"{name} is missing from docs/cpu.md's environment paragraph"


def test_engine_config_admits_fp32_and_keeps_verls_checks():
    from verl_tokensel_cpu.megatron_config import CpuMcoreEngineConfig

    assert CpuMcoreEngineConfig(dtype="float32").dtype == "float32"
    assert CpuMcoreEngineConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(AssertionError, match="dtype float64 not supported"):
        CpuMcoreEngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="max_seqlen_per_dp_cp_rank"):  # verl's own validation still runs
        CpuMcoreEngineConfig(dtype="float32", dynamic_context_parallel=True)


# ------------------------------------------------------------------------------------------------ the loading step


def test_loading_step_is_armed_only_by_its_variable(monkeypatch):
    monkeypatch.delenv(SHIMS_ENV, raising=False)
    assert install_on_megatron_import() is False


def test_worker_process_gets_the_shims_when_it_imports_megatron():
    """What a Ray worker does: ``import verl`` (whose CPU entry point arms the shims under VERL_PLATFORM=cpu),
    then verl's engine package imports megatron.core. ~5 s."""
    code = ("import verl, torch, megatron.core; from megatron.core.tensor_parallel import random as r; "
            "print('installed', getattr(torch, '_verl_tokensel_megatron_cpu', False), "
            "r._get_cuda_rng_state.__module__)")
    env = {**os.environ, "VERL_PLATFORM": "cpu", SHIMS_ENV: "1",
           "VERL_USE_EXTERNAL_MODULES": "verl_tokensel_cpu.platform"}
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "installed True verl_tokensel_cpu.megatron" in res.stdout, res.stdout + res.stderr[-3000:]
    assert SHIMS_ANNOUNCEMENT.format(pid="") in res.stderr


def test_megatron_checkpoint_round_trip_restores_adam(tmp_path):  # ~15 s: two Megatron builds in a spawned process
    """What a resume does to the engine, without Ray: a fresh Megatron engine loads a checkpoint (shim 7 of
    verl_tokensel_cpu.megatron: megatron-core's torch-Adam path asserts on a fresh optimizer, copies into fp32 leaf
    views with autograd on, and leaves Adam one step tensor shared by every parameter) and holds the saved weights,
    moments and step; the next update then moves it exactly as it moves the engine that saved it."""
    from helpers import distributed as D
    from helpers.megatron_runs import megatron_checkpoint_round_trip
    from verl_tokensel_cpu import tiny_model

    model = tiny_model.build_tiny_model_dir(tmp_path / "tiny", **tiny_model.MEGATRON_TINY_CONFIG)
    (out,) = D.run_distributed(megatron_checkpoint_round_trip, world_size=1, args=(model, str(tmp_path / "ckpt")),
                               timeout=400)
    print(out)
    assert out["states"][0] == out["states"][1] > 0 and out["moment_size"] > 0, out
    assert out["weights"] == 0 and out["moments"] == 0 and out["steps"] == ({1.0}, {1.0}), out
    assert out["second_step"] > 1e-4 and set(out["second_step_apart"].values()) == {0.0}, out


# ------------------------------------------------------------------------------------------------ real runs (slow)

RUN_TIMEOUT_S = 900
STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from verl_tokensel_cpu import tiny_model

    return Path(tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("mg_pipeline_model") / "tiny",
                                                **tiny_model.MEGATRON_TINY_CONFIG))


def _run(work: Path, model_dir: Path, selector: str, extra=(), *, use_v1: bool = True, **tiny_run):
    """A 2-step run in ``work`` (Megatron, a full checkpoint at each step); ``tiny_run``: batch sizes of
    :func:`helpers.pipeline.prepare_tiny_run`."""
    from helpers.pipeline import FULL_CHECKPOINT, prepare_tiny_run, with_overrides
    from verl_tokensel_cpu.launch import run_main_ppo

    overrides = prepare_tiny_run(work, model_dir=model_dir, token_selector=selector, use_v1=use_v1, steps=STEPS,
                                 **tiny_run)
    overrides = with_overrides(overrides, [MEGATRON, *FULL_CHECKPOINT, *extra])
    return run_main_ppo(overrides, timeout_s=RUN_TIMEOUT_S, log_path=work / "main_ppo.log"), overrides


def _shim_pids(text: str) -> set[int]:
    import re

    pattern = re.escape(SHIMS_ANNOUNCEMENT).replace(r"\{pid\}", r"(\d+)")
    return {int(m) for m in re.findall(pattern, text)}


def _check_megatron_actor(result, selector: str, n_ranks: int = 1) -> None:
    """The ranks that announced the selecting loss are Megatron workers whose loading step installed the shims."""
    from helpers.pipeline import loss_announcements

    text = result.log_path.read_text(errors="replace")
    shimmed = _shim_pids(text)
    assert shimmed, "no process installed the Megatron CPU shims"
    if selector == "none":
        return
    actors = {a["pid"] for a in loss_announcements(text) if a["selector"] == selector}
    assert len(actors) == n_ranks and actors <= shimmed, (actors, shimmed)


def _check_none_run(result, model_dir: Path, checkpoints: Path) -> None:
    from helpers.pipeline import HF_DIR, check_params_changed

    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [1, 2], result.describe()
    for s in result.steps:
        assert not [k for k in s if "tokensel/" in k], s  # stock verl: no selection
        assert s["training/rollout_probs_diff_max"] < 1e-4, s
    check_params_changed(model_dir, checkpoints / "global_step_2" / HF_DIR["megatron"])


#: preset -> where its selection is logged (pre-pass presets: exact over the mini-batch)
V1_PRESETS = {"none": None, "forking": "actor/tokensel/", "forking_paper": "actor/tokensel/",
              "gmts": "actor/tokensel/prepass/"}
#: gmts: two mini-batches of 2 prompts x 4 responses, so that the second one (after an optimizer step) runs the
#: pre-pass forward through Megatron's forward-only schedule instead of reusing the old-log-prob pass
TWO_MINI_BATCHES = ["actor_rollout_ref.actor.ppo_mini_batch_size=2",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]


@pytest.mark.slow  # 109-125 s per preset on 2 cores (Ray + vLLM-CPU + Megatron build); CI's time is spent
@pytest.mark.parametrize("selector", list(V1_PRESETS))
def test_v1_driver_megatron(selector, model_dir, tmp_path):
    from helpers.pipeline import check_selecting_run

    result, _ = _run(tmp_path, model_dir, selector, TWO_MINI_BATCHES if selector == "gmts" else ())
    if V1_PRESETS[selector] is None:
        _check_none_run(result, model_dir, tmp_path / "checkpoints")
    else:
        check_selecting_run(result, model_dir, tmp_path / "checkpoints", steps=[1, 2], prefix=V1_PRESETS[selector],
                            engine="megatron")
    if selector == "forking_paper":  # the driver chose the mask (rollout source), the loss applied it
        assert all(0.2 <= s["tokensel/driver_selected_fraction"] < 0.25 for s in result.steps), result.steps
    if selector == "gmts":  # one of the two mini-batches reused the old pass, the other ran the pre-pass forward
        assert all(s["actor/tokensel/prepass/reused_old_pass"] == pytest.approx(0.5) for s in result.steps), \
            [s["actor/tokensel/prepass/reused_old_pass"] for s in result.steps]
    _check_megatron_actor(result, selector)


@pytest.mark.slow  # 99 s on 2 cores
def test_v0_driver_megatron_forking(model_dir, tmp_path):
    from helpers.pipeline import check_selecting_run

    result, _ = _run(tmp_path, model_dir, "forking", use_v1=False)
    check_selecting_run(result, model_dir, tmp_path / "checkpoints", steps=[1, 2], engine="megatron")
    _check_megatron_actor(result, "forking")


_MG = "actor_rollout_ref.actor.megatron"
#: two actor ranks: tensor, pipeline or data parallel (DP 2: 8 of the 16 responses per rank and micro-batch)
TWO_RANKS = {"tp2": [f"{_MG}.tensor_model_parallel_size=2"], "pp2": [f"{_MG}.pipeline_model_parallel_size=2"],
             "dp2": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"]}


@pytest.mark.slow  # 123-149 s each on 2 cores (two Megatron ranks next to vLLM)
@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_megatron_ranks_forking(layout, model_dir, tmp_path):
    """vLLM gets the weights gathered over the TP shards / PP stages through mbridge; both ranks run the loss's
    selection (TP: the same rows; PP: the last stage computes it; DP: each its own rows)."""
    from helpers.pipeline import check_selecting_run

    result, _ = _run(tmp_path, model_dir, "forking", ["trainer.n_gpus_per_node=2", *TWO_RANKS[layout]])
    check_selecting_run(result, model_dir, tmp_path / "checkpoints", steps=[1, 2], engine="megatron")
    _check_megatron_actor(result, "forking", n_ranks=2)


#: greedy rollouts, one response per prompt, REINFORCE++ advantages: step 2 of a resumed run sees the batch an
#: uninterrupted run sees (as in test_e2e_on_cpu.py)
DETERMINISTIC = ["actor_rollout_ref.rollout.top_k=1", "algorithm.adv_estimator=reinforce_plus_plus"]


@pytest.mark.slow  # two runs, 214 s on 2 cores
def test_resume_from_a_megatron_checkpoint_with_forking(model_dir, tmp_path):
    """A run resumed from the Megatron checkpoint of step 1 (model through mbridge, distributed optimizer and RNG
    through Megatron's dist checkpointing) makes the step 2 an uninterrupted run makes: the same rollouts and
    selection, and the same weights after it, which holds only if Adam's moments AND its step count were restored
    (a wrong step count changes Adam's bias correction)."""
    from safetensors.torch import load_file

    from helpers.pipeline import HF_DIR, resume_overrides, with_overrides
    from verl_tokensel_cpu.launch import run_main_ppo

    first, overrides = _run(tmp_path / "first", model_dir, "forking",
                            [*DETERMINISTIC, f"trainer.rollout_data_dir={tmp_path / 'first' / 'rollouts'}"],
                            train_batch_size=8, rollout_n=1)
    first.raise_for_status()
    assert [s["step"] for s in first.steps] == [1, 2], first.describe()
    resumed_work = tmp_path / "resumed"
    step_1 = tmp_path / "first" / "checkpoints" / "global_step_1"
    result = run_main_ppo(with_overrides(resume_overrides(overrides, step_1, resumed_work),
                                         [f"trainer.rollout_data_dir={resumed_work / 'rollouts'}"]),
                          timeout_s=RUN_TIMEOUT_S, log_path=tmp_path / "resume.log")
    result.raise_for_status()
    assert [s["step"] for s in result.steps] == [2], result.describe()
    _check_megatron_actor(result, "forking")
    # (greedy sampling: vLLM's log-probs are those of the top-1 distribution, so no rollout/actor comparison here)
    assert 0.2 <= result.steps[0]["actor/tokensel/selected_fraction"] < 0.25, result.steps[0]
    dumped = {name: sorted(json_rows((tmp_path / name / "rollouts" / "2.jsonl").read_text().splitlines()))
              for name in ("first", "resumed")}
    assert dumped["first"] and dumped["first"] == dumped["resumed"]  # the same step-2 batch
    for key in ("actor/tokensel/selected_tokens", "actor/tokensel/threshold_min_selected_score", "actor/pg_loss"):
        assert result.steps[0][key] == pytest.approx(first.steps[1][key], rel=1e-6, abs=1e-7), key
    weights = {name: load_file(str(tmp_path / name / "checkpoints" / "global_step_2" / HF_DIR["megatron"] /
                                   "model.safetensors")) for name in ("first", "resumed")}
    before = load_file(str(step_1 / HF_DIR["megatron"] / "model.safetensors"))
    moved = max((weights["first"][k] - before[k]).abs().max().item() for k in before)
    apart = max((weights["first"][k] - weights["resumed"][k]).abs().max().item() for k in before)
    print(f"step 2 moved the weights by {moved:.2e}; resumed vs uninterrupted: {apart:.2e}")
    assert moved > 1e-5 and apart < 1e-6, (moved, apart)


def json_rows(lines: list[str]) -> list[tuple]:
    """(prompt, response, score) of each dumped rollout (the dump's order and uids vary between runs)."""
    import json

    return [(r["input"], r["output"], r["score"]) for r in map(json.loads, filter(str.strip, lines))]


@pytest.mark.slow  # 121 s on 2 cores (start-up, the kill during the first update, the run's end)
def test_megatron_actor_worker_killed_during_the_update(model_dir, tmp_path):
    import signal

    from helpers.pipeline import loss_announcements, prepare_tiny_run, with_overrides
    from helpers.procs import wait_until_busy
    from verl_tokensel_cpu.launch import marked_pids, run_main_ppo

    overrides = with_overrides(prepare_tiny_run(tmp_path, model_dir=model_dir, token_selector="forking", steps=STEPS),
                               [MEGATRON, "actor_rollout_ref.actor.ppo_epochs=40"])
    log_path, stop, killed = tmp_path / "main_ppo.log", threading.Event(), {}

    def kill_actor_when_busy():
        pid = None
        while not stop.is_set() and pid is None:  # the Megatron worker that received the selecting loss
            time.sleep(0.2)
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            said = [a["pid"] for a in loss_announcements(text) if a["pid"] in _shim_pids(text)]
            pid = said[0] if said and "all initialize finished" in text else None
        if pid is not None and wait_until_busy(pid, 1.5, stop=stop):  # 40 epochs: only the update computes that long
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, t=time.monotonic())

    killer = threading.Thread(target=kill_actor_when_busy, daemon=True)
    killer.start()
    try:
        result = run_main_ppo(overrides, timeout_s=RUN_TIMEOUT_S, log_path=log_path)
    finally:
        stop.set()
        killer.join(timeout=5)
    assert "pid" in killed, f"the actor was never killed: {result.describe()}"
    took = time.monotonic() - killed["t"]
    print(f"killed Megatron actor pid {killed['pid']}; the run ended {took:.0f} s later: {result.describe()}")
    assert not result.timed_out and result.returncode != 0 and result.steps == [], result.describe()
    assert took < 150, (took, result.describe())
    assert result.died and "actor" in result.died.lower() and str(killed["pid"]) in result.died, result.died
    assert marked_pids(result.run_id) == [], "processes of the run survived it"
