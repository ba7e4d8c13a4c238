"""``score_source=rollout`` through a REAL TransferQueue (local Ray), as the V1 trainers use it.

- ``DriverSelector.select_v1`` reads the batch's fields by key, writes ``token_select_mask`` /
  ``token_select_score`` nested under the same keys, and widens ``KVBatchMeta.fields``: what a worker
  then fetches with verl's own ``_meta_to_realdata`` (the TransferQueue bridge of ``update_actor``)
  holds the mask on the right rows, in the balanced (permuted) order; a synthetic padding row
  (``is_padding`` tag) is never selected; a meta taken BEFORE the write would not carry the field
  (the reason the field list is widened).
- ``ref_entropy``: the driver scores the responses under the reference model with a Ray scorer group;
  the scores sent equal the in-process scorer's entropies of the same (prompt, response) pairs.
"""

from __future__ import annotations

import math

import pytest

import torch
from omegaconf import OmegaConf
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl_tokensel.core.config import TokenSelectionConfig, resolve_selection
from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
from verl_tokensel.verl_glue.loss import MASK_FIELD, SCORE_FIELD

pytestmark = pytest.mark.requires("verl", "ray", "transfer_queue")

N, GROUP = 8, 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("rollout_tq") / "tiny")


@pytest.fixture(scope="module")
def tq_ray():
    import ray
    import transfer_queue as tq

    from helpers.ray_actor import local_ray

    with local_ray(num_cpus=4, num_gpus=0, log_to_driver=False):
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        try:
            yield tq
        finally:
            try:
                tq.close()
            except Exception:  # noqa: BLE001 - Ray shutdown below ends the TQ actors anyway
                pass
    assert not ray.is_initialized()


def _nt(xs):
    return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)


