"""Data-parallel runs of the in-process CPU harness: ``world_size`` spawned gloo ranks, each a real
``TrainingWorker`` (:mod:`verl_tokensel_cpu.worker`)."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from verl_tokensel_cpu.batches import make_update_batch
from verl_tokensel_cpu.worker import (
    compute_old_log_probs,
    free_port,
    make_training_worker,
    run_train_step,
    setup_cpu_process,
)


def split_for_dp(batch, world_size: int) -> list:
    """Split a driver batch across DP ranks like verl's dispatch (``BatchData(td).chunk``)."""
    from verl.protocol import BatchData

    # chunk_tensordict returns locked TensorDicts; the copies a Ray worker receives are not locked
    return [c.unlock_() if c.is_locked else c for c in BatchData(batch).chunk(chunks=world_size)]


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    setup_cpu_process(rank=rank, world_size=world_size, master_port=port, num_threads=1)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def dp_train_step(
    rank: int,
    world_size: int,
    model_dir: str,
    worker_kwargs: Optional[dict] = None,
    n: int = 8,
    seed: int = 0,
    fmt: str = "v1",
    real_old_log_probs: bool = True,
    batch_kwargs: Optional[dict] = None,
) -> dict:
    """One rank of a data-parallel update (use with :func:`run_distributed`).

    Every rank builds the same global driver batch (same seed), takes its DP shard like verl's dispatch,
    optionally runs the real old-log-prob pass on it, and runs one ``train_mini_batch`` capturing the
    full (all-reduced) gradients. Returns a picklable dict: loss, grad_norm, grads, max_abs_param_delta,
    n_local, metrics (plain values only).
    """
    actor = make_training_worker(model_dir, rank=rank, world_size=world_size, **(worker_kwargs or {}))
    full = make_update_batch(actor, n=n, seed=seed, fmt=fmt, **(batch_kwargs or {}))
    shard = split_for_dp(full, world_size)[rank]
    if real_old_log_probs:
        compute_old_log_probs(actor, shard)
    r = run_train_step(actor, shard, capture_grads=True)
    plain = {k: v for k, v in r.metrics.items() if isinstance(v, (int, float, str, list))}
    return {
        "loss": r.loss,
        "grad_norm": r.grad_norm,
        "grads": r.grads,
        "max_abs_param_delta": r.max_abs_param_delta,
        "n_local": int(shard.batch_size[0]),
        "metrics": plain,
    }


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes (gloo, CPU platform).

    ``fn`` must be importable (module level). Each rank's return value is saved with ``torch.save`` and
    returned in rank order. Raises if a rank fails or the run exceeds ``timeout`` seconds (the processes are
    then killed).
    """
    import tempfile

    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="verl_cpu_dist_") as out_dir:
        ctx = mp.start_processes(
            _spawn_entry,
            args=(world_size, port, fn, tuple(args), out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.time() + timeout
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.time()))):
            if time.time() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"run_distributed: {fn.__name__} did not finish within {timeout}s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
