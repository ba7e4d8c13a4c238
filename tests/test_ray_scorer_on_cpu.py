"""The Ray score worker group on a real local Ray (CPU, 2 workers): same scores as in-process,
input order kept across shards, and a dead worker is an error, not a hang: killed before a call, or with
SIGKILL while a scoring call is in flight (the error names the worker and its pid, within a bounded time,
and no worker process survives ``shutdown()``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

from helpers.procs import alive, wait_until_busy
from verl_tokensel.analysis.ray_scorer import RayScorerGroup, ScoreWorkerError, balanced_shards
from verl_tokensel.analysis.scorer import score_responses
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir

pytestmark = pytest.mark.requires("ray")


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


@pytest.mark.timeout(300)
def test_worker_killed_during_a_scoring_call(local_ray, tiny_dir):
    group = RayScorerGroup(tiny_dir, num_workers=2, timeout_s=120)
    pids = list(group.pids)
    assert all(alive(p) for p in pids), pids
    # enough work that the call is still running when the kill lands: 2 x 150 responses of 300 tokens
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(5, 300, (8,), generator=g).tolist(), torch.randint(5, 300, (300,), generator=g).tolist())
             for _ in range(300)]
    errors = []

    def call():
        try:
            group.score(pairs)
        except Exception as e:  # noqa: BLE001 - inspected below
            errors.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    assert wait_until_busy(pids[1], 0.3, deadline_s=60), "worker 1 never started scoring"
    assert caller.is_alive(), "the scoring call ended before the kill: make it longer"
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    caller.join(timeout=90)
    took = time.monotonic() - t0
    assert not caller.is_alive(), "the scoring call hangs after a worker died"
    assert len(errors) == 1 and isinstance(errors[0], ScoreWorkerError), errors
    msg = str(errors[0])
    print(f"{took:.1f} s after the kill: {msg}")
    assert f"worker 1 (pid {pids[1]}" in msg and "died during scoring 300 responses" in msg, msg
    assert f"worker 0 (pid {pids[0]}" not in msg, msg
    assert took < 60, took
    group.shutdown()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
