"""``score_source=prepass`` through verl's REAL TrainingWorker with data parallelism 2 (two gloo processes).

One spawned 2-rank run (FSDP2 engine, ``use_dynamic_bsz=True``, learning rate 0 so the policy does not
move between the checks) does two actor updates with the ``gmts`` preset, whose pre-pass scores every
token with a no-grad forward at the start of each mini-batch:

- ``scope=mini_batch`` (V1 batch: nested fields), two mini-batches per update: each mini-batch's mask
  equals ONE process selecting over the rank-ordered concatenation of both ranks' rows of that
  mini-batch (ties and all), with the scores the pre-pass wrote;
- ``scope=group`` (v0 batch: padded fields), 3 prompts x 4 responses with the middle prompt's responses
  split 2 + 2 over the ranks: every prompt keeps exactly ``ceil(0.2 * n_g)`` of its response tokens, and
  the mask equals the single-process per-group selection over the union;

and for both: the scores are H * |A| of the right row (on-policy, so r = 1 and omega = A; H from verl's
own log-prob pass), the logit gradient of every unselected response token is exactly zero and that of
every selected token is not, and ``tokensel/prepass/selected_fraction`` is the realised fraction over
both ranks.
"""

from __future__ import annotations


import pytest

import torch

from verl_tokensel_cpu import batches as B, tiny_model, worker as H
from helpers import distributed as D
from helpers.grad_probe import (
    capture_logit_grads,
    padded_response_field,
    prompt_lengths,
    response_lengths,
    row_ids,
    token_grad_norms,
)

pytestmark = pytest.mark.requires("verl")

RATIO = 0.2
N = 12  # responses in the update batch (6 per rank)
GROUP_SIZE = 4  # prompts of 4 responses: rows 0-3 | 4-7 | 8-11, the middle prompt split over the ranks
WORKER_KW = dict(use_dynamic_bsz=True, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2,
                 ppo_max_token_len_per_gpu=48, lr=0.0, clip_grad=1e9)
CASES = [("mini_batch", "v1", 6), ("group", "v0", 12)]  # (scope, batch format, global mini-batch size)




def _rank_step(rank, world, model_dir):
    """One rank: per case, one update; returns what each mini-batch's pre-pass wrote and what the loss did."""
    from verl.utils import tensordict_utils as tu

    from verl_tokensel.verl_glue.loss import MASK_FIELD, SCORE_FIELD, SelectingLoss

    actor = H.make_training_worker(model_dir, rank=rank, world_size=world, **WORKER_KW)
    inner = actor.worker.train_batch  # the pre-pass wrap (install_prepass) around verl's train_batch
    results = {}
    for scope, fmt, mini in CASES:
        full = B.make_update_batch(actor, n=N, seed=7, fmt=fmt, resp_len=(3, 9), group_size=GROUP_SIZE)
        tu.assign_non_tensor(full, mini_batch_size=mini, global_batch_size=mini)
        shard = D.split_for_dp(full, world)[rank]
        _, old_entropy = H.compute_old_log_probs(actor, shard)
        entropy_by_row = dict(zip(row_ids(shard), _padded_list(old_entropy, shard)))

        minibatches, micro = [], []

        def spy(data, *args, **kwargs):
            out = inner(data, *args, **kwargs)  # the pre-pass wrote MASK_FIELD / SCORE_FIELD into `data`
            resp_lens = response_lengths(data)
            minibatches.append(dict(
                rows=row_ids(data), uids=[str(u) for u in data.get("uid").tolist()], resp_lens=resp_lens,
                mask=padded_response_field(data[MASK_FIELD], resp_lens).bool(),
                scores=padded_response_field(data[SCORE_FIELD], resp_lens),
                adv=padded_response_field(data["advantages"], resp_lens)))
            return out

        def observe(rec):
            d = rec["data"]
            micro.append(dict(mask=rec["mask"].clone(), response_mask=rec["response_mask"].clone(),
                              prompt_lens=prompt_lengths(d), resp_lens=response_lengths(d)))

        cfg = H.selecting_actor_config(actor, "gmts", scope=scope)
        actor.worker.train_batch = spy
        try:
            with capture_logit_grads(actor) as logit_grads:
                r = H.run_train_step(actor, shard, capture_params=False,
                                     loss_fn=SelectingLoss(cfg, observer=observe))
        finally:
            actor.worker.train_batch = inner
        results[scope] = dict(minibatches=minibatches, entropy_by_row=entropy_by_row,
                              grad_norms=token_grad_norms(logit_grads, micro, actor.use_remove_padding), micro=micro,
                              fraction=r.metrics.get("tokensel/prepass/selected_fraction"),
                              tokens=r.metrics.get("tokensel/prepass/selected_tokens"))
    return results




