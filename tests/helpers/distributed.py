"""Data-parallel runs of the in-process CPU harness: ``world_size`` gloo ranks, each a real ``TrainingWorker``
(:mod:`verl_tokensel_cpu.worker`).

Ranks start from a fork server (:func:`start_ranks`) that has imported :data:`FORK_SERVER_PRELOAD` once per test
session, instead of each rank importing them again (of the 3.3 s the harness's imports took in a fresh interpreter
here, 2.9 s). A rank is still a fresh process for everything the tests set up: verl (its platform is chosen from the
environment at its import), megatron-core (the CPU shims arm at its import) and this package are imported by the rank
itself, with the environment of the test that starts it. The verl imports of this module are made where they are used,
so a rank that needs only torch (``test_dist_topk_on_cpu.py``) imports nothing else.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

#: what the fork server imports once: heavy third-party modules that read none of the environment a rank sets up
FORK_SERVER_PRELOAD = ("torch", "tensordict", "transformers")


def start_ranks(fn: Callable, args: tuple = (), nprocs: int = 2):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join=False)`` through the fork server: ``fn(rank,
    *args)`` in ``nprocs`` new processes, each with this process's environment as it is now (a fork server's child
    would otherwise get the server's, from its start). Returns the ``ProcessContext``."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(FORK_SERVER_PRELOAD))  # read when the server starts, once
    return mp.start_processes(_in_environ, args=(dict(os.environ), fn, tuple(args)), nprocs=nprocs, join=False,
                              start_method="forkserver")


def _in_environ(rank: int, environ: dict, fn: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def split_for_dp(batch, world_size: int) -> list:
    """Split a driver batch across DP ranks like verl's dispatch (``BatchData(td).chunk``)."""
    from verl.protocol import BatchData

    # chunk_tensordict returns locked TensorDicts; the copies a Ray worker receives are not locked
    return [c.unlock_() if c.is_locked else c for c in BatchData(batch).chunk(chunks=world_size)]


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    from verl_tokensel_cpu.worker import setup_cpu_process

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
    from verl_tokensel_cpu.batches import make_update_batch
    from verl_tokensel_cpu.worker import compute_old_log_probs, make_training_worker, run_train_step

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
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes (gloo, CPU platform; :func:`start_ranks`).

    ``fn`` must be importable (module level). Each rank's return value is saved with ``torch.save`` and
    returned in rank order. Raises if a rank fails or the run exceeds ``timeout`` seconds (the processes are
    then killed).
    """
    import tempfile

    from verl_tokensel_cpu.worker import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="verl_cpu_dist_") as out_dir:
        ctx = start_ranks(_spawn_entry, args=(world_size, port, fn, tuple(args), out_dir), nprocs=world_size)
        deadline = time.time() + timeout
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.time()))):
            if time.time() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"run_distributed: {fn.__name__} did not finish within {timeout}s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
