"""Config composition (dp and megatron), the verbatim CLI override, YAML == dataclass defaults,
README knob table, and the bad-config matrix: every bad value fails on the driver, naming the key
and the valid values, before any Ray worker starts."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from verl.utils.config import omega_conf_to_dataclass
from verl_tokensel.core.config import PRESETS, TokenSelectionConfig, knob_table_rows
from verl_tokensel.core.errors import TokenSelectionConfigError
from verl_tokensel.verl_glue.actor_config import TokenselFSDPActorConfig, TokenselMcoreActorConfig

ROOT = Path(__file__).resolve().parents[1]


def _compose(name="tokensel_trainer", overrides=()):
    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose(name, overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides])


def _actor(overrides=(), name="tokensel_trainer"):
    cfg = _compose(name, overrides)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_dp_composition_gives_our_actor_class_and_mode():
    cfg = _compose(overrides=["actor_rollout_ref.actor.token_selector=gmts"])
    assert cfg.model_engine == "dp"
    assert cfg.trainer.v1.trainer_mode == "tokensel_sync"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor) is TokenselFSDPActorConfig
    assert actor.selection == PRESETS["gmts"]


def test_megatron_composition_gives_mcore_class():
    cfg = _compose("tokensel_megatron_trainer", ["actor_rollout_ref.actor.token_selector=forking"])
    assert cfg.model_engine == "megatron"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor) is TokenselMcoreActorConfig
    assert actor.selection == PRESETS["forking"]


def test_the_megatron_config_is_ppo_trainer_with_the_megatron_engine():
    """verl 0.9.1 marks ``ppo_megatron_trainer`` deprecated (it is ``ppo_trainer`` + ``model_engine=megatron``): ours
    and the Megatron recipes compose ``ppo_trainer`` with ``model_engine: megatron``, to the same tree as verl's
    deprecated config plus our actor node."""
    for path in [ROOT / "verl_tokensel/config/tokensel_megatron_trainer.yaml",
                 ROOT / "verl_tokensel/recipes/base/megatron.yaml"]:
        defaults = yaml.safe_load(path.read_text())["defaults"]
        assert not [d for d in defaults if "ppo_megatron_trainer" in str(d)], (path, defaults)
        assert {"override model_engine": "megatron"} in defaults or {"override /model_engine": "megatron"} in defaults
    ours = _compose("tokensel_megatron_trainer")
    with initialize_config_module("verl.trainer.config", version_base=None):
        verls = compose("ppo_megatron_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    ours_actor, verls_actor = ours.actor_rollout_ref.actor, verls.actor_rollout_ref.actor
    assert ours_actor._target_ == "verl_tokensel.verl_glue.actor_config.megatron_actor_config"
    with open_dict(ours_actor), open_dict(verls_actor):
        for key in ("token_selector", "token_selection", "_target_"):
            ours_actor.pop(key)
        verls_actor.pop("_target_")
    ours.trainer.v1.trainer_mode = verls.trainer.v1.trainer_mode
    assert OmegaConf.to_container(ours) == OmegaConf.to_container(verls)


@pytest.mark.parametrize("preset", ["kl_cov_global", "clip_cov_global", "archer", "ar", "lopti", "ar_lopti",
                                    "entropy_adv", "stapo", "ce_gppo", "aspo", "ktae", "gtpo", "fipo",
                                    "m2po_global"])
def test_toolbox_presets_compose_for_megatron(preset):
    extra = ["actor_rollout_ref.actor.use_kl_loss=true"] if preset == "archer" else []
    cfg = _compose("tokensel_megatron_trainer", [f"actor_rollout_ref.actor.token_selector={preset}", *extra])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor) is TokenselMcoreActorConfig
    assert actor.selection == PRESETS[preset]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_resolves(preset):
    # archer weights the KL loss per token: it needs the KL loss on (refused otherwise: test_rules_on_cpu.py)
    extra = ["actor_rollout_ref.actor.use_kl_loss=true"] if preset == "archer" else []
    actor = _actor([f"actor_rollout_ref.actor.token_selector={preset}", *extra])
    assert actor.selection == PRESETS[preset]


def test_knob_override_wins_over_preset():
    actor = _actor([
        "actor_rollout_ref.actor.token_selector=forking",
        "actor_rollout_ref.actor.token_selection.ratio=0.1",
        "actor_rollout_ref.actor.token_selection.scope=micro_batch_dp",
        "actor_rollout_ref.actor.token_selection.normaliser=all",
        "actor_rollout_ref.actor.token_selection.mask_entropy_bonus=true",
    ])
    sel = actor.selection
    assert (sel.ratio, sel.scope, sel.normaliser, sel.mask_entropy_bonus, sel.score) == (
        0.1, "micro_batch_dp", "all", True, "entropy")


def test_yaml_mirrors_dataclass_defaults():
    """actor.yaml declares every knob of declared_keys() (the shared keys, the ranking, every registered rule's and
    shaping's own knobs: null, the preset's value) and the engine switches with their defaults."""
    from verl_tokensel.core.config import declared_keys

    path = ROOT / "verl_tokensel" / "config" / "tokensel" / "actor.yaml"
    text = path.read_text()
    node = yaml.safe_load(text)
    assert node["token_selector"] == "none"
    knobs = {k: v for k, v in node["token_selection"].items() if k != "_target_"}
    assert knobs == {name: default for name, default, _ in declared_keys()}
    # verl's style: every key has a comment line above it
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and ":" in stripped and not stripped.endswith(":"):
            assert lines[i - 1].strip().startswith("#"), f"{path.name}:{i + 1} key without a comment: {line}"


def test_readme_knob_table_and_yaml_are_generated_from_the_knob_fields():
    """One source for each knob's meaning: the README table, actor.yaml and docs/knobs.md are what
    scripts/knob_docs.py renders from the rules' and the shared config's fields (``python scripts/knob_docs.py
    --write`` after changing one). The README holds the shared keys, the ranking and the engine switches; each rule's
    and shaping's own knobs are on docs/knobs.md."""
    import importlib.util

    from verl_tokensel.core.config import declared_keys

    spec = importlib.util.spec_from_file_location("knob_docs", ROOT / "scripts" / "knob_docs.py")
    knob_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(knob_docs)
    readme = (ROOT / "README.md").read_text()
    assert knob_docs.readme_with_table(readme) == readme, "README knob table is stale: run scripts/knob_docs.py --write"
    assert knob_docs.actor_yaml() == knob_docs.ACTOR_YAML.read_text(), "actor.yaml is stale: run knob_docs --write"
    assert knob_docs.knobs_md() == knob_docs.KNOBS_MD.read_text(), "docs/knobs.md is stale: run knob_docs --write"
    for path, text in knob_docs.wanted().items():  # docs/fidelity.md's deviations and docs/rule-api.md too
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run scripts/knob_docs.py --write"
    page = knob_docs.KNOBS_MD.read_text()
    rows = {row[0]: row[1] for row in knob_table_rows()}
    for name, default, meta in declared_keys():
        own = meta.get("group") != "engine" and meta.get("declared") not in (["shared"], ["ranking"])
        assert (f"| `token_selection.{name}` |" in page) == own, name
        assert (f"| `token_selection.{name}` | {rows[f'token_selection.{name}']} |" in readme) != own, name


