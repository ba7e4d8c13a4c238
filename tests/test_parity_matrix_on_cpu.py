"""Stock parity: whatever stock verl runs, every preset runs; whatever it refuses, every preset refuses alike.

A seeded pairwise design (:func:`helpers.parity.pairwise`) over the actor settings users vary: mini-batch size and
count, micro-batch size, the log-prob micro-batch size (smaller than, equal to, larger than a mini-batch),
``use_dynamic_bsz`` with a tight and a loose token limit, ``use_remove_padding``, ``ppo_epochs``, ``rollout.n``
(prompt groups split across micro-batches and, under DP 2, across ranks), the four ``loss_agg_mode``\\ s, data
parallelism 1 and 2 (two spawned gloo ranks), dual-clip ``clip_ratio_c``, the KL loss and ``entropy_coeff``; every
one of verl's 12 policy losses (``policy_loss.loss_mode``, with DRO's beta and bypass mode's REINFORCE with sequence
IS) on one row at least; plus a row every loss must refuse (``clip_ratio_c=1``). Each row runs on verl's real FSDP2
``TrainingWorker``: stock ``ppo_loss`` first, then every preset for one update (old log-probs from the real log-prob
pass, moved off the policy so that clipping acts). Stock refuses -> each preset raises the same exception type.
Stock runs -> each preset runs with a finite loss and its selection at the budget of its scope: ``ceil(ratio n)`` of
every micro-batch (``micro_batch``; ``tokensel/selected_tokens`` their mean per mini-batch), of every prompt group
of a mini-batch over the ranks (``gmts``, ``tokensel/prepass/*``), of the batch (``forking_paper``, the driver's
``tokensel/driver_*``, applied as is by the loss), ``max(1, int(ratio N))`` of each mini-batch over the ranks
(``kl_cov_global``; ``clip_cov_global`` at most that many, its candidates may be fewer; the loss applies the
pre-pass's tokens), every response's tokens strictly above its 0.8 entropy quantile (``archer``), every valid token
(``ar``, ``entropy_adv``, ``ar_lopti`` as its first Lopti pass), and for ``stapo`` the pre-pass's kept tokens of
each mini-batch over the ranks, applied as they are by the loss. A preset that cannot serve a combination
(``normaliser=selected`` with a seq-mean ``loss_agg_mode``; ``archer`` without the KL loss; a rule with its own
policy loss or an omega score under a loss other than vanilla; ``sapo`` / ``geo_mean`` with ``normaliser`` selected
or kept) must be refused by our config validation, naming the keys. ``kl_cov_global`` and ``clip_cov_global`` have
no dual clip (as verl's ``loss_mode=kl_cov`` / ``clip_cov``), nor ``lp_reg`` and ``simko`` (as released), so they
must run on the refusal row. ``lp_reg``'s and ``simko``'s old-log-prob pass runs under their loss (their vocabulary
reductions); ``simko`` keeps every response's tokens above its 0.8 entropy quantile, ``lp_reg`` the pre-pass's
regularised tokens (possibly none).

Default suite: a fixed subset (two worker builds of ~4-11 s, ~2 s a row with its ten updates, of which
``kl_cov_global``, ``clip_cov_global`` and ``archer`` take ~0.6 s, on 2 cores; 25 s in all on a loaded machine, 18 s
before those three; 31 s with three of the rows under gspo, dro and clip_cov). The whole matrix (plus two DP 2
spawns for three rows, one Megatron spawn for three rows; 200 s in all on a loaded machine), which rewrites
``benchmarks/results/parity_matrix_cpu.md``::

    TOKENSEL_PARITY_FULL=1 flock /tmp/heavy.lock \
        python -m pytest tests/test_parity_matrix_on_cpu.py -q -p no:cacheprovider

The full matrix also runs three of the default slice's rows on verl's Megatron engine (one spawned process, the
CPU test bed of ``verl_tokensel_cpu.megatron``). Not covered: Megatron with DP, TP or PP (its layouts are
``test_megatron_engine_on_cpu.py``), sequence parallelism, ``shuffle``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time

import pytest

from verl_tokensel_cpu import tiny_model, worker as H
from helpers import distributed as D
from helpers import parity as P

pytestmark = pytest.mark.requires("verl")

FULL = os.environ.get("TOKENSEL_PARITY_FULL", "") not in ("", "0")
ROWS = [*P.matrix(), *P.megatron_rows(P.matrix())] if FULL else P.default_slice(P.matrix())
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("mbridge") is not None
RESULT_MD = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "parity_matrix_cpu.md"
COMMAND = "TOKENSEL_PARITY_FULL=1 python -m pytest tests/test_parity_matrix_on_cpu.py"
#: combo id -> reason: combinations where a preset fails while stock verl runs (strict xfail, to be fixed)
KNOWN_FAILURES: dict[str, str] = {}


def _param(row):
    cid = P.combo_id(row)
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[cid])] if cid in KNOWN_FAILURES else []
    return pytest.param(row, id=cid, marks=marks)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_parity") / "qwen2")


@pytest.fixture(scope="module")
def megatron_model_dir(tmp_path_factory):
    return tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_parity_megatron") / "qwen2",
                                           **tiny_model.MEGATRON_TINY_CONFIG)


_RESULTS: dict[str, list[dict]] = {}  # combo id -> the row's result on each rank
_STATE: dict = {"t0": time.time()}


def _results(model_dir, megatron_model_dir) -> dict[str, list[dict]]:
    """Every row of this run, grouped by worker (engine, DP size, use_remove_padding): one build per group."""
    if _RESULTS:
        return _RESULTS
    key = lambda r: (r.get("engine", "fsdp"), r["dp"], r["rmpad"])  # noqa: E731
    for engine, dp, rmpad in sorted({key(r) for r in ROWS}):
        rows = [r for r in ROWS if key(r) == (engine, dp, rmpad)]
        if engine == "megatron":
            if not HAS_MEGATRON:
                continue
            per_rank = D.run_distributed(P.dp_rank_run, world_size=1,
                                         args=(str(megatron_model_dir), rmpad, rows, "megatron"), timeout=600)
            for cid in per_rank[0]:
                _RESULTS[cid] = [per_rank[0][cid]]
        elif dp == 1:
            actor = H.make_training_worker(model_dir, use_remove_padding=rmpad, lr=1e-4)
            for cid, res in P.run_rows(actor, rows).items():
                _RESULTS[cid] = [res]
        else:
            per_rank = D.run_distributed(P.dp_rank_run, world_size=dp, args=(str(model_dir), rmpad, rows),
                                         timeout=600)
            for cid in per_rank[0]:
                _RESULTS[cid] = [r[cid] for r in per_rank]
    if FULL:
        RESULT_MD.write_text(P.render_markdown(_RESULTS, time.time() - _STATE["t0"], COMMAND))
    return _RESULTS


def test_the_design_covers_every_pair_of_levels():
    rows = P.pairwise(P.FACTORS)
    assert rows == P.pairwise(P.FACTORS), "the design is not deterministic"
    names = list(P.FACTORS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            seen = {(r[a], r[b]) for r in rows}
            missing = [(x, y) for x in P.FACTORS[a] for y in P.FACTORS[b] if (x, y) not in seen]
            assert not missing, f"{a} x {b}: {missing}"
    assert len(rows) < 30, len(rows)


def test_the_matrix_runs_every_policy_loss():
    """``loss_mode`` is a factor: each of verl 0.9.1's registered losses on a row at least."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    seen = {r["loss_mode"] for r in P.matrix()}
    assert seen == set(P.LOSS_MODES) == set(POLICY_LOSS_REGISTRY) - {"tokensel_ppo_clip"}


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_every_preset_runs_where_stock_runs(model_dir, megatron_model_dir, row):
    if row.get("engine") == "megatron" and not HAS_MEGATRON:
        pytest.skip("megatron-core / mbridge are not installed: pip install -e '.[test,megatron]'")
    per_rank = _results(model_dir, megatron_model_dir)[P.combo_id(row)]
    problems = [msg for msg in (P.verdict(per_rank, p)[1] for p in P.PRESETS) if msg]
    stock = per_rank[0]["stock"]
    if row == P.REFUSAL_PROBE:  # the matrix does see refusals
        assert stock["status"] == "refused" and stock["error"] == "AssertionError", stock
    assert not problems, "\n\n".join(problems)