def _padded_list(field, data):
    lens = response_lengths(data)
    if field.is_nested:
        return [r.clone() for r in field.unbind(0)]
    return [field[i, :n].clone() for i, n in enumerate(lens)]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    model_dir = tiny_model.build_tiny_model_dir(tmp_path_factory.mktemp("tiny_prepass") / "qwen2")
    return D.run_distributed(_rank_step, world_size=2, args=(str(model_dir),), timeout=240)


def _union(per_rank, scope, i):
    """Mini-batch ``i`` of both ranks, concatenated in rank order (padded to one width)."""
    parts = [per_rank[r][scope]["minibatches"][i] for r in range(2)]
    width = max(p["mask"].shape[1] for p in parts)

    def cat(key):
        return torch.cat([torch.nn.functional.pad(p[key], (0, width - p[key].shape[1])) for p in parts])

    lens = [n for p in parts for n in p["resp_lens"]]
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    rows = [row for p in parts for row in p["rows"]]
    uids = [u for p in parts for u in p["uids"]]
    return dict(mask=cat("mask"), scores=cat("scores"), adv=cat("adv"), valid=valid, rows=rows, uids=uids)


@pytest.mark.parametrize("scope", [c[0] for c in CASES])
def test_prepass_selection_equals_one_process_over_the_union(dp_run, scope):
    from verl_tokensel.core.ranking.select import budget, select_tokens
    from verl_tokensel.core.ranking.batch import group_ids as stable_group_ids

    n_mini = len(dp_run[0][scope]["minibatches"])
    assert n_mini == (2 if scope == "mini_batch" else 1) and len(dp_run[1][scope]["minibatches"]) == n_mini
    total_sel = total_valid = 0
    for i in range(n_mini):
        u = _union(dp_run, scope, i)
        assert not (u["mask"] & ~u["valid"]).any()
        # the scores sit on their rows: H (verl's log-prob pass) * |A| of that row (on-policy, r = 1)
        entropy = {**dp_run[0][scope]["entropy_by_row"], **dp_run[1][scope]["entropy_by_row"]}
        for k, row in enumerate(u["rows"]):
            n = int(u["valid"][k].sum())
            expected = entropy[row][:n] * u["adv"][k, :n].abs()
            torch.testing.assert_close(u["scores"][k, :n], expected.float(), rtol=1e-4, atol=1e-6)
        gids = stable_group_ids(u["uids"]) if scope == "group" else None
        expected = select_tokens(u["scores"], u["valid"], RATIO, scope=scope, group_ids=gids)
        assert torch.equal(u["mask"], expected)
        if scope == "mini_batch":
            assert int(u["mask"].sum()) == budget(RATIO, int(u["valid"].sum()))
        else:
            split = [g for g in set(u["uids"]) if {g in dp_run[r][scope]["minibatches"][i]["uids"] for r in (0, 1)}
                     == {True}]
            assert split, "no prompt group is split across the two ranks"
            assert len(set(u["uids"])) == N // GROUP_SIZE
            for g in set(u["uids"]):
                rows = torch.tensor([x == g for x in u["uids"]])
                assert int(u["mask"][rows].sum()) == budget(RATIO, int(u["valid"][rows].sum())), g
        total_sel += int(u["mask"].sum())
        total_valid += int(u["valid"].sum())
        # the metric is the realised fraction of this mini-batch over both ranks, reported by both
        for r in range(2):
            frac = dp_run[r][scope]["fraction"]
            assert frac is not None and abs(float(frac[i]) - int(u["mask"].sum()) / int(u["valid"].sum())) < 1e-12
    assert 0 < total_sel < total_valid


@pytest.mark.parametrize("scope", [c[0] for c in CASES])
def test_logit_gradient_is_zero_exactly_on_unselected_tokens(dp_run, scope):
    n_sel = 0
    for r in range(2):
        res = dp_run[r][scope]
        for norms, m in zip(res["grad_norms"], res["micro"]):
            valid, mask = m["response_mask"], m["mask"]
            unsel = valid & ~mask
            assert torch.all(norms[unsel] == 0), f"rank {r}: gradient leaked to unselected tokens"
            assert torch.all(norms[mask] > 0), f"rank {r}: a selected token got no gradient"
            n_sel += int(mask.sum())
        # the loss applied exactly the pre-pass mask: same number of selected tokens
        assert (sum(int(m["mask"].sum()) for m in res["micro"])
                == sum(int(mb["mask"].sum()) for mb in res["minibatches"]))
    assert n_sel > 0
