"""The Ray score worker group on a real local Ray (CPU, 2 workers): same scores as in-process,
input order kept across shards, and a dead worker is an error, not a hang."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from verl_tokensel.analysis.ray_scorer import RayScorerGroup, ScoreWorkerError, balanced_shards  # noqa: E402
from verl_tokensel.analysis.scorer import score_responses  # noqa: E402
from verl_tokensel.cpu.tiny_model import build_tiny_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("ray_scorer") / "tiny")


def _pairs(n=7, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(5, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist(),
             torch.randint(5, vocab, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist())
            for _ in range(n)]


def test_balanced_shards_cover_in_order():
    shards = balanced_shards([5, 1, 1, 1, 9, 2, 2], 3)
    assert [i for s in shards for i in s] == list(range(7)) and len(shards) == 3
    assert balanced_shards([1, 2], 4)[-1] == range(2, 2)  # more workers than items: empty shards


@pytest.mark.timeout(300)
def test_two_workers_match_in_process_scores(local_ray, tiny_dir):
    from transformers import AutoModelForCausalLM

    pairs = _pairs()
    group = RayScorerGroup(tiny_dir, num_workers=2, timeout_s=240)
    try:
        remote = group.score(pairs)
    finally:
        group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    local = score_responses(model, pairs)
    assert len(remote) == len(pairs)
    for r, loc, (_, resp) in zip(remote, local, pairs):
        assert r.token_ids.tolist() == resp
        for name in ("logp", "entropy", "sum_p2", "grad_norm"):
            torch.testing.assert_close(getattr(r, name), getattr(loc, name), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_dead_worker_fails_loudly(local_ray, tiny_dir):
    group = RayScorerGroup(tiny_dir, num_workers=2, timeout_s=120)
    ray.kill(group.workers[1])
    t0 = time.monotonic()
    with pytest.raises(ScoreWorkerError, match="died"):
        group.score(_pairs(n=6, seed=1))
    assert time.monotonic() - t0 < 60
    group.shutdown()
