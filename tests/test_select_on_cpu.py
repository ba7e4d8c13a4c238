"""Selection semantics of ``select_tokens`` / ``budget`` / ``selection_stats`` (CPU), plus an exact
two-process gloo check of the ``micro_batch_dp`` scope against one process over the concatenation.

This module imports only torch and ``verl_tokensel.core.ranking.select`` so the spawned ranks start fast.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_tokensel.core.ranking.select import budget, select_tokens, selection_stats


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _exact_budget(ratio: float, n: int) -> int:
    """ceil(ratio * n) in exact decimal arithmetic (0.2 means 1/5, not its binary neighbour)."""
    return math.ceil(Fraction(repr(ratio)) * n)


def _reference(scores: torch.Tensor, valid: torch.Tensor, ratio: float, direction: str = "top") -> torch.Tensor:
    """Brute-force reference: sort the valid tokens by (is NaN, -score or score, row-major position)."""
    cand = []
    for pos, (s, v) in enumerate(zip(scores.flatten().tolist(), valid.flatten().tolist())):
        if v:
            nan = math.isnan(s)
            key = 0.0 if nan else (-s if direction == "top" else s)
            cand.append((nan, key, pos))
    cand.sort()
    k = _exact_budget(ratio, len(cand)) if cand else 0
    out = torch.zeros(scores.numel(), dtype=torch.bool)
    for _, _, pos in cand[:k]:
        out[pos] = True
    return out.view_as(valid)


def _random_case(seed: int, batch: int = 5, length: int = 11, levels: int = 4, nan_frac: float = 0.0):
    """Scores with many ties (``levels`` distinct values), ragged valid masks (right padding)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (batch, length), generator=g).float() / levels
    lens = torch.randint(0, length + 1, (batch,), generator=g)
    valid = torch.arange(length)[None, :] < lens[:, None]
    if nan_frac:
        scores[torch.rand(batch, length, generator=g) < nan_frac] = math.nan
    scores[~valid] = 1e9  # padding carries huge scores: must still never be picked
    return scores, valid


# --------------------------------------------------------------------------------------------
# budget
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ratio,n,k",
    [
        # the usual suspects: these products happen to round to the exact integer in float64
        (0.2, 5, 1),
        (0.1, 30, 3),
        (0.7, 10, 7),
        # these do not: a plain math.ceil(ratio * n) would keep one token too many
        (0.07, 100, 7),  # 0.07 * 100 = 7.000000000000001
        (0.14, 50, 7),  # 7.000000000000001
        (0.28, 25, 7),  # 7.000000000000001
        (0.57, 100, 57),  # 56.99999999999999 (below: ceil is already right)
        (0.2, 6, 2),  # 1.2 -> 2
        (0.2, 1, 1),  # at least one token from a non-empty pool
        (1e-6, 10, 1),
        (1.0, 7, 7),
        (0.5, 0, 0),  # empty pool
    ],
)
def test_budget_float_edge_cases(ratio, n, k):
    assert budget(ratio, n) == k


def test_budget_equals_exact_ceil_on_a_grid():
    ratios = [i / 100 for i in range(1, 101)] + [0.125, 0.333, 0.999]
    bad = [(r, n) for r in ratios for n in range(1, 301) if budget(r, n) != _exact_budget(r, n)]
    assert not bad
    # the grid does contain products that float64 rounds above the integer (0.07 * 100, ...)
    assert any(math.ceil(r * n) != _exact_budget(r, n) for r in ratios for n in range(1, 301))


# --------------------------------------------------------------------------------------------
# select_tokens, single process
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.2, 0.1, 0.7, 0.37, 0.5, 1.0])
@pytest.mark.parametrize("direction", ["top", "bottom"])
def test_keeps_exactly_ceil_and_matches_reference(ratio, direction):
    for seed in range(20):
        scores, valid = _random_case(seed, nan_frac=0.1 if seed % 3 == 0 else 0.0)
        mask = select_tokens(scores, valid, ratio, direction=direction)
        assert mask.dtype == torch.bool and mask.shape == valid.shape
        assert not (mask & ~valid).any()  # padding never selected
        assert int(mask.sum()) == _exact_budget(ratio, int(valid.sum()))  # padding never counted
        assert torch.equal(mask, _reference(scores, valid, ratio, direction)), (seed, scores, valid, mask)


