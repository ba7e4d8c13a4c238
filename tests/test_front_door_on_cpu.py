"""What a new user meets first: our config errors before verl's, with the closest valid name; the view page's
account of how a preset trains; ``verl-tokensel env``'s checks; the demo's progress line and plot.

(The product wheel next to verl alone: ``test_wheel_verl_only_on_cpu``; signals to the demo:
``test_demo_signals_on_cpu``.)
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from verl.utils.config import omega_conf_to_dataclass
from verl_tokensel.analysis.page import TRAINING_NORMALISER, TRAINING_SCOPE, TRAINING_SOURCE, training_line
from verl_tokensel.core.errors import TokenSelectionConfigError, config_error, suggest
from verl_tokensel.core.resolve.presets import PRESETS

SEL = "actor_rollout_ref.actor.token_selector"


# ---------------------------------------------------------------- did you mean

@pytest.mark.parametrize("value,valid,expect", [
    ("gmtss", PRESETS, "gmts"),
    ("GMTS", PRESETS, "gmts"),
    ("forkng", PRESETS, "forking"),
    ("micro-batch", ("micro_batch", "micro_batch_dp", "sequence", "mini_batch", "group", "batch"), "micro_batch"),
    ("gmts", PRESETS, None),  # valid: nothing to suggest
    ("qwerty", PRESETS, None),  # resembles nothing
    (0.5, ("0.5",), None),  # not a name
    ("a numbr", ("a number in (0, 1]",), None),  # descriptions are never suggested
])
def test_suggest(value, valid, expect):
    assert suggest(value, valid) == expect


def test_config_error_says_did_you_mean_and_keeps_the_valid_values():
    msg = str(config_error("token_selection.scope", "grop", "micro_batch, sequence, group, batch"))
    assert msg == ("actor_rollout_ref.actor.token_selection.scope='grop' is invalid (did you mean group?); "
                   "valid values: micro_batch, sequence, group, batch.")
    assert "did you mean" not in str(config_error("token_selection.ratio", 2.0, "a number in (0, 1]"))


# ---------------------------------------------------------------- our checks before verl's

def _actor(name, overrides):
    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose(name, overrides=list(overrides))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@pytest.mark.parametrize("name", ["tokensel_trainer", "tokensel_megatron_trainer"])
def test_a_misspelt_preset_is_named_before_verls_micro_batch_assertion(name):
    """No ``ppo_micro_batch_size*`` override: verl's own assertion on it would fire first if ours ran after."""
    with pytest.raises(Exception) as exc:
        _actor(name, [f"{SEL}=gmtss"])
    msg = str(exc.value)
    assert "token_selector='gmtss' is invalid (did you mean gmts?)" in msg, msg
    assert isinstance(exc.value, TokenSelectionConfigError) or "TokenSelectionConfigError" in msg, msg
    # a valid preset still meets verl's check (ours runs first, verl's still runs)
    with pytest.raises(Exception, match="ppo_micro_batch_size"):
        _actor(name, [f"{SEL}=gmts"])


# ---------------------------------------------------------------- the view page

@pytest.mark.parametrize("preset", [p for p, sel in PRESETS.items() if sel is not None])
def test_the_view_page_says_how_the_preset_trains(preset):
    sel = PRESETS[preset]
    line = training_line(sel)
    assert f"scope {sel.scope}: the pool is {TRAINING_SCOPE[sel.scope]}" in line, line
    assert f"score_source {sel.score_source}: scores from {TRAINING_SOURCE[sel.score_source]}" in line, line
    assert f"normaliser {sel.normaliser}: token-mean over {TRAINING_NORMALISER[sel.normaliser]}" in line, line
    if sel.scope != "micro_batch":
        assert "each micro-batch on each rank" not in line, line


def test_gmts_trains_on_prompt_groups_of_the_mini_batch():
    line = training_line(PRESETS["gmts"])
    assert "the pool is each prompt group (the responses sharing a prompt) of the PPO mini-batch" in line, line
    assert "a no-grad forward at the start of each PPO mini-batch" in line and "normaliser all" in line, line
    assert "of the training batch" in training_line(PRESETS["ktae"])  # a group ranked on the driver


# ---------------------------------------------------------------- verl-tokensel env

