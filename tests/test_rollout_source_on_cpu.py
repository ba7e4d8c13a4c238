"""``score_source=rollout`` through verl's REAL TrainingWorker with data parallelism 2 (two gloo processes).

The driver's selection (:class:`~verl_tokensel.verl_glue.rollout_source.DriverSelector`) runs on the whole
batch, the mask travels as a per-token field, and the workers' loss applies it. One spawned 2-rank run
(FSDP2 engine, ``use_dynamic_bsz=True`` so micro-batches are re-grouped and re-ordered, learning rate 0)
does two actor updates:

- V1 format (nested fields), ``forking_paper`` (top 20% old-policy entropy over the whole batch):
  ``select_v1`` reads from and writes to an in-memory stand-in of TransferQueue, after the rows were
  permuted like ``balance_batch`` does;
- v0 format (padded fields), ``gmts`` with ``score_source=rollout, scope=group``: ``select_v0`` on the
  batch verl's v0 ``_update_actor`` would send.

For both: the logit gradient of a response token is nonzero exactly where the driver's mask (looked up
by the row's token ids, not by position) is True; ``tokensel/selected_fraction`` is verl's mean over
micro-batches and ranks of the fraction each micro-batch's mask realises, and
``tokensel/driver_selected_fraction`` the exact fraction of the whole batch; the masks of both ranks
together hold exactly the driver's ``ceil(0.2 N)`` tokens (batch) or ``ceil(0.2 n_g)`` per prompt (group).
"""

from __future__ import annotations

import math

import pytest

import torch

from verl_tokensel_cpu import batches as B, tiny_model, worker as H
from helpers import distributed as D
from helpers.grad_probe import (
    capture_logit_grads,
    prompt_lengths,
    response_lengths,
    row_ids,
    token_grad_norms,
)

pytestmark = pytest.mark.requires("verl")

N = 12
GROUP_SIZE = 4
WORKER_KW = dict(use_dynamic_bsz=True, ppo_mini_batch_size=12, ppo_micro_batch_size_per_gpu=2,
                 ppo_max_token_len_per_gpu=40, lr=0.0, clip_grad=1e9)
CASES = [("forking_paper", {}, "v1"), ("gmts", {"score_source": "rollout", "scope": "group"}, "v0")]


class FakeTQ:
    """Keyed per-row storage with ``kv_batch_get``/``kv_batch_put`` (what ``select_v1`` calls)."""

    def __init__(self, td, keys):
        self.td, self.index = td, {k: i for i, k in enumerate(keys)}

    def kv_batch_get(self, keys, partition_id, select_fields):
        from verl.utils.tensordict_utils import index_select_tensor_dict

        present = [f for f in select_fields if f in self.td.keys()]
        return index_select_tensor_dict(self.td.select(*present), [self.index[k] for k in keys])

    def kv_batch_put(self, keys, partition_id, fields):
        from verl.utils.tensordict_utils import index_select_tensor_dict

        inverse = [0] * len(keys)
        for pos, k in enumerate(keys):
            inverse[self.index[k]] = pos
        stored = index_select_tensor_dict(fields, inverse)
        for name in fields.keys():
            self.td[name] = stored[name]

    def rows(self, keys):
        from tensordict import NonTensorData, NonTensorStack

        from verl.utils.tensordict_utils import index_select_tensor_dict

        idx = [self.index[k] for k in keys]
        tensors = [k for k in self.td.keys() if isinstance(self.td.get(k), torch.Tensor)]
        out = index_select_tensor_dict(self.td.select(*tensors), idx)
        uids = list(self.td["uid"])
        out["uid"] = NonTensorStack(*[NonTensorData(uids[i]) for i in idx])
        return out






def _row_masks(data, field):
    """Per row: the 1-D bool mask over its response tokens."""
    lens = response_lengths(data)
    rows = data[field].unbind(0) if data[field].is_nested else [data[field][i, :n] for i, n in enumerate(lens)]
    return [r.bool().clone() for r in rows]


