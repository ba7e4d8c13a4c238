"""``score_source=prepass`` reuses the old-log-prob pass where it measured the same weights
(``token_selection.prepass_reuse``), through verl's real FSDP2 TrainingWorker on CPU.

- one mini-batch per step: the pre-pass takes the old pass's values (``tokensel/prepass/reused_old_pass`` = 1),
  and its mask and scores equal those of the pre-pass forward (``prepass_reuse=false``) at the same weights;
- two mini-batches per step, or two PPO epochs: only the first mini-batch of the first epoch reuses;
- without the old pass's entropy in the batch, or after a checkpoint load, the forward runs.
"""

from __future__ import annotations


import pytest

import torch

from verl_tokensel_cpu import batches as B, tiny_model, worker as H
from verl_tokensel.verl_glue.loss import MASK_FIELD, SCORE_FIELD, SelectingLoss

pytestmark = pytest.mark.requires("verl")

N = 8
WORKER_KW = dict(ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=64, lr=0.0, clip_grad=1e9)
REUSED = "tokensel/prepass/reused_old_pass"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_reuse") / "qwen2")


_WORKERS: dict = {}


def _worker(model_dir, mini: int, epochs: int = 1):
    key = (mini, epochs)
    if key not in _WORKERS:
        _WORKERS[key] = H.make_training_worker(model_dir, ppo_mini_batch_size=mini, ppo_epochs=epochs, **WORKER_KW)
    return _WORKERS[key]


def _step(actor, reuse: bool, drop_entropy: bool = False):
    """One update of a fresh batch after the real old-log-prob pass; returns (metrics, per-mini-batch masks/scores)."""
    batch = B.make_update_batch(actor, n=N, seed=11, resp_len=(3, 9), group_size=4)
    H.compute_old_log_probs(actor, batch)
    if drop_entropy:
        batch.pop("entropy")
    seen = []
    inner = actor.worker.train_batch

    def spy(data, *args, **kwargs):
        out = inner(data, *args, **kwargs)
        seen.append((data[MASK_FIELD].values().clone(), data[SCORE_FIELD].values().clone()))
        return out

    cfg = H.selecting_actor_config(actor, "gmts", prepass_reuse=reuse)
    actor.worker.train_batch = spy
    try:
        r = H.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg), capture_params=False)
    finally:
        actor.worker.train_batch = inner
    return r.metrics, seen


def _reused(metrics) -> list[float]:
    v = metrics[REUSED]
    return [float(x) for x in (v if isinstance(v, list) else [v])]


def test_one_mini_batch_reuses_the_old_pass_with_the_same_mask(model_dir):
    actor = _worker(model_dir, mini=N)
    m_reuse, reuse = _step(actor, reuse=True)
    m_fwd, fwd = _step(actor, reuse=False)
    assert _reused(m_reuse) == [1.0] and _reused(m_fwd) == [0.0]
    (mask_r, score_r), (mask_f, score_f) = reuse[0], fwd[0]
    assert mask_r.sum() > 0
    assert torch.equal(mask_r, mask_f), "the reused values select other tokens than the pre-pass forward"
    torch.testing.assert_close(score_r, score_f, rtol=1e-5, atol=1e-6)


def test_only_the_first_mini_batch_of_the_first_epoch_reuses(model_dir):
    assert _reused(_step(_worker(model_dir, mini=N // 2), reuse=True)[0]) == [1.0, 0.0]
    assert _reused(_step(_worker(model_dir, mini=N, epochs=2), reuse=True)[0]) == [1.0, 0.0]


def test_no_old_entropy_or_a_checkpoint_load_means_a_forward(model_dir, tmp_path):
    actor = _worker(model_dir, mini=N)
    assert _reused(_step(actor, reuse=True, drop_entropy=True)[0]) == [0.0]
    # a checkpoint load between the old pass and the update changes the weights the old pass measured
    batch = B.make_update_batch(actor, n=N, seed=12, resp_len=(3, 9), group_size=4)
    H.compute_old_log_probs(actor, batch)
    actor.worker.save_checkpoint(str(tmp_path / "ckpt"))
    actor.worker.load_checkpoint(str(tmp_path / "ckpt"))
    cfg = H.selecting_actor_config(actor, "gmts")
    r = H.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg), capture_params=False)
    assert _reused(r.metrics) == [0.0]


@pytest.mark.parametrize("log_prob_micro", [1, 16])
def test_the_prepass_batches_a_mini_batch_as_the_update_does(model_dir, log_prob_micro):
    """The old-log-prob pass's micro-batch size (smaller than, or larger than, a mini-batch) is verl's setting for the
    whole batch; the pre-pass forward over one update mini-batch follows the update's micro-batching, as stock verl
    runs these settings."""
    log_prob_key = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    actor = H.make_training_worker(model_dir, ppo_mini_batch_size=N, **WORKER_KW,
                                   overrides=[f"{log_prob_key}={log_prob_micro}"])
    assert actor.worker.engine_config.infer_micro_batch_size_per_gpu == log_prob_micro
    batch = B.make_update_batch(actor, n=2 * N, seed=13, resp_len=(3, 9), group_size=4)  # two mini-batches
    H.compute_old_log_probs(actor, batch)
    cfg = H.selecting_actor_config(actor, "gmts", prepass_reuse=False)
    r = H.run_train_step(actor, batch, loss_fn=SelectingLoss(cfg), capture_params=False)
    assert r.loss == r.loss and _reused(r.metrics) == [0.0, 0.0]
    fractions = r.metrics["tokensel/prepass/selected_fraction"]
    assert all(0.2 <= float(f) < 0.5 for f in (fractions if isinstance(fractions, list) else [fractions]))