def _cli(*args, timeout=240):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(ROOT))


def test_verbatim_cli_override_both_entry_points():
    ours = _cli("verl_tokensel.main_ppo", "actor_rollout_ref.actor.token_selector=gmts", "--cfg", "job")
    assert ours.returncode == 0, ours.stderr[-2000:]
    job = yaml.safe_load(ours.stdout)
    assert job["actor_rollout_ref"]["actor"]["token_selector"] == "gmts"
    stock = _cli("verl.trainer.main_ppo", "--config-path=pkg://verl_tokensel.config",
                 "--config-name=tokensel_trainer", "actor_rollout_ref.actor.token_selector=gmts",
                 "actor_rollout_ref.actor.token_selection.ratio=0.3", "--cfg", "job")
    assert stock.returncode == 0, stock.stderr[-2000:]
    job = yaml.safe_load(stock.stdout)
    assert job["actor_rollout_ref"]["actor"]["token_selection"]["ratio"] == 0.3


def test_bad_value_fails_on_driver_before_ray():
    res = _cli("verl_tokensel.main_ppo", "actor_rollout_ref.actor.token_selector=forking",
               "actor_rollout_ref.actor.token_selection.ratio=1.5",
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "token_selection.ratio=1.5 is invalid" in out and "(0, 1]" in out
    assert "ray init kwargs" not in out and "Started a local Ray instance" not in out


SEL = "actor_rollout_ref.actor.token_selector"
KNOB = "actor_rollout_ref.actor.token_selection."
BAD = [
    ([f"{SEL}=bogus"], "token_selector='bogus'", "forking"),
    ([f"{SEL}=forking", f"{KNOB}ratio=0"], "ratio=0", "(0, 1]"),
    ([f"{SEL}=forking", f"{KNOB}ratio=-0.2"], "ratio=-0.2", "(0, 1]"),
    ([f"{SEL}=forking", f"{KNOB}ratio=1.0001"], "ratio=1.0001", "(0, 1]"),
    ([f"{SEL}=forking", f"{KNOB}ratio=nan"], "ratio=nan", "(0, 1]"),
    ([f"{SEL}=forking", f"{KNOB}ratio=inf"], "ratio=inf", "(0, 1]"),
    ([f"{SEL}=forking", f"{KNOB}ratio=abc"], "ratio='abc'", "(0, 1]"),
    ([f"{SEL}=forking", f"{KNOB}scope=batchx"], "scope='batchx'", "micro_batch_dp"),
    ([f"{SEL}=forking", f"{KNOB}normaliser=mean"], "normaliser='mean'", "selected"),
    ([f"{SEL}=forking", f"{KNOB}score=loss"], "score='loss'", "grad_norm"),
    ([f"{SEL}=forking", f"{KNOB}direction=up"], "direction='up'", "bottom"),
    ([f"{SEL}=forking", f"{KNOB}seed=-1"], "seed=-1", "integer >= 0"),
    ([f"{SEL}=forking", f"{KNOB}seed=1.5"], "seed=1.5", "integer >= 0"),
    ([f"{SEL}=forking", f"{KNOB}mask_kl_loss=maybe"], "mask_kl_loss='maybe'", "true, false"),
    ([f"{SEL}=forking", f"{KNOB}auto_enable_entropy=false"], "calculate_entropy=False", "auto_enable_entropy"),
    ([f"{SEL}=forking", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
     "normaliser='selected'", "token-mean"),
    ([f"{SEL}=gmts", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "loss_mode='gspo'", "vanilla"),
    ([f"{SEL}=grad_norm", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=full"],
     "kl_loss_type='full'", "low_var_kl"),
    ([f"{SEL}=none", f"{KNOB}ratio=0.3"], "token_selection.ratio set while", "pick a selector"),
]


@pytest.mark.parametrize("overrides,needle,valid", BAD, ids=[b[1] for b in BAD])
def test_bad_config_matrix(overrides, needle, valid):
    with pytest.raises(Exception) as exc:
        _actor(overrides)
    msg = str(exc.value)
    assert needle in msg, msg
    assert valid in msg, msg
    assert "actor_rollout_ref.actor." in msg


def test_entropy_not_needed_when_already_on():
    actor = _actor([f"{SEL}=forking", f"{KNOB}auto_enable_entropy=false",
                    "actor_rollout_ref.actor.calculate_entropy=true"])
    assert actor.selection.score == "entropy"


def test_unsupported_engine_named():
    from verl_tokensel.verl_glue.actor_config import torchtitan_actor_config

    with pytest.raises(TokenSelectionConfigError, match="^model_engine='torchtitan' is invalid; valid values: dp, "
                                                        "megatron"):
        torchtitan_actor_config()


def test_nan_ratio_really_nan():
    actor_cfg = _compose(overrides=[f"{SEL}=forking"])
    assert math.isnan(float("nan"))  # sanity of the parametrised case above
    assert OmegaConf.select(actor_cfg, "actor_rollout_ref.actor.token_selection.ratio") is None


def test_v1_trainer_mode_without_tokensel_prefix_fails_on_driver():
    res = _cli("verl_tokensel.main_ppo", "actor_rollout_ref.actor.token_selector=forking",
               "trainer.v1.trainer_mode=sync", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "trainer.v1.trainer_mode='sync' is invalid" in out and "tokensel_sync" in out
    assert "Started a local Ray instance" not in out


def test_validate_driver_config_accepts_stock_and_v0():
    from verl_tokensel.verl_glue.install import validate_driver_config

    validate_driver_config(_compose(overrides=["trainer.v1.trainer_mode=sync"]))  # selector none
    validate_driver_config(_compose(overrides=[f"{SEL}=gmts", "trainer.use_v1=false", "trainer.v1.trainer_mode=sync"]))
    validate_driver_config(_compose(overrides=[f"{SEL}=gmts"]))


@pytest.mark.parametrize("use_v1", [False, True])
def test_the_v0_route_needs_no_task_runner_v1(use_v1, monkeypatch):
    """verl's announced branch without TaskRunnerV1 (use_v1 false by default): ``verl_tokensel.main_ppo`` reaches
    verl's ``run_ppo`` with our v0 TaskRunner without importing it; the V1 route still takes verl's. ``run_ppo``
    is recorded instead of run (it would start Ray); validation runs as it is."""
    import verl.trainer.main_ppo as verl_main

    from verl_tokensel import main_ppo
    from verl_tokensel_cpu import tiny_model

    tiny_model_dir = tiny_model.build_tiny_model_dir()  # the shared cached one: validation loads its tokenizer
    seen = {}
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: seen.update(runner=task_runner_class))
    cfg = _compose(overrides=[f"{SEL}=forking", f"trainer.use_v1={str(use_v1).lower()}",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                              f"actor_rollout_ref.model.path={tiny_model_dir}", f"critic.model.path={tiny_model_dir}",
                              "algorithm.adv_estimator=grpo"])
    if use_v1:
        main_ppo.run(cfg)
        assert seen["runner"] is verl_main.TaskRunnerV1
        return
    monkeypatch.delattr(verl_main, "TaskRunnerV1")
    main_ppo.run(cfg)
    runner = getattr(seen["runner"], "__ray_actor_class__", seen["runner"])
    assert runner.__name__ == "TokenselTaskRunner", seen


def test_fused_kernels_refused_where_the_scoring_pass_needs_sum_pi_squared():
    from verl_tokensel.verl_glue.install import validate_driver_config

    fused = "actor_rollout_ref.model.use_fused_kernels=true"
    node = SEL.rsplit(".", 1)[0]
    for source, needle in (("prepass", r"use_fused_kernels=True is invalid; valid values: False\. .*"
                                       r"token_selector=grad_norm with score_source=prepass: its scoring pass needs "
                                       r"sum_j p_j\^2"),
                           ("rollout", r"use_fused_kernels=True is invalid; valid values: False\. "
                                       r"token_selection\.score=grad_norm with score_source=rollout")):
        with pytest.raises(TokenSelectionConfigError, match=needle):
            validate_driver_config(_compose(overrides=[f"{SEL}=grad_norm", fused, f"{node}.token_selection.scope=group",
                                                       f"{node}.token_selection.score_source={source}"]))
    # fine: the in-loss grad_norm (lower bound without sum p^2) and every entropy score
    validate_driver_config(_compose(overrides=[f"{SEL}=grad_norm", fused]))
    validate_driver_config(_compose(overrides=[f"{SEL}=gmts", fused]))
    validate_driver_config(_compose(overrides=[f"{SEL}=forking_paper", fused]))


def test_readme_recipe_snippet_composes(tmp_path):
    from hydra import initialize_config_dir

    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("In your own recipe YAML", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    (tmp_path / "my_recipe.yaml").write_text(snippet)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose("my_recipe", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.selection.score == "gmts" and actor.selection.ratio == 0.2
    assert cfg.trainer.v1.trainer_mode == "tokensel_sync"


def test_selection_fields_are_the_knob_set():
    """declared_keys() (what actor.yaml declares and TokenSelectionConfig takes) is the knob set: the shared keys,
    the ranking, every registered rule's and shaping's own knobs and the engine switches; every resolved Selection's
    flat view is among them, and the shared config keeps at most 12 fields."""
    from verl_tokensel.core.config import ENGINE_SWITCHES, SHARED_KEYS, Selection, declared_keys
    from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY, Knobs

    assert set(ENGINE_SWITCHES) == {"auto_enable_entropy", "no_grad_scores", "prepass_reuse"}
    assert len(fields(Selection)) <= 12
    declared = {"rule", *SHARED_KEYS, *(f.name for f in fields(Knobs)), *ENGINE_SWITCHES}
    declared |= {f.name for r in RULE_REGISTRY.values() for f in fields(r.Knobs)}
    declared |= {f.name for s in SHAPING_REGISTRY.values() for f in fields(s.Knobs)}
    names = [name for name, _, _ in declared_keys()]
    assert len(names) == len(set(names)) and set(names) == declared
    assert {n for n, _, m in declared_keys() if m.get("group") == "engine"} == set(ENGINE_SWITCHES)
    defaults = TokenSelectionConfig()
    assert all(getattr(defaults, n) == d for n, d, _ in declared_keys())
    for sel in PRESETS.values():
        assert sel is None or set(sel.as_knobs()) <= declared


def test_actor_config_is_resolved_once_per_node_content():
    from verl_tokensel.verl_glue.actor_config import actor_selection, resolve_actor_config

    cfg = _compose(overrides=["actor_rollout_ref.actor.token_selector=gmts"])
    first = resolve_actor_config(cfg)
    assert resolve_actor_config(cfg) is first
    assert actor_selection(cfg) is first.selection and first.selection == PRESETS["gmts"]
    cfg.actor_rollout_ref.actor.token_selection.ratio = 0.5  # changed in place: resolved again
    assert resolve_actor_config(cfg) is not first and actor_selection(cfg).ratio == 0.5
