"""Every preset's loss and gradient, through verl's real FSDP2 and Megatron ``TrainingWorker`` on fixed seeded
batches, equal the values recorded on main at 8b11462, before the rule seam in ten names
(``tests/data/rules_golden.json``, written by :mod:`helpers.rules_golden`), to 1e-6 (relative where the value exceeds
1). The record covers every preset of ``PRESETS`` (:data:`helpers.rules_golden.RUNS`: 25 runs, 22 presets; ``delta``,
added after the seam, recorded at f24a104 with the other runs reproduced to the tolerance on the same machine;
``lp_reg`` and ``simko``, FSDP only, added with the vocabulary seam and recorded with it).

Every run was recorded on 8b11462 on the CI's machine type (2-core x86_64, torch 2.13.0+cpu); the first record
(2e9923f, another machine) differed from it by up to 8e-7 relative, close to the tolerance, so the whole record was
made again on one machine. ``archer`` is the released per-class KL term; ``archer_kl_mean_all`` the earlier one.

Cost on 2 cores: one spawned process, a Megatron and an FSDP2 build, two old passes and 50 updates of a 131k-parameter
model: ~25 s.
"""

from __future__ import annotations

import json

import pytest

from verl_tokensel.core.resolve.presets import PRESETS
from verl_tokensel_cpu import tiny_model

from helpers import rules_golden as G

pytestmark = pytest.mark.requires("megatron", "mbridge")

TOL = 1e-6


@pytest.fixture(scope="module")
def now(tmp_path_factory):
    model_dir = str(tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_golden") / "qwen2",
                                                    **tiny_model.MEGATRON_TINY_CONFIG))
    return G.record(model_dir)


@pytest.fixture(scope="module")
def before():
    return json.loads(G.GOLDEN.read_text())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _diff(run: dict, ref: dict) -> list[str]:
    bad = [] if _close(run["loss"], ref["loss"]) else [f"loss {run['loss']!r} != {ref['loss']!r}"]
    for param, values in ref["grads"].items():
        for i, (x, y) in enumerate(zip(run["grads"][param], values)):
            if not _close(x, y):
                bad.append(f"{param}[{i}] {x!r} != {y!r}")
    return bad


def _runs(engine: str) -> set:
    return set(G.RUNS) - (set(G.FSDP_ONLY) if engine == "megatron" else set())


def test_the_record_covers_every_preset(before):
    assert {preset for preset, _, _ in G.RUNS.values()} == set(PRESETS)
    for engine in ("fsdp", "megatron"):
        assert set(before[engine]) == _runs(engine), engine


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_every_preset_keeps_its_loss_and_gradient(now, before, engine):
    assert set(now[engine]) == _runs(engine)
    bad = {name: _diff(now[engine][name], before[engine][name]) for name in _runs(engine)}
    assert not {k: v for k, v in bad.items() if v}, bad


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_archer_default_kl_term_differs_from_kl_mean_all(now, engine):
    assert _diff(now[engine]["archer"], now[engine]["archer_kl_mean_all"]), "archer's KL term is the earlier one"