def test_env_checks_the_cpu_stack_only_where_it_applies(monkeypatch):
    from verl_tokensel.cli import env

    monkeypatch.setattr(env, "entry_points", lambda group: [])  # the product alone: no CPU device port
    assert not env.cpu_checks_apply(())
    assert env.cpu_checks_apply(("trainer.device=cpu",))
    monkeypatch.undo()
    assert env.cpu_checks_apply(())  # this checkout: the CPU distribution is installed


# ---------------------------------------------------------------- the demo's progress line and plot

def test_the_progress_line_names_the_resources_of_the_machine():
    from verl_tokensel_cpu.launch import last_stage

    log = "ray init kwargs: {}\n(TaskRunner pid=1) create worker group\n"
    assert "logical GPUs trainer.device=cpu declares" in last_stage(log, "cpu")
    assert "GPU bundles" not in last_stage(log, "cpu")
    assert "GPU bundles" in last_stage(log, "gpu")


def test_coinciding_plot_lines_stay_apart(tmp_path, monkeypatch):
    """Runs with the same rewards draw the same points. Each line gets its own marker and dashes."""
    import matplotlib.axes

    from verl_tokensel_cpu.demo import report

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **kw: drawn.append((kw["label"], kw)) or real(self, *a, **kw))
    same = [{"critic/score/mean": 0.5, "actor/tokensel/selected_fraction": 0.2}] * 3
    runs = {"none": same, "forking": same, "gmts": same, "random": same}
    report.plot(runs, tmp_path / "demo.png", [report.summarise(p, steps) for p, steps in runs.items()])
    styles = {label: (kw["marker"], str(kw["linestyle"]), kw["markersize"]) for label, kw in drawn}
    assert len(styles) == 4 and len(set(styles.values())) == 4, styles


def test_the_demo_console_drops_known_third_party_notices_and_keeps_them_in_a_log(tmp_path, capsys):
    import logging
    import sys
    import warnings

    from verl_tokensel_cpu.demo.console import drop_noise, quiet_console

    lib_logger = logging.getLogger("tokensel_test_lib")
    lib_logger.addHandler(logging.StreamHandler(sys.stderr))  # a handler a library set up at import
    try:
        with quiet_console(tmp_path / "noise.log"):
            print("[demo 0m01s] [1/3] none: step 1/12 done", file=sys.stderr)
            # what Python prints for a warning: the message line, then its indented source line
            sys.stderr.write(warnings.formatwarning("Apex is not installed. Falling back to Torch Norm", UserWarning,
                                                    "backends.py", 21, 'warnings.warn("Apex is not installed.")'))
            lib_logger.warning("(SimpleStorageUnit pid=7) WARNING - transfer_queue.utils.common - target_num_threads "
                               "8 should not exceed total physical CPU cores 2. Setting to 2.")
            sys.stderr.write("Loading weights:   0%|   | 0/27\rLoading weights: 100%|###| 27/27\n")
            print("reward curves: demo.png")
            lib_logger.warning("a warning of our own")
    finally:
        lib_logger.handlers.clear()
    out, err = capsys.readouterr()
    assert out == "reward curves: demo.png\n"
    assert err == "[demo 0m01s] [1/3] none: step 1/12 done\na warning of our own\n", err
    kept = (tmp_path / "noise.log").read_text()
    assert "Apex is not installed" in kept and "target_num_threads" in kept and "Loading weights: 100%" in kept
    tail = ["step 3\n", "x.py:1: UserWarning: torchtitan engine is not available: no\n", "  warnings.warn(\n",
            "Traceback (most recent call last):\n"]
    assert drop_noise(tail) == ["step 3\n", "Traceback (most recent call last):\n"]


def test_an_unknown_knob_on_the_command_line_gets_the_closest_one():
    """Hydra would say "Key 'ratoi' is not in struct" (or, with +, our config class would list every key)."""
    from verl_tokensel.main_ppo import unknown_knob_line

    line = unknown_knob_line(["actor_rollout_ref.actor.token_selector=gmts",
                              "+actor_rollout_ref.actor.token_selection.ratoi=0.3"])
    assert line.startswith("verl-tokensel: actor_rollout_ref.actor.token_selection.ratoi is not a token-selection knob "
                           "of any registered rule (did you mean ratio?); valid knobs: "), line
    assert ", ratio, " in line and ", gtpo_entropy_scale, " in line, line  # the shared keys and every rule's
    assert unknown_knob_line(["actor_rollout_ref.actor.token_selection.ratio=0.3", "trainer.device=cpu"]) is None
    assert "did you mean" not in unknown_knob_line(["actor_rollout_ref.actor.token_selection.zzzz=1"])
