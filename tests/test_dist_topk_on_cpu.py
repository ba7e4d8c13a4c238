"""Exact distributed top-k (radix select over all-reduced histograms) vs single-process selection.

Property tests on 2 to 4 gloo ranks: ties, NaN, +-inf, -0.0, empty ranks, uneven sizes, k at the
edges; every rank's threshold is the same and the union of the rank masks equals one process
selecting over the rank-ordered concatenation.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_tokensel.core.ranking.dist_topk import kth_largest_key, ordered_keys, topk_mask_distributed
from verl_tokensel.core.ranking.select import keep_first_k


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(world: int, seed: int):
    """A list of (per-rank value lists, k, largest)."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for trial in range(40):
        sizes = torch.randint(0, 30, (world,), generator=g).tolist()
        if trial % 7 == 0:
            sizes[trial % world] = 0  # an empty rank
        parts = []
        for n in sizes:
            v = (torch.randint(-4, 5, (n,), generator=g).float() * 0.25)  # many ties
            r = torch.rand(n, generator=g)
            v[r < 0.08] = math.nan
            v[(r >= 0.08) & (r < 0.12)] = -0.0
            v[(r >= 0.12) & (r < 0.15)] = math.inf
            v[(r >= 0.15) & (r < 0.18)] = -math.inf
            parts.append(v)
        total = sum(sizes)
        k = int(torch.randint(0, total + 2, (1,), generator=g)) if total else 0
        cases.append((parts, k, bool(trial % 2)))
    # large spread of magnitudes, no ties
    parts = [torch.randn(1000, generator=g) * 10 ** torch.randint(-20, 20, (1000,), generator=g).float()
             for _ in range(world)]
    cases.append((parts, 777, True))
    return cases


def _init_gloo(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def _worker(rank, world, port, seed, out_dir):
    _init_gloo(rank, world, port)
    try:
        results = []
        for parts, k, largest in _cases(world, seed):
            mask = topk_mask_distributed(parts[rank], k, largest=largest)
            keys = ordered_keys(parts[rank])
            total = sum(p.numel() for p in parts)
            kth = kth_largest_key(keys, k) if (largest and 1 <= k <= total) else None
            results.append((mask, kth))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world, seed, tmp_path, worker=None):
    ctx = mp.start_processes(worker or _worker, args=(world, _free_port(), seed, str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError("gloo ranks did not finish in 180 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_topk_equals_single_process_over_union(world, tmp_path):
    per_rank = _run(world, seed=world, tmp_path=tmp_path)
    for i, (parts, k, largest) in enumerate(_cases(world, world)):
        union = torch.cat(parts)
        everything = torch.ones_like(union, dtype=torch.bool)
        expected = keep_first_k(union, everything, min(k, union.numel()), "top" if largest else "bottom")
        got = torch.cat([per_rank[r][i][0] for r in range(world)])
        assert torch.equal(got, expected), (i, k, largest, parts)
        assert int(got.sum()) == min(max(k, 0), union.numel())
        kths = {per_rank[r][i][1] for r in range(world)}
        assert len(kths) == 1, "ranks disagree on the threshold"
        kth = kths.pop()
        if kth is not None:  # the k-th largest key is the one torch.topk finds over the union
            assert kth == int(torch.topk(ordered_keys(union), k).values.min())


def test_single_process_matches_first_k_and_keys_order():
    vals = torch.tensor([-math.inf, -1.5, -0.0, 0.0, 1e-38, 2.0, math.inf, math.nan])
    keys = ordered_keys(vals)
    assert keys[-1] == 0  # NaN lowest
    assert torch.all(keys[:-1].diff() >= 0) and keys[2] == keys[3]  # monotone; -0.0 ties +0.0
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        v = torch.randint(-3, 4, (50,), generator=g).float()
        v[torch.rand(50, generator=g) < 0.1] = math.nan
        for k in (0, 1, 7, 49, 50, 60):
            for largest in (True, False):
                every = torch.ones_like(v, dtype=torch.bool)
                assert torch.equal(topk_mask_distributed(v, k, largest=largest),
                                   keep_first_k(v, every, min(k, 50), "top" if largest else "bottom"))


# ---------------------------------------------------------------------------------------------
# per-group top-k (scope=group) over ranks
# ---------------------------------------------------------------------------------------------


def _group_cases(world: int, seed: int):
    """A list of (per-rank (scores, valid, group_ids), ratio, largest); rows of one group spread over ranks."""
    g = torch.Generator().manual_seed(100 + seed)
    cases = []
    for trial in range(30):
        width = int(torch.randint(1, 9, (1,), generator=g))
        n_groups = int(torch.randint(1, 6, (1,), generator=g))
        parts = []
        for r in range(world):
            rows = int(torch.randint(0, 7, (1,), generator=g))
            if trial % 5 == r % 5:
                rows = 0  # an empty rank
            s = torch.randint(-3, 4, (rows, width), generator=g).float() * 0.5  # many ties
            u = torch.rand(rows, width, generator=g)
            s[u < 0.1] = math.nan
            s[(u >= 0.1) & (u < 0.15)] = -0.0
            valid = torch.rand(rows, width, generator=g) < 0.8  # ragged rows, some empty
            gid = torch.randint(0, n_groups, (rows,), generator=g) * 7919 - 3  # sparse, negative ids too
            parts.append((s, valid, gid))
        ratio = [0.05, 0.2, 0.37, 0.5, 0.99, 1.0][trial % 6]
        cases.append((parts, ratio, bool(trial % 2)))
    # one big group split over every rank, distinct scores
    parts = [(torch.randn(40, 16, generator=g), torch.ones(40, 16, dtype=torch.bool),
              torch.full((40,), 5, dtype=torch.int64)) for _ in range(world)]
    cases.append((parts, 0.2, True))
    return cases


def _group_worker(rank, world, port, seed, out_dir):
    from verl_tokensel.core.ranking.dist_topk import grouped_topk_mask_distributed

    _init_gloo(rank, world, port)
    try:
        results = []
        for parts, ratio, largest in _group_cases(world, seed):
            s, valid, gid = parts[rank]
            results.append(grouped_topk_mask_distributed(s, valid, gid, ratio, largest=largest))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_grouped_topk_equals_single_process_over_union(world, tmp_path):
    from verl_tokensel.core.ranking.select import _select_grouped, budget

    per_rank = _run(world, world, tmp_path, worker=_group_worker)
    for i, (parts, ratio, largest) in enumerate(_group_cases(world, world)):
        width = parts[0][0].shape[1]
        scores = torch.cat([p[0] for p in parts])
        valid = torch.cat([p[1] for p in parts])
        gid = torch.cat([p[2] for p in parts])
        expected = _select_grouped(scores, valid, gid, ratio, "top" if largest else "bottom")
        got = torch.cat([per_rank[r][i].view(-1, width) for r in range(world)])
        assert torch.equal(got, expected), (i, ratio, largest)
        for g in gid.unique().tolist():  # every group keeps exactly ceil(ratio * n_g)
            rows = gid == g
            assert int(got[rows].sum()) == budget(ratio, int(valid[rows].sum()))


def test_grouped_topk_single_process_is_select_grouped():
    from verl_tokensel.core.ranking.dist_topk import grouped_topk_mask_distributed
    from verl_tokensel.core.ranking.select import _select_grouped

    for parts, ratio, largest in _group_cases(1, 9):
        s, valid, gid = parts[0]
        assert torch.equal(grouped_topk_mask_distributed(s, valid, gid, ratio, largest=largest),
                           _select_grouped(s, valid, gid, ratio, "top" if largest else "bottom"))
