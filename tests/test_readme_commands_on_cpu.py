"""The README's commands and figures agree with what they stand for: the CPU ``main_ppo`` command composes on the
demo's data and passes every driver check (ours, the CPU switch's, verl's ``validate_config``; the run itself took
2.2 and 2.7 min for its 2 steps on 2 cores, too long for every CI run: ``tests/test_e2e_on_cpu.py`` runs the same
pipeline); the custom-rule command is the one of ``examples/custom_rule.py``; the demo's output folder and warm-up
time are the ones ``verl-tokensel demo --help`` gives; the examples register presets one way, and name the rule they
register.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

from helpers.wheel import ROOT
from verl_tokensel_cpu.cli import demo as demo_cli

README = (ROOT / "README.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


def _bash_block(needle: str) -> str:
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if needle in b]
    assert len(blocks) == 1, f"README: one ```bash block with {needle!r}, found {len(blocks)}"
    return blocks[0]


def test_the_readme_cpu_command_composes_on_the_demos_data_and_passes_the_driver_checks(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_tokensel.verl_glue.install import validate_driver_config
    from verl_tokensel_cpu.demo.tasks import DEFAULT_TASK, get_task
    from verl_tokensel_cpu.pipeline import apply_cpu_pipeline, cli_override_keys
    from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

    lines = [shlex.split(line) for line in _bash_block("verl-tokensel tiny-model").replace("\\\n", " ").splitlines()]
    (tiny,) = [ln for ln in lines if ln[:2] == ["verl-tokensel", "tiny-model"]]
    (run,) = [ln for ln in lines if ln[:3] == ["python", "-m", "verl_tokensel.main_ppo"]]
    overrides = run[3:]
    ov = dict(o.split("=", 1) for o in overrides)
    # the demo's folder (its --out default) holds the data; the tiny model goes where model.path points
    parser = argparse.ArgumentParser()
    demo_cli.add_arguments(parser)
    out = Path(parser.parse_args([]).out)
    assert ov["data.train_files"] == str(out / "data" / "train.parquet")
    assert ov["data.val_files"] == str(out / "data" / "val.parquet")
    assert ov["reward.custom_reward_function.path"] == demo_cli.REWARD_FN
    assert tiny[tiny.index("--out") + 1] == ov["actor_rollout_ref.model.path"]
    assert ov["trainer.device"] == "cpu"

    monkeypatch.chdir(tmp_path)  # the user's folder after the demo: its data, and the tiny model
    spec = get_task(DEFAULT_TASK)
    spec.write_dataset(out / "data", spec.warmup_config(0))
    Path(ov["actor_rollout_ref.model.path"]).parent.mkdir(parents=True, exist_ok=True)
    Path(ov["actor_rollout_ref.model.path"]).symlink_to(build_tiny_model_dir())
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=overrides)
    apply_cpu_pipeline(cfg, explicit_keys=cli_override_keys(overrides), environ={})
    validate_driver_config(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.data.max_prompt_length == spec.max_prompt_length
    assert cfg.data.max_response_length == spec.max_response_length


def test_the_readme_has_the_custom_rule_command_of_its_example():
    doc = (ROOT / "examples" / "custom_rule.py").read_text()
    command = doc.split("from a checkout::", 1)[1].split("\n\n", 2)[1]
    assert _flat(command).startswith("VERL_USE_EXTERNAL_MODULES=examples.custom_rule python -m "), command
    assert _flat(command) in _flat(_bash_block("VERL_USE_EXTERNAL_MODULES=examples.custom_rule"))


def test_the_readme_gives_the_demos_output_folder_and_warm_up_time_as_its_help_does():
    parser = argparse.ArgumentParser()
    demo_cli.add_arguments(parser)
    assert parser.parse_args([]).out == "./tokensel_demo"
    readme = _flat(README)
    assert "It writes into `./tokensel_demo` (`--out`)" in readme
    help_text = _flat(demo_cli.__doc__)  # the description of `verl-tokensel demo --help`
    assert re.search(r"the first warm-up of the tiny model about a minute \(cached afterwards\)", readme)
    assert re.search(r"verl_tokensel_cpu\.demo\.warmup`; about a minute on 2 cores, cached", help_text), help_text
    for text in (readme, help_text):
        assert "~2 min (cached" not in text and "under a minute" not in text


def _register_preset_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == "register_preset"]


def test_the_examples_register_presets_one_way_and_name_their_rule():
    """``register_preset(name, rule="...", **values)`` in every example; ``custom_preset.py``'s docstring names the
    rule its code registers (it said ``mask``)."""
    calls = {p.name: _register_preset_calls(p) for p in sorted((ROOT / "examples").glob("*.py"))}
    assert calls["custom_preset.py"] and calls["custom_score.py"], calls
    for name, found in calls.items():
        for call in found:
            assert len(call.args) == 1 and [k.arg for k in call.keywords][:1] == ["rule"], (name, ast.unparse(call))
    (call,) = calls["custom_preset.py"]
    rule = ast.literal_eval(call.keywords[0].value)
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / "custom_preset.py").read_text()))
    assert re.findall(r"\(rule ``(\w+)``\)", doc) == [rule] == ["gradient_mask"], doc