def test_rho_n_float_edge_cases_in_select():
    # N valid tokens inside a wider padded matrix
    for ratio, n, k in [(0.2, 5, 1), (0.1, 30, 3), (0.7, 10, 7), (0.07, 100, 7), (0.28, 25, 7)]:
        scores = torch.arange(120, dtype=torch.float32).reshape(4, 30)
        valid = (torch.arange(120) < n).reshape(4, 30)
        mask = select_tokens(scores, valid, ratio)
        assert int(mask.sum()) == k
        # the k highest valid scores are the last k valid positions n-k .. n-1
        assert mask.flatten().nonzero().flatten().tolist() == list(range(n - k, n))


def test_padding_never_selected_even_with_extreme_scores():
    scores = torch.tensor([[0.1, 0.2, math.inf, 1e30], [0.3, math.nan, -1e30, 5.0]])
    valid = torch.tensor([[True, True, False, False], [True, True, False, False]])
    # top: 4 valid tokens, ratio 0.5 -> 2 kept: 0.3 and 0.2 (NaN last)
    assert select_tokens(scores, valid, 0.5).tolist() == [[False, True, False, False], [True, False, False, False]]
    # bottom: 0.1 and 0.2
    assert select_tokens(scores, valid, 0.5, direction="bottom").tolist() == [
        [True, True, False, False], [False, False, False, False]]


def test_ties_broken_by_position():
    scores = torch.full((3, 4), 0.5)
    valid = torch.tensor([[False, True, True, True], [True, True, False, False], [True, True, True, True]])
    for direction in ("top", "bottom"):
        # 9 valid, ratio 0.4 -> ceil(3.6) = 4: the first four valid tokens in row-major order
        mask = select_tokens(scores, valid, 0.4, direction=direction)
        assert mask.tolist() == [[False, True, True, True], [True, False, False, False], [False] * 4]
    # a tie at the threshold: scores 3, 2, 2, 2, 1; k = 2 -> 3 and the first 2
    s = torch.tensor([[2.0, 1.0, 2.0], [3.0, 2.0, 0.0]])
    v = torch.tensor([[True, True, True], [True, True, False]])
    assert select_tokens(s, v, 0.4).tolist() == [[True, False, False], [True, False, False]]
    # deterministic: repeated calls agree
    s, v = _random_case(3, levels=2)
    masks = [select_tokens(s, v, 0.3) for _ in range(3)]
    assert all(torch.equal(m, masks[0]) for m in masks)


