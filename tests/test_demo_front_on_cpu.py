"""What ``verl-tokensel demo`` promises at its front: everything under ``--out`` (Hydra's run folder of each preset
too), a preset of the user's own through ``VERL_USE_EXTERNAL_MODULES`` (as ``verl-tokensel rules`` takes it), and a
``demo.png`` whose second panel is the table's telling figure: where a preset's selected tokens sit against the
decisions' share of all tokens. No verl run here: composition, argument checks, the plot (seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.wheel import ROOT
from verl_tokensel_cpu.cli import demo as demo_cli
from verl_tokensel_cpu.demo import report


def test_hydra_run_folders_lie_inside_out(tmp_path):
    """Hydra's run folder (its ``.hydra/`` copy of the config, ``main_ppo.log``) of each preset is under ``--out``,
    one per preset, as composed (it was ``./outputs/<date>/<time>``). In-process Hydra, no Ray."""
    from hydra import compose, initialize_config_module

    out = tmp_path / "demo"
    dirs = set()
    for preset in ("none", "forking"):
        overrides = demo_cli.demo_overrides(preset, "/m", "/d/train.parquet", "/d/val.parquet", out, steps=3)
        with initialize_config_module("verl_tokensel.config", version_base=None):
            cfg = compose("tokensel_trainer", overrides=overrides, return_hydra_config=True)
        run_dir = Path(cfg.hydra.run.dir)
        assert run_dir == demo_cli.hydra_run_dir(out, preset) and run_dir.is_relative_to(out), run_dir
        assert cfg.hydra.output_subdir == ".hydra"  # verl's own composed-config copy, kept, inside run_dir
        dirs.add(run_dir)
    assert len(dirs) == 2


def _demo_args(*args: str, modules: str) -> subprocess.CompletedProcess:
    """``verl-tokensel demo`` from the checkout's root, stopped by argparse after ``--presets`` is checked (``--steps
    0`` is refused next): the preset check alone, no run."""
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=modules)
    return subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", "demo", *args, "--steps", "0"],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)


def test_a_preset_of_your_own_from_verl_use_external_modules():
    """The preset of ``examples/custom_rule.py`` is a valid ``--presets`` entry once its module is listed (it was
    refused as unknown); a module that fails to import is named, exit 2."""
    res = _demo_args("--presets", "none,surprise_weight", modules="examples.custom_rule")
    assert res.returncode == 2 and "argument --steps: must be > 0" in res.stderr, res.stderr[-2000:]
    assert "--presets" not in res.stderr.splitlines()[-1], res.stderr[-2000:]
    res = _demo_args("--presets", "none", modules="examples.no_such_module")
    assert res.returncode == 2, res.stderr[-2000:]
    assert ("argument --presets: VERL_USE_EXTERNAL_MODULES='examples.no_such_module': importing it failed: "
            "ModuleNotFoundError") in res.stderr, res.stderr[-2000:]


def test_the_second_panel_is_the_selection_on_the_decisions(tmp_path, monkeypatch):
    """Right panel: per preset, the share of its selected tokens on the decisions and the decisions' share of all
    tokens (the table's ``sel on dec`` / ``dec share``), not the selected fraction (1.0 / 0.2 / 0.2, known ahead);
    a preset without rollout statistics gets no bar."""
    import matplotlib.axes

    bars, lines = [], []
    real_bar, real_plot = matplotlib.axes.Axes.bar, matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, h, *a, **kw: bars.append((kw["label"], list(h))) or real_bar(self, x, h, *a,
                                                                                                      **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, **kw: lines.append((kw["label"], list(y))) or real_plot(self, x, y, **kw))
    steps = {"none": [{"critic/score/mean": 0.5}, {"critic/score/mean": 0.6}],
             "forking": [{"critic/score/mean": 0.4, "actor/tokensel/selected_fraction": 0.2}] * 2,
             "gmts": [{"critic/score/mean": 0.45, "actor/tokensel/selected_fraction": 0.2}] * 2}
    rollouts = {"none": (0.096, 0.096), "forking": (0.356, 0.095), "gmts": (None, None)}
    rows = [report.summarise(p, s, rollouts={"selected_on_decision_share": rollouts[p][0],
                                             "decision_token_share": rollouts[p][1]}) for p, s in steps.items()]
    report.plot(steps, tmp_path / "demo.png", rows)
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert [label for label, _ in lines] == ["none", "forking", "gmts"]  # the reward lines only
    assert lines[1][1] == [0.4, 0.4]
    (sel_label, sel), (dec_label, dec) = bars
    assert "selected tokens on the decisions" in sel_label and "share of all response tokens" in dec_label
    assert sel[:2] == [0.096, 0.356] and dec[:2] == [0.096, 0.095]
    assert all(v != v for v in (sel[2], dec[2]))  # gmts: nan, no bar