def _expected_masks(sel, full, entropy_rows, order=None):
    """Row id -> mask by select_on_driver over ``full``'s own fields taken in ``order`` (the order the driver
    sees: ties are broken by position, and the tiny random model's entropies do tie)."""
    from verl_tokensel.core.ranking.batch import group_ids as group_ids_from_uids
    from verl_tokensel.core.driver_select import select_on_driver

    lens = response_lengths(full)
    width = max(lens)

    def pad(rows):
        out = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            out[i, : r.numel()] = r.float()
        return out

    valid = torch.arange(width).view(1, -1) < torch.tensor(lens).view(-1, 1)
    f = {k: pad(_row_masks_float(full, k)) for k in ("old_log_probs", "advantages")}
    order = list(range(len(lens))) if order is None else order
    res = select_on_driver(sel, {"response_mask": valid[order], "old_log_probs": f["old_log_probs"][order],
                                 "advantages": f["advantages"][order], "entropy": pad(entropy_rows)[order]},
                           group_ids=group_ids_from_uids([str(list(full["uid"])[i]) for i in order]))
    rows = row_ids(full)
    return {rows[j]: res.mask[i, : lens[j]] for i, j in enumerate(order)}


def _row_masks_float(data, field):
    lens = response_lengths(data)
    return [r.clone() for r in data[field].unbind(0)] if data[field].is_nested else \
        [data[field][i, :n].clone() for i, n in enumerate(lens)]


def _driver_v1(actor, cfg_node, sel, full):
    """The V1 driver: old pass, balance_batch-like permutation, select_v1 through the stand-in TQ."""
    from transfer_queue import KVBatchMeta

    from verl_tokensel.verl_glue import rollout_source as RS

    H.compute_old_log_probs(actor, full)  # writes old_log_probs and entropy (nested), as V1 stores them
    keys = [f"k{i}" for i in range(N)]
    store = FakeTQ(full, keys)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(11)).tolist()
    expected = _expected_masks(sel, full, list(full["entropy"].unbind(0)), perm)
    batch = KVBatchMeta(keys=[keys[i] for i in perm], partition_id="train", tags=[{} for _ in perm],
                        fields=sorted(full.keys()))
    driver = RS.DriverSelector(cfg_node, sel)
    import transfer_queue

    real = (transfer_queue.kv_batch_get, transfer_queue.kv_batch_put)
    transfer_queue.kv_batch_get, transfer_queue.kv_batch_put = store.kv_batch_get, store.kv_batch_put
    try:
        metrics = {}
        out = driver.select_v1(batch, metrics)
    finally:
        transfer_queue.kv_batch_get, transfer_queue.kv_batch_put = real
    from verl_tokensel.verl_glue.loss import MASK_FIELD, SCORE_FIELD

    assert MASK_FIELD in out.fields and SCORE_FIELD in out.fields
    sent = store.rows(out.keys)  # what update_actor fetches, in the balanced order
    from verl.utils import tensordict_utils as tu

    meta = {k: tu.get_non_tensor_data(full, k, None) for k in (
        "mini_batch_size", "global_batch_size", "epochs", "seed", "dataloader_kwargs", "temperature",
        "calculate_entropy", "distillation_use_topk", "distillation_only")}
    tu.assign_non_tensor(sent, **{k: v for k, v in meta.items() if v is not None})
    metrics["expected"] = expected
    return sent, metrics


def _driver_v0(actor, cfg_node, sel, full):
    """The v0 driver: old pass (padded entropy kept as the v0 trainer does), select_v0 on the batch."""
    import numpy as np

    from verl_tokensel.verl_glue import rollout_source as RS
    from verl_tokensel.verl_glue import v0 as glue_v0

    _, entropy = H.compute_old_log_probs(actor, full)
    full[glue_v0.V0_ENTROPY_FIELD] = entropy * full["response_mask"]
    expected = _expected_masks(sel, full, [entropy[i, :n] for i, n in enumerate(response_lengths(full))])
    proto = type("Proto", (), {})()
    proto.batch = full
    proto.non_tensor_batch = {"uid": np.array([str(u) for u in full["uid"]], dtype=object)}
    driver = RS.DriverSelector(cfg_node, sel)
    metrics = glue_v0.select_v0(driver, proto)
    assert glue_v0.V0_ENTROPY_FIELD not in full.keys()
    metrics["expected"] = expected
    return full, metrics