def _put_batch(tq, partition, seed=0, vocab=300):
    """A V1 update batch as TransferQueue holds it after verl's advantage step; returns (keys, meta, rows)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 9, (N,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (4,), generator=g) for _ in range(N // GROUP) for _ in range(GROUP)]
    responses = [torch.randint(10, vocab, (n,), generator=g) for n in lens]
    entropy = [torch.rand(n, generator=g) * 3 for n in lens]
    adv = [torch.full((n,), float(a)) for n, a in zip(lens, torch.randn(N, generator=g))]
    fields = TensorDict({
        "prompts": _nt(prompts), "responses": _nt(responses),
        "input_ids": _nt(torch.cat([p, r]) for p, r in zip(prompts, responses)),
        "response_mask": _nt(torch.ones(n, dtype=torch.int64) for n in lens),
        "old_log_probs": _nt(-torch.rand(n, generator=g) for n in lens),
        "advantages": _nt(adv), "entropy": _nt(entropy),
    }, batch_size=N)
    fields["uid"] = NonTensorStack(*[NonTensorData(f"u{i // GROUP}") for i in range(N)])
    keys = [f"{partition}-{i}" for i in range(N)]
    tags = [{"is_padding": i == N - 1} for i in range(N)]  # the last row stands for balance_batch's padding
    meta = tq.kv_batch_put(keys=keys, partition_id=partition, fields=fields, tags=tags)
    return keys, meta, dict(prompts=prompts, responses=responses, entropy=entropy, lens=lens)


def _driver(sel, model_path="unused"):
    from verl_tokensel.verl_glue.rollout_source import DriverSelector

    cfg = OmegaConf.create({"actor_rollout_ref": {
        "actor": {"clip_ratio": 0.2, "use_kl_loss": False}, "model": {"path": model_path},
        "rollout": {"temperature": 1.0}}})
    return DriverSelector(cfg, sel)


def _worker_view(meta):
    """What update_actor's worker receives for ``meta`` (verl's TransferQueue bridge)."""
    from verl.utils.transferqueue_utils import _meta_to_realdata

    return _meta_to_realdata(meta)


@pytest.mark.timeout(240)
def test_mask_reaches_the_worker_on_its_rows(tq_ray):
    tq = tq_ray
    keys, meta, rows = _put_batch(tq, "t1")
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    meta.reorder(perm)  # balance_batch
    stale = type(meta)(keys=list(meta.keys), tags=list(meta.tags), partition_id=meta.partition_id,
                       fields=list(meta.fields))
    sel = resolve_selection("forking_paper", TokenSelectionConfig())
    metrics = {}
    out = _driver(sel).select_v1(meta, metrics)
    assert out.keys == [keys[i] for i in perm] and MASK_FIELD in out.fields and SCORE_FIELD in out.fields

    data = _worker_view(out)
    assert data[MASK_FIELD].is_nested and data[MASK_FIELD].dtype == torch.bool
    # expected: top ceil(0.2 N) entropies over the real rows (the padding row is excluded)
    real = [i for i in range(N - 1)]
    pool = torch.cat([rows["entropy"][i] for i in real])
    k = math.ceil(0.2 * pool.numel())
    threshold = pool.topk(k).values.min()
    for pos, i in enumerate(perm):
        got = data[MASK_FIELD][pos]
        assert torch.equal(data["responses"][pos], rows["responses"][i])  # row order is the meta's
        assert got.numel() == rows["lens"][i]
        if i == N - 1:
            assert not got.any(), "a padding row was selected"
        else:
            assert torch.equal(got, rows["entropy"][i] >= threshold)
            torch.testing.assert_close(data[SCORE_FIELD][pos], rows["entropy"][i])
    assert sum(int(data[MASK_FIELD][p].sum()) for p in range(N)) == k
    assert metrics["tokensel/driver_selected_tokens"] == k
    assert metrics["tokensel/driver_valid_tokens"] == pool.numel()
    # a meta from before the write lists the old fields: the worker would not see the mask
    assert MASK_FIELD not in _worker_view(stale).keys()


@pytest.mark.timeout(300)
def test_ref_entropy_scored_by_the_reference_model(tq_ray, tiny_dir):
    from transformers import AutoModelForCausalLM

    from verl_tokensel.analysis.scorer import score_responses

    tq = tq_ray
    keys, meta, rows = _put_batch(tq, "t2", seed=1)
    sel = resolve_selection("forking_paper", TokenSelectionConfig(score="ref_entropy", scope="group"))
    driver = _driver(sel, model_path=str(tiny_dir))
    try:
        metrics = {}
        out = driver.select_v1(meta, metrics)
    finally:
        driver.shutdown()
    data = _worker_view(out)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    expect = score_responses(model, [(p.tolist(), r.tolist()) for p, r in zip(rows["prompts"], rows["responses"])])
    for i in range(N - 1):
        torch.testing.assert_close(data[SCORE_FIELD][i], expect[i].entropy.float(), rtol=1e-4, atol=1e-5)
    for g in range(N // GROUP):  # group scope: ceil(0.2 n_g) per uid (padding row excluded)
        idx = [i for i in range(g * GROUP, (g + 1) * GROUP) if i != N - 1]
        n_g = sum(rows["lens"][i] for i in idx)
        assert sum(int(data[MASK_FIELD][i].sum()) for i in idx) == math.ceil(0.2 * n_g)


@pytest.mark.timeout(240)
def test_grad_norm_reads_the_old_pass_sum_p2(tq_ray):
    """The old-log-prob pass writes sum_j p_j^2 over the whole sequence (like log_probs); the driver takes
    the response part (left-shifted by one) and ranks by |A| * ||e_a - p|| (r = 1 at the old policy)."""
    from verl_tokensel.core.ranking.scores import logit_grad_norm

    tq = tq_ray
    keys, meta, rows = _put_batch(tq, "t3", seed=2)
    data = tq.kv_batch_get(keys=keys, partition_id="t3", select_fields=["old_log_probs", "advantages"])
    g = torch.Generator().manual_seed(3)
    resp_sp2, full = [], []
    for p, n, lp in zip(rows["prompts"], rows["lens"], data["old_log_probs"].unbind(0)):
        pa2 = lp.exp() ** 2
        sp2 = pa2 + (1 - lp.exp()) ** 2 * torch.rand(n, generator=g)  # inside its exact range
        resp_sp2.append(sp2)
        # whole-sequence layout of the engine's output: position t scores token t + 1
        full.append(torch.cat([torch.full((p.numel() - 1,), 9.0), sp2, torch.full((1,), 9.0)]))
    tq.kv_batch_put(keys=keys, partition_id="t3", fields=TensorDict({"sum_pi_squared": _nt(full)}, batch_size=N))
    sel = resolve_selection("forking_paper", TokenSelectionConfig(score="grad_norm"))
    metrics = {}
    out = _driver(sel).select_v1(meta, metrics)
    got = _worker_view(out)
    for i in range(N - 1):
        lp, adv = data["old_log_probs"][i], data["advantages"][i]
        expect = adv.abs() * logit_grad_norm(lp, resp_sp2[i])
        torch.testing.assert_close(got[SCORE_FIELD][i], expect)
        assert not torch.allclose(expect, adv.abs() * logit_grad_norm(lp, None))  # not the lower bound


@pytest.mark.timeout(240)
def test_response_fields_reach_a_group_rule_through_transfer_queue(tq_ray):
    """``ktae`` on the V1 layout: the driver reads the responses' token ids and their rewards from TransferQueue as
    verl's V1 driver leaves them (``rm_scores`` only: ``token_level_rewards`` is written back only with a KL in the
    reward), and the tokenizer's EOS; its scores are those of the rule on the padded batch."""
    from types import SimpleNamespace

    from verl_tokensel.core.rules.ktae import key_token_bonus
    from verl_tokensel.verl_glue.rollout_source import DriverSelector

    tq = tq_ray
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(3, 9, (N,), generator=g).tolist()
    responses = [torch.randint(10, 16, (n,), generator=g) for n in lens]  # few ids: they repeat across answers
    for i in (0, 1, 4, 6):  # some answers end on EOS (id 2)
        responses[i][-1] = 2
    scores = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    rm = [torch.zeros(n) for n in lens]
    for r, s in zip(rm, scores):
        r[-1] = s
    fields = TensorDict({
        "responses": _nt(responses), "prompts": _nt(torch.randint(10, 16, (4,), generator=g) for _ in range(N)),
        "response_mask": _nt(torch.ones(n, dtype=torch.int64) for n in lens),
        "old_log_probs": _nt(-torch.rand(n, generator=g) for n in lens),
        "advantages": _nt(torch.full((n,), 0.5) for n in lens), "entropy": _nt(torch.rand(n) for n in lens),
        "rm_scores": _nt(rm),
    }, batch_size=N)
    fields["uid"] = NonTensorStack(*[NonTensorData(f"u{i // GROUP}") for i in range(N)])
    keys = [f"t9-{i}" for i in range(N)]
    meta = tq.kv_batch_put(keys=keys, partition_id="t9", fields=fields, tags=[{} for _ in range(N)])
    sel = resolve_selection("ktae", TokenSelectionConfig())
    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {}, "model": {"path": "unused"},
                                                  "rollout": {"temperature": 1.0}}})
    driver = DriverSelector(cfg, sel, trainer=SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=2)))
    metrics = {}
    out = driver.select_v1(meta, metrics)
    data = _worker_view(out)
    width = max(lens)
    ids = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in responses])
    valid = torch.stack([torch.arange(width) < n for n in lens])
    want = key_token_bonus(ids, valid, torch.tensor(scores), torch.tensor([i // GROUP for i in range(N)]),
                           sel.knobs, eos=(ids == 2) & valid)
    got = data[SCORE_FIELD].to_padded_tensor(0.0)
    torch.testing.assert_close(got, want * valid)
    assert (want.abs() > 0).sum() >= 5 and metrics["tokensel/driver_ktae/bonus_abs_max"] > 0
    assert torch.equal(got[(ids == 2) & valid], torch.zeros(int(((ids == 2) & valid).sum())))