def test_nan_ranks_last_in_both_directions():
    scores = torch.tensor([[math.nan, 1.0, math.nan, -2.0, 3.0]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    assert select_tokens(scores, valid, 0.4).tolist() == [[False, True, False, False, True]]  # 3, 1
    assert select_tokens(scores, valid, 0.4, direction="bottom").tolist() == [[False, True, False, True, False]]
    # k = 4 > 3 finite: every finite one plus the earliest NaN
    assert select_tokens(scores, valid, 0.8).tolist() == [[True, True, False, True, True]]
    assert select_tokens(scores, valid, 0.8, direction="bottom").tolist() == [[True, True, False, True, True]]


def test_bottom_direction_keeps_lowest():
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.3], [0.7, 0.2, 0.8, 0.05]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    # 8 valid, ratio 0.25 -> 2: the two lowest, 0.05 and 0.1
    assert select_tokens(scores, valid, 0.25, direction="bottom").tolist() == [
        [False, True, False, False], [False, False, False, True]]
    assert select_tokens(scores, valid, 0.25, direction="top").tolist() == [
        [False, False, True, False], [False, False, True, False]]


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("direction", ["top", "bottom"])
def test_sequence_scope_per_row_budget(ratio, direction):
    for seed in range(10):
        scores, valid = _random_case(seed, batch=6, length=13, nan_frac=0.05)
        mask = select_tokens(scores, valid, ratio, scope="sequence", direction=direction)
        assert not (mask & ~valid).any()
        for i in range(scores.shape[0]):
            n_i = int(valid[i].sum())
            assert int(mask[i].sum()) == _exact_budget(ratio, n_i)  # 0 for an empty row
            assert torch.equal(mask[i:i + 1], _reference(scores[i:i + 1], valid[i:i + 1], ratio, direction))


@pytest.mark.parametrize("scope", ["micro_batch", "micro_batch_dp", "sequence"])
def test_ratio_one_keeps_all_valid(scope):
    scores, valid = _random_case(1, nan_frac=0.2)
    for direction in ("top", "bottom"):
        assert torch.equal(select_tokens(scores, valid, 1.0, scope=scope, direction=direction), valid)


def test_micro_batch_dp_without_group_is_micro_batch():
    scores, valid = _random_case(4)
    assert torch.equal(select_tokens(scores, valid, 0.3, scope="micro_batch_dp", dp_group=None),
                       select_tokens(scores, valid, 0.3, scope="micro_batch"))


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.0000001, 1.5, math.nan, math.inf])
def test_bad_ratio_raises(ratio):
    scores, valid = _random_case(0)
    for scope in ("micro_batch", "micro_batch_dp", "sequence"):
        with pytest.raises(ValueError, match="ratio"):
            select_tokens(scores, valid, ratio, scope=scope)


@pytest.mark.parametrize("scope", ["batches", "prompt", "", "Sequence"])
def test_bad_scope_raises(scope):
    scores, valid = _random_case(0)
    with pytest.raises(ValueError, match="scope"):
        select_tokens(scores, valid, 0.2, scope=scope)


@pytest.mark.parametrize("direction", ["up", "TOP", "", None])
def test_bad_direction_raises(direction):
    scores, valid = _random_case(0)
    with pytest.raises(ValueError, match="direction"):
        select_tokens(scores, valid, 0.2, direction=direction)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        select_tokens(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), 0.2)


@pytest.mark.parametrize("scope", ["micro_batch", "micro_batch_dp", "sequence"])
@pytest.mark.parametrize("direction", ["top", "bottom"])
def test_extra_padding_columns_change_nothing(scope, direction):
    g = torch.Generator().manual_seed(9)
    for seed in range(5):
        scores, valid = _random_case(seed, nan_frac=0.1)
        base = select_tokens(scores, valid, 0.3, scope=scope, direction=direction)
        extra = 6
        s2 = torch.cat([scores, torch.randn(scores.shape[0], extra, generator=g) * 1e6], dim=1)
        v2 = torch.cat([valid, torch.zeros(valid.shape[0], extra, dtype=torch.bool)], dim=1)
        m2 = select_tokens(s2, v2, 0.3, scope=scope, direction=direction)
        assert torch.equal(m2[:, :-extra], base)
        assert not m2[:, -extra:].any()
        # so does garbage in existing padding positions
        s3 = scores.clone()
        s3[~valid] = -s3[~valid] * 7 + 3
        assert torch.equal(select_tokens(s3, valid, 0.3, scope=scope, direction=direction), base)


def test_empty_pool_selects_nothing():
    scores = torch.randn(2, 5)
    valid = torch.zeros(2, 5, dtype=torch.bool)
    for scope in ("micro_batch", "micro_batch_dp", "sequence"):
        assert not select_tokens(scores, valid, 0.2, scope=scope).any()
    assert not select_tokens(torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), 0.2).any()


