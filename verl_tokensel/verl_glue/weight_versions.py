"""The weight versions of one actor ``TrainingWorker``: whether verl's old-log-prob pass measured its current weights.

A counter per worker, raised by every update (``train_batch``, one PPO mini-batch) and every checkpoint load, and its
value at the worker's last ``infer_batch`` with the policy itself (the LoRA adapter on: verl's ``compute_log_prob``;
its reference pass may run this worker with the adapter off). When the two are equal, the old-log-prob pass's values
are this worker's current policy's: the pre-pass reuses them instead of a forward
(:func:`~verl_tokensel.verl_glue.prepass.old_pass_measured_these_weights`).

Installed without editing verl: :func:`install_weight_versions` wraps those three methods of one worker.
"""

from __future__ import annotations

from verl.utils import tensordict_utils as tu

_WRAPPED = "_tokensel_weight_versions_base"
# per worker: updates and checkpoint loads so far, and that count at the last old-log-prob pass
_WEIGHTS_VERSION = "_tokensel_weights_version"
_INFER_AT = "_tokensel_infer_at_version"


def old_pass_is_current(worker) -> bool:
    """Whether this worker's last ``infer_batch`` with the adapter on came after its last update and after any
    checkpoint load (False on a worker without :func:`install_weight_versions`)."""
    version = getattr(worker, _WEIGHTS_VERSION, None)
    return version is not None and getattr(worker, _INFER_AT, None) == version


def install_weight_versions(worker):
    """Wrap ``worker.train_batch`` (the version goes up after the update, or its attempt), ``infer_batch`` (records
    the version it measured, adapter on) and ``load_checkpoint`` (the version goes up) (idempotent)."""
    if getattr(worker, _WRAPPED, None) is not None:
        return worker
    base = worker.train_batch
    base_infer = worker.infer_batch
    base_load = getattr(worker, "load_checkpoint", None)
    setattr(worker, _WEIGHTS_VERSION, 0)

    def _bump():
        setattr(worker, _WEIGHTS_VERSION, getattr(worker, _WEIGHTS_VERSION) + 1)

    def train_batch(data, *args, **kwargs):
        try:
            return base(data, *args, **kwargs)
        finally:  # the update changed the weights (or may have, if it failed)
            _bump()

    def infer_batch(data, *args, **kwargs):
        with_adapter = not tu.get_non_tensor_data(data=data, key="no_lora_adapter", default=False)
        out = base_infer(data, *args, **kwargs)
        if with_adapter:  # the policy itself (verl's ref pass may run this worker with the adapter off)
            setattr(worker, _INFER_AT, getattr(worker, _WEIGHTS_VERSION))
        return out

    setattr(worker, _WRAPPED, base)
    worker.train_batch = train_batch
    worker.infer_batch = infer_batch
    if base_load is not None:
        def load_checkpoint(*args, **kwargs):
            _bump()
            return base_load(*args, **kwargs)

        worker.load_checkpoint = load_checkpoint
    return worker


__all__ = ["install_weight_versions", "old_pass_is_current"]