def _rank_step(rank, world, model_dir):
    from omegaconf import OmegaConf

    from verl_tokensel.verl_glue.loss import MASK_FIELD, SelectingLoss

    actor = H.make_training_worker(model_dir, rank=rank, world_size=world, **WORKER_KW)
    results = {}
    for preset, knobs, fmt in CASES:
        cfg = H.selecting_actor_config(actor, preset, **knobs)
        cfg_node = OmegaConf.create({"actor_rollout_ref": {
            "actor": OmegaConf.to_container(actor.cfg.actor_rollout_ref.actor, resolve=True),
            "model": {"path": "unused"}, "rollout": {"temperature": 1.0}}})
        full = B.make_update_batch(actor, n=N, seed=5, fmt=fmt, resp_len=(3, 9), group_size=GROUP_SIZE)
        sent, driver_metrics = (_driver_v1 if fmt == "v1" else _driver_v0)(actor, cfg_node, cfg.selection, full)
        driver_mask = dict(zip(row_ids(sent), _row_masks(sent, MASK_FIELD)))
        expected = driver_metrics.pop("expected")
        assert driver_mask.keys() == expected.keys()
        assert all(torch.equal(driver_mask[row], expected[row]) for row in expected), "mask stored on the wrong rows"
        uid_of = dict(zip(row_ids(sent), [str(u) for u in sent["uid"]]))
        shard = D.split_for_dp(sent, world)[rank]

        micro = []

        def observe(rec):
            d = rec["data"]
            micro.append(dict(rows=row_ids(d), mask=rec["mask"].clone(), response_mask=rec["response_mask"].clone(),
                              prompt_lens=prompt_lengths(d), resp_lens=response_lengths(d)))

        with capture_logit_grads(actor) as logit_grads:
            r = H.run_train_step(actor, shard, capture_params=False,
                                 loss_fn=SelectingLoss(cfg, observer=observe))
        results[preset] = dict(driver_mask=driver_mask, uid_of=uid_of, driver_metrics=driver_metrics, micro=micro,
                               grad_norms=token_grad_norms(logit_grads, micro, actor.use_remove_padding),
                               fraction=r.metrics.get("tokensel/selected_fraction"))
    return results


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    if (__import__("os").cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPU cores")
    model_dir = tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_rollout") / "qwen2")
    return D.run_distributed(_rank_step, world_size=2, args=(str(model_dir),), timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", [c[0] for c in CASES])
def test_driver_mask_reaches_the_right_rows(dp_run, preset):
    per_rank = [dp_run[r][preset] for r in range(2)]
    driver_mask = per_rank[0]["driver_mask"]
    assert per_rank[1]["driver_mask"].keys() == driver_mask.keys()
    seen, n_sel, n_valid, per_micro = set(), 0, 0, [[], []]
    for rank, res in enumerate(per_rank):
        for m, norms in zip(res["micro"], res["grad_norms"]):
            valid, mask = m["response_mask"], m["mask"]
            for i, row in enumerate(m["rows"]):
                rl = m["resp_lens"][i]
                expect = driver_mask[row]
                assert torch.equal(mask[i, :rl], expect), f"{preset}: row {row} got another row's mask"
                assert torch.all(norms[i, :rl][expect] > 0), f"{preset}: a selected token got no gradient"
                assert torch.all(norms[i, :rl][~expect] == 0), f"{preset}: gradient leaked to an unselected token"
                seen.add(row)
            per_micro[rank].append(float((mask & valid).sum()) / float(valid.sum()))
            n_sel += int((mask & valid).sum())
            n_valid += int(valid.sum())
    # the loss reports each micro-batch's realised fraction; verl averages them over micro-batches and
    # DP ranks (Metric MEAN, aggregate_dp), one value per mini-batch (here one)
    assert len(per_micro[0]) == len(per_micro[1])  # dynamic batching pads ranks to equal micro-batch counts
    expect_metric = sum(map(sum, per_micro)) / (2 * len(per_micro[0]))
    for res in per_rank:
        fractions = res["fraction"] if isinstance(res["fraction"], list) else [res["fraction"]]
        assert [float(f) for f in fractions] == pytest.approx([expect_metric]), (fractions, per_micro)
    assert seen == set(driver_mask), "some rows never reached the loss"
    assert n_sel == sum(int(m.sum()) for m in driver_mask.values())
    # the exact fraction of the whole batch is the driver's metric
    metrics = per_rank[0]["driver_metrics"]
    assert metrics["tokensel/driver_selected_fraction"] == pytest.approx(n_sel / n_valid)
    assert metrics["tokensel/driver_selected_tokens"] == n_sel and metrics["tokensel/driver_valid_tokens"] == n_valid
    if preset == "forking_paper":
        assert n_sel == math.ceil(0.2 * n_valid)
    else:
        by_uid = {}
        for row, m in driver_mask.items():
            s, v = by_uid.get(per_rank[0]["uid_of"][row], (0, 0))
            by_uid[per_rank[0]["uid_of"][row]] = (s + int(m.sum()), v + m.numel())
        assert len(by_uid) == N // GROUP_SIZE
        assert all(s == math.ceil(0.2 * v) for s, v in by_uid.values()), by_uid