# --------------------------------------------------------------------------------------------
# selection_stats
# --------------------------------------------------------------------------------------------
def test_selection_stats_hand_example():
    scores = torch.tensor([[0.9, 0.1, 0.5, 9.0], [0.3, 0.7, 0.2, 0.0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    # 5 valid scores 0.9 0.1 0.5 0.3 0.7; ratio 0.4 -> ceil(2.0) = 2: 0.9 and 0.7
    mask = select_tokens(scores, valid, 0.4)
    assert mask.tolist() == [[True, False, False, False], [False, True, False, False]]
    entropy = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 6.0, 100.0, 100.0]])
    grad_mass = torch.tensor([[2.0, 1.0, 1.0, 50.0], [1.0, 5.0, 50.0, 50.0]])
    stats = selection_stats(mask, valid, scores, entropy=entropy, grad_mass=grad_mass)
    assert stats == pytest.approx({
        "selected_fraction": 0.4,  # 2 / 5
        "selected_tokens": 2.0,
        "valid_tokens": 5.0,
        "threshold_min_selected_score": 0.7,
        "threshold_max_selected_score": 0.9,
        "entropy_selected": 3.5,  # (1 + 6) / 2
        "entropy_unselected": 3.0,  # (2 + 3 + 4) / 3, padding's 100 excluded
        "grad_mass_kept": 0.7,  # (2 + 5) / (2 + 1 + 1 + 1 + 5)
        "nan_scores": 0.0,
    })


def test_selection_stats_nan_and_empty():
    scores = torch.tensor([[math.nan, 0.1, 4.0]])
    valid = torch.tensor([[True, True, False]])
    mask = select_tokens(scores, valid, 1.0)
    stats = selection_stats(mask, valid, scores)
    # NaN is kept (ratio 1) but ignored by the thresholds; padding's 4.0 is not counted
    assert stats == pytest.approx({"selected_fraction": 1.0, "selected_tokens": 2.0, "valid_tokens": 2.0,
                                   "threshold_min_selected_score": 0.1, "threshold_max_selected_score": 0.1,
                                   "nan_scores": 1.0})
    none = torch.zeros(1, 3, dtype=torch.bool)
    stats = selection_stats(none, none, scores, entropy=torch.ones(1, 3), grad_mass=torch.ones(1, 3))
    assert stats == {"selected_fraction": 0.0, "selected_tokens": 0.0, "valid_tokens": 0.0, "nan_scores": 0.0}


# --------------------------------------------------------------------------------------------
# micro_batch_dp across two gloo ranks
# --------------------------------------------------------------------------------------------
def _dp_cases():
    """(name, ratio, direction, [(scores, valid) of rank 0, (scores, valid) of rank 1])."""
    cases = []
    g = torch.Generator().manual_seed(123)

    def ragged(rows, width, lens, levels=3, nan=False):
        s = torch.randint(0, levels, (rows, width), generator=g).float()
        v = torch.arange(width)[None, :] < torch.tensor(lens, dtype=torch.long)[:, None]
        if nan:
            s[torch.rand(rows, width, generator=g) < 0.15] = math.nan
        s[~v] = 1e9
        return s, v

    for ratio in (0.2, 0.37, 0.5, 1.0):
        for direction in ("top", "bottom"):
            # uneven pools: 12 valid tokens on rank 0 (width 6), 10 on rank 1 (width 9); 3 score levels
            cases.append((f"uneven-{ratio}-{direction}", ratio, direction,
                          [ragged(3, 6, [6, 2, 4]), ragged(2, 9, [9, 1])]))
    # pure ties: the first k tokens in rank-major, row-major order
    cases.append(("ties", 0.7, "top", [(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool)),
                                       (torch.ones(3, 2), torch.ones(3, 2, dtype=torch.bool))]))
    cases.append(("ties-all-on-rank1", 0.2, "bottom", [(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool)),
                                                        (torch.zeros(3, 2), torch.ones(3, 2, dtype=torch.bool))]))
    # an empty rank: no valid token on rank 1, or no row at all on rank 0
    cases.append(("empty-rank1", 0.25, "top", [ragged(2, 5, [5, 3]), ragged(2, 7, [0, 0])]))
    cases.append(("no-rows-rank0", 0.25, "top", [(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool)),
                                                 ragged(3, 5, [5, 4, 2])]))
    cases.append(("both-empty", 0.5, "top", [ragged(1, 3, [0]), ragged(2, 2, [0, 0])]))
    cases.append(("nan", 0.6, "top", [ragged(3, 6, [6, 5, 1], nan=True), ragged(2, 8, [8, 3], nan=True)]))
    return cases


