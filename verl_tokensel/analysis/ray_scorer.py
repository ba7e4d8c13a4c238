"""A Ray worker group that scores responses under a local HF checkpoint, sharded across workers.

Each worker loads the model once and runs :func:`verl_tokensel.analysis.scorer.score_responses` on its
shard; the driver scatters ``(prompt_ids, response_ids)`` pairs in contiguous, length-balanced shards and
gathers the scores back in input order. One worker per accelerator (``{"GPU": 1}`` when the cluster has GPUs,
else ``{"CPU": 1}``), optionally in a placement group. Used on the driver for the ``ref_entropy`` score.

Failure is loud, never a hang: every ``ray.get`` has a deadline; a dead worker raises
:class:`ScoreWorkerError` naming the worker, its pid and the shard it held. Example::

    group = RayScorerGroup("/ckpt/Qwen3-8B-Base", num_workers=8)   # after ray.init()
    scores = group.score(pairs)              # list[TokenScores], same order as pairs
    group.shutdown()
"""

from __future__ import annotations

from typing import Optional, Sequence

import ray

from verl_tokensel.analysis.scorer import DEFAULT_CHUNK, TokenScores


class ScoreWorkerError(RuntimeError):
    """A score worker died or did not answer in time."""


class _ScoreWorker:
    """One Ray actor: a model loaded once, scoring the shards it is sent."""

    def __init__(self, model_path: str, dtype: str, device: str, chunk_size: int, temperature: float, env: dict):
        import os

        os.environ.update(env)
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, int(os.environ.get("TOKENSEL_SCORER_THREADS", "1"))))
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
        self.chunk_size = chunk_size
        self.temperature = temperature

    def ping(self) -> str:
        import os

        return f"pid {os.getpid()}"

    def score(self, pairs):
        from verl_tokensel.analysis.scorer import score_responses

        return [
            (s.token_ids, s.logp, s.entropy, s.sum_p2, s.grad_norm)
            for s in score_responses(self.model, pairs, temperature=self.temperature, chunk_size=self.chunk_size,
                                     device=self.device)
        ]


def _died(ref) -> bool:
    """True when the task behind ``ref`` has ended with its actor's death."""
    from ray.exceptions import RayActorError

    if not ray.wait([ref], timeout=0)[0]:
        return False
    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:  # noqa: BLE001 - another failure, not a death
        return False
    return False


def balanced_shards(lengths: Sequence[int], n: int) -> list[range]:
    """Split indices 0..len-1 into ``n`` contiguous ranges of about equal total length."""
    total = sum(lengths)
    bounds, acc, target = [0], 0, total / max(n, 1)
    for i, length in enumerate(lengths):
        acc += length
        if len(bounds) < n and acc >= target * len(bounds) and i + 1 < len(lengths):
            bounds.append(i + 1)
    while len(bounds) < n:
        bounds.append(len(lengths))
    bounds.append(len(lengths))
    return [range(bounds[j], bounds[j + 1]) for j in range(n)]


class RayScorerGroup:
    """``num_workers`` Ray actors scoring responses under the model at ``model_path``.

    Args:
        model_path: a local HF checkpoint (the actor's saved weights, the reference model, any model).
        num_workers: actors to start; each takes ``resources`` (default: one GPU if the cluster has
            GPUs, else one CPU).
        dtype: ``float32`` (CPU) or ``bfloat16`` (GPU) weights.
        timeout_s: deadline of every remote call (start-up included); past it, ScoreWorkerError.
        placement_group: optional Ray placement group (one bundle per worker), e.g. verl's resource pool.
    """

    def __init__(
        self,
        model_path: str,
        num_workers: int = 1,
        *,
        resources: Optional[dict] = None,
        dtype: Optional[str] = None,
        device: Optional[str] = None,
        chunk_size: int = DEFAULT_CHUNK,
        temperature: float = 1.0,
        timeout_s: float = 600.0,
        placement_group=None,
        env: Optional[dict] = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not ray.is_initialized():
            raise RuntimeError("RayScorerGroup needs a running Ray (call ray.init() or connect to your cluster)")
        has_gpu = ray.cluster_resources().get("GPU", 0) >= 1 and device != "cpu"
        if resources is None:
            resources = {"num_gpus": 1} if has_gpu else {"num_cpus": 1}
        device = device or ("cuda" if has_gpu else "cpu")
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        self.timeout_s = timeout_s
        actor_cls = ray.remote(**resources)(_ScoreWorker)
        self.workers = []
        for i in range(num_workers):
            options = {}
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=i)
            self.workers.append(actor_cls.options(**options).remote(
                model_path, dtype, device, chunk_size, temperature, dict(env or {})))
        #: each worker's process id (from its start-up answer), for messages and fault handling
        self.pids = [int(a.split()[1]) for a in self._get([w.ping.remote() for w in self.workers], "start-up")]

    def _get(self, refs, what: str, owners: Optional[list[str]] = None):
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except RayActorError as e:
            dead = [o for o, r in zip(owners or [], refs) if _died(r)]
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ScoreWorkerError(
                f"score {', '.join(dead) if dead else 'worker'} died during {what} ({first}); the other workers "
                "are left running: call shutdown()") from e
        except GetTimeoutError as e:
            pending = [o for o, r in zip(owners or [], refs) if not ray.wait([r], timeout=0)[0]]
            raise ScoreWorkerError(
                f"score workers did not answer within {self.timeout_s:.0f} s during {what}"
                + (f"; still waiting for {', '.join(pending)}" if pending else "")
            ) from e

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TokenScores]:
        """Scores of every pair, in input order."""
        shards = balanced_shards([len(p) + len(r) for p, r in pairs], len(self.workers))
        refs, owners = [], []
        for j, (worker, shard) in enumerate(zip(self.workers, shards)):
            if len(shard):
                refs.append(worker.score.remote([pairs[i] for i in shard]))
                owners.append(f"worker {j} (pid {self.pids[j]}, pairs {shard.start}..{shard.stop - 1})")
        results = self._get(refs, f"scoring {len(pairs)} responses", owners)
        out = []
        for chunk in results:
            out.extend(TokenScores(*fields) for fields in chunk)
        return out

    def shutdown(self) -> None:
        """Kill every worker (dead ones included; idempotent)."""
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.pids = []
