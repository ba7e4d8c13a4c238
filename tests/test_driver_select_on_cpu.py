"""Driver-side selection (``score_source=rollout``): :func:`select_on_driver` on padded batches.

- ``batch`` scope keeps exactly ceil(rho * N) tokens over the union of all responses: the top scores;
- ``group`` keeps ceil(rho * n_g) per uid and is independent of the other groups;
- permuting the rows (balance_batch, dynamic batching) permutes the mask with them;
- scores are taken at the old policy: gmts = H * |A| (r = 1 is never clipped);
- the per-token field the glue sends is bool, nested like verl's other response fields.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_tokensel.core.config import PRESETS, TokenSelectionConfig, resolve_selection
from verl_tokensel.core.ranking.batch import group_ids as group_ids_from_uids
from verl_tokensel.core.driver_select import score_params, select_on_driver


def _batch(seed=0, n=12, length=9, group_size=4):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, length + 1, (n,), generator=g)
    valid = torch.arange(length).view(1, -1) < lens.view(-1, 1)
    entropy = torch.rand(n, length, generator=g) * 3 * valid
    old_lp = -torch.rand(n, length, generator=g) * 4 * valid
    adv_row = torch.randn(n, generator=g)
    adv = adv_row.view(-1, 1).expand(n, length) * valid
    uids = [f"p{i // group_size}" for i in range(n)]
    return dict(response_mask=valid.long(), entropy=entropy, old_log_probs=old_lp, advantages=adv), uids


def _sel(preset="forking_paper", **knobs):
    return resolve_selection(preset, TokenSelectionConfig(**knobs))


def test_batch_scope_keeps_top_ceil_over_union():
    f, _ = _batch()
    sel = _sel()
    out = select_on_driver(sel, f)
    valid = f["response_mask"].bool()
    n = int(valid.sum())
    k = math.ceil(0.2 * n)
    assert int(out.mask.sum()) == k
    assert not (out.mask & ~valid).any()
    # the kept tokens are exactly the k highest entropies of the union
    kept_min = f["entropy"][out.mask].min()
    dropped_max = f["entropy"][valid & ~out.mask].max()
    assert kept_min >= dropped_max
    assert out.scores.dtype == torch.float32
    assert torch.equal(out.scores[valid], f["entropy"][valid])
    assert out.metrics["tokensel/driver_selected_tokens"] == k
    assert out.metrics["tokensel/driver_selected_fraction"] == pytest.approx(k / n)


def test_group_scope_keeps_ceil_per_uid():
    f, uids = _batch(seed=1, n=12, group_size=3)
    sel = _sel(scope="group", ratio=0.3)
    gid = group_ids_from_uids(uids)
    out = select_on_driver(sel, f, group_ids=gid)
    valid = f["response_mask"].bool()
    for g in gid.unique():
        rows = gid == g
        n_g = int(valid[rows].sum())
        assert int(out.mask[rows].sum()) == math.ceil(0.3 * n_g)
        # each group alone gives the same mask as the whole batch
        alone = select_on_driver(sel, {k: v[rows] for k, v in f.items()}, group_ids=gid[rows])
        assert torch.equal(alone.mask, out.mask[rows])
    assert out.metrics["tokensel/driver_groups"] == gid.unique().numel()


@pytest.mark.parametrize("scope", ["batch", "group", "sequence"])
def test_row_permutation_moves_mask_with_rows(scope):
    f, uids = _batch(seed=2)
    sel = _sel(scope=scope)
    gid = group_ids_from_uids(uids)
    out = select_on_driver(sel, f, group_ids=gid)
    perm = torch.randperm(len(uids), generator=torch.Generator().manual_seed(5))
    perm_uids = [uids[i] for i in perm.tolist()]
    out_p = select_on_driver(sel, {k: v[perm] for k, v in f.items()}, group_ids=group_ids_from_uids(perm_uids))
    assert torch.equal(out_p.mask, out.mask[perm])
    assert torch.equal(out_p.scores, out.scores[perm])


def test_gmts_at_old_policy_is_entropy_times_abs_advantage():
    f, uids = _batch(seed=3)
    sel = _sel("gmts", score_source="rollout", scope="group")
    out = select_on_driver(sel, f, group_ids=group_ids_from_uids(uids), params=score_params(object()))
    valid = f["response_mask"].bool()
    expect = (f["entropy"] * f["advantages"].abs())[valid]
    torch.testing.assert_close(out.scores[valid], expect)


def test_padding_rows_never_selected():
    f, _ = _batch(seed=4)
    row_valid = torch.ones(12, dtype=torch.bool)
    row_valid[-2:] = False
    f["entropy"][-2:] = 100.0  # would win every top-k if counted
    out = select_on_driver(_sel(), f, row_valid=row_valid)
    assert not out.mask[-2:].any()
    n = int(f["response_mask"][:-2].sum())
    assert int(out.mask.sum()) == math.ceil(0.2 * n)


def test_ref_entropy_reads_the_external_field():
    f, _ = _batch(seed=5)
    ref = torch.rand_like(f["entropy"])
    out = select_on_driver(_sel(score="ref_entropy"), f, external={"ref_entropy": ref})
    valid = f["response_mask"].bool()
    assert torch.equal(out.scores[valid], ref[valid])
    with pytest.raises(ValueError, match="ref_entropy"):
        select_on_driver(_sel(score="ref_entropy"), f)


def test_mask_field_round_trips_as_nested_bool():
    from verl.workers.utils.padding import response_to_nested

    f, _ = _batch(seed=6)
    out = select_on_driver(_sel(), f)
    lens = f["response_mask"].sum(1)
    rm_nested = torch.nested.as_nested_tensor([torch.ones(int(n), dtype=torch.int64) for n in lens],
                                              layout=torch.jagged)
    nested = response_to_nested(out.mask, rm_nested)
    assert nested.is_nested and nested.dtype == torch.bool
    back = nested.to_padded_tensor(False)
    assert torch.equal(back, out.mask[:, : back.shape[1]])


def test_forking_paper_preset_is_rollout_batch_all():
    sel = PRESETS["forking_paper"]
    assert (sel.score, sel.scope, sel.score_source, sel.normaliser, sel.ratio) == (
        "entropy", "batch", "rollout", "all", 0.2)


# ---------------------------------------------------------------------------------- driver-side checks
def _compose(overrides=()):
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl_tokensel.config", version_base=None):
        return compose("tokensel_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                                      *overrides])


SEL = "actor_rollout_ref.actor.token_selector"
KNOB = "actor_rollout_ref.actor.token_selection."
BAD_ROLLOUT = [
    ([f"{SEL}=forking", f"{KNOB}score=ref_entropy"], "score_source='current'", "rollout"),
    ([f"{SEL}=gmts", f"{KNOB}score=ref_entropy"], "score_source='prepass'", "rollout"),
    ([f"{SEL}=forking_paper", f"{KNOB}ref_model_path=/m"], "ref_model_path='/m'", "ref_entropy"),
    ([f"{SEL}=forking_paper", f"{KNOB}scope=micro_batch"], "scope='micro_batch'", "batch, group, sequence"),
    ([f"{SEL}=forking_paper", f"{KNOB}normaliser=selected"], "normaliser='selected'", "all"),
    ([f"{SEL}=forking_paper", "algorithm.rollout_correction.bypass_mode=true"], "bypass_mode=True",
     "valid values: False"),
    ([f"{SEL}=forking_paper", f"{KNOB}score=grad_norm", "actor_rollout_ref.model.use_fused_kernels=true"],
     "use_fused_kernels=True", "valid values: False"),
]


@pytest.mark.parametrize("overrides,needle,valid", BAD_ROLLOUT, ids=[b[1] for b in BAD_ROLLOUT])
def test_rollout_config_errors_on_the_driver(overrides, needle, valid):
    from verl_tokensel.verl_glue.install import validate_driver_config

    with pytest.raises(Exception) as exc:
        validate_driver_config(_compose(overrides))
    msg = str(exc.value)
    assert needle in msg and valid in msg, msg


def test_rollout_config_accepts_and_prepares():
    from verl_tokensel.verl_glue.install import prepare_driver_config, validate_driver_config

    for extra in ([], [f"{KNOB}score=random", "algorithm.rollout_correction.bypass_mode=true"],
                  [f"{KNOB}score=ref_entropy", f"{KNOB}ref_model_path=/m", f"{KNOB}scope=group"]):
        validate_driver_config(_compose([f"{SEL}=forking_paper", *extra]))
    cfg = _compose([f"{SEL}=forking_paper", f"{KNOB}score=grad_norm"])
    prepare_driver_config(cfg)
    # the v0 old-log-prob pass computes sum p^2 on this switch; the update pass stays without entropy
    assert cfg.actor_rollout_ref.actor.calculate_sum_pi_squared is True
    assert cfg.actor_rollout_ref.actor.calculate_entropy is False
    cfg = _compose([f"{SEL}=forking_paper"])
    prepare_driver_config(cfg)
    assert cfg.actor_rollout_ref.actor.calculate_sum_pi_squared is False