def _dp_worker(rank: int, world: int, port: int, cases, out_dir: str):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        masks = []
        for _, ratio, direction, per_rank in cases:
            scores, valid = per_rank[rank]
            masks.append(select_tokens(scores, valid, ratio, scope="micro_batch_dp", direction=direction,
                                       dp_group=dist.group.WORLD))
        torch.save(masks, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _concat(per_rank):
    width = max(s.shape[1] for s, _ in per_rank)
    scores = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-5.0) for s, _ in per_rank])
    valid = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=False) for _, v in per_rank])
    return scores, valid


def test_micro_batch_dp_two_gloo_ranks_equals_concatenation(tmp_path):
    cases = _dp_cases()
    ctx = mp.start_processes(_dp_worker, args=(2, _free_port(), cases, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("the two gloo ranks did not finish within 120 s (hang in micro_batch_dp?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    masks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, (name, ratio, direction, per_rank) in enumerate(cases):
        m0, m1 = masks[0][i], masks[1][i]
        (s0, v0), (s1, v1) = per_rank
        assert m0.shape == v0.shape and m1.shape == v1.shape
        assert not (m0 & ~v0).any() and not (m1 & ~v1).any()
        got = torch.cat([m0[v0], m1[v1]])  # row-major over the valid tokens, rank 0 first
        scores, valid = _concat(per_rank)
        single = select_tokens(scores, valid, ratio, scope="micro_batch", direction=direction)
        assert torch.equal(got, single[valid]), name
        assert torch.equal(got, _reference(scores, valid, ratio, direction)[valid]), name
        assert int(got.sum()) == _exact_budget(ratio, int(valid.sum())), name
    # spot check: pure ties -> the first ceil(0.7 * 14) = 10 tokens: all 8 of rank 0, the first 2 of rank 1
    ties = [n for n, *_ in cases].index("ties")
    assert bool(masks[0][ties].all()) and masks[1][ties].flatten().tolist() == [True] * 2 + [False] * 4
    # bottom with rank 1 all zeros: ceil(0.2 * 14) = 3 tokens, all on rank 1
    idx = [n for n, *_ in cases].index("ties-all-on-rank1")
    assert int(masks[0][idx].sum()) == 0 and masks[1][idx].flatten().tolist() == [True] * 3 + [False] * 3


def test_group_scope_needs_group_ids():
    scores, valid = _random_case(0)
    with pytest.raises(ValueError, match="group_ids"):
        select_tokens(scores, valid, 0.2, scope="group")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("direction", ["top", "bottom"])
def test_group_scope_is_per_group_batch_scope(seed, direction):
    """Each group keeps ceil(rho * n_g) of its valid tokens, exactly the ``batch`` selection of its
    own rows (row order kept, so ties go to the earlier row of the group)."""
    scores, valid = _random_case(seed)
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 3, (scores.shape[0],), generator=g) * 7 - 5  # arbitrary, negative ok
    if seed % 2:
        scores = scores.round()  # many ties
    mask = select_tokens(scores, valid, 0.3, scope="group", direction=direction, group_ids=groups)
    for gid in groups.unique():
        rows = groups == gid
        expected = select_tokens(scores[rows], valid[rows], 0.3, scope="batch", direction=direction)
        assert torch.equal(mask[rows], expected)
        assert int(mask[rows].sum()) == budget(0.3, int(valid[rows].sum()))


@pytest.mark.parametrize("scope", ["batch", "mini_batch"])
def test_single_process_pool_scopes_equal_micro_batch(scope):
    scores, valid = _random_case(3)
    assert torch.equal(select_tokens(scores, valid, 0.2, scope=scope),
                       select_tokens(scores, valid, 0.2, scope="micro_batch"))
