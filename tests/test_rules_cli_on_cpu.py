"""``verl-tokensel rules [preset]``: every rule, shaping and preset listed (a user's too, through
VERL_USE_EXTERNAL_MODULES); what each preset does (its rule, formula, every knob's value, default and paper value);
an unknown preset refused with the valid names; and the generated docs (README table, docs/knobs.md, actor.yaml) as
scripts/knob_docs.py renders them from the same fields.

The renderings run in-process (core.resolve.describe, pure torch); the command itself runs three times as a
subprocess."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_tokensel.core.resolve.describe import describe_preset, describe_rules, show
from verl_tokensel.core.resolve.presets import PRESETS
from verl_tokensel.core.rules import RULE_REGISTRY, SHAPING_REGISTRY, Knobs
from verl_tokensel.core.seam.knobs import knob_fields

ROOT = Path(__file__).resolve().parents[1]
# the rules and presets registered by this package (a test that imports a user module adds its own later)
BUILTIN_RULES = ("archer", "aspo", "ce_gppo", "clip_cov", "fipo", "gradient_mask", "gtpo", "kl_cov", "ktae", "lopti",
                 "m2po", "stapo")
BUILTIN_SHAPINGS = ("ar", "entropy_adv")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", "rules", *args], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT), env={**os.environ, **(env or {})})


def _knob_docs():
    spec = importlib.util.spec_from_file_location("knob_docs", ROOT / "scripts" / "knob_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", BUILTIN_RULES + BUILTIN_SHAPINGS)
def test_every_builtin_rule_and_shaping_says_its_source_and_formula(name):
    component = RULE_REGISTRY[name] if name in RULE_REGISTRY else SHAPING_REGISTRY[name]
    about = component.about
    assert about.source.strip() and about.formula.strip(), name
    assert "\n" not in about.formula, f"{name}: the formula is one line"
    assert all(isinstance(d, str) and d.strip() for d in about.deviations), name


def test_the_command_lists_every_rule_shaping_and_preset():
    res = _cli()
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    for name in (*RULE_REGISTRY, *SHAPING_REGISTRY, *PRESETS):
        assert any(line.split()[:1] == [name] for line in lines), name
    for name, sel in PRESETS.items():
        if sel is not None:
            assert any(line.split()[:3] == [name, "rule", sel.rule + ";" if sel.shaping == "none" else sel.rule]
                       for line in lines), name
    assert res.stdout == describe_rules()


@pytest.mark.parametrize("name", [p for p, sel in PRESETS.items() if sel is not None])
def test_each_preset_prints_its_rule_formula_and_every_knob(name):
    sel = PRESETS[name]
    text = describe_preset(name)
    assert text.startswith(f"token_selector={name}: rule {sel.rule}")
    assert " ".join(sel.impl.about.formula.split()) in " ".join(text.split())
    assert " ".join(sel.impl.about.source.split()) in " ".join(text.split())
    lines = text.splitlines()
    fields = [*dataclasses.fields(Knobs), *knob_fields(type(sel.knobs))]
    for f in fields:  # knob, value, default, then the paper value (wrapped)
        want = [f.name, show(getattr(sel.knobs, f.name)), show(f.default), f.metadata["paper"].split()[0]]
        assert any(ln.split()[:4] == want for ln in lines), (name, want)
    if sel.shaping != "none":
        assert f"Shaping {sel.shaping}" in text
        for f in dataclasses.fields(type(sel.shaping_knobs)):
            assert any(ln.split()[:3] == [f.name, show(getattr(sel.shaping_knobs, f.name)), show(f.default)]
                       for ln in lines), (name, f.name)


def test_one_preset_through_the_command_and_an_unknown_one_refused():
    res = _cli("gmts")
    assert res.returncode == 0 and res.stdout == describe_preset("gmts"), res.stderr[-2000:]
    res = _cli("gmst")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "gmst" in res.stderr and "Did you mean gmts?" in res.stderr and "forking, forking_paper" in res.stderr


def test_a_rule_and_preset_of_user_code_through_verl_use_external_modules():
    res = _cli(env={"VERL_USE_EXTERNAL_MODULES": "examples.custom_rule"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split()[:3] for line in res.stdout.splitlines()]
    assert ["surprise_weight", "A'", "="] in rows  # the rule, with its formula
    assert ["surprise_weight", "rule", "surprise_weight;"] in rows  # the preset


def test_the_generated_docs_are_up_to_date():
    knob_docs = _knob_docs()
    for path, text in knob_docs.wanted().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run scripts/knob_docs.py --write"
    page = knob_docs.KNOBS_MD.read_text(encoding="utf-8")
    for name in (*BUILTIN_RULES, *BUILTIN_SHAPINGS):
        assert f"### `{name}`" in page, name
