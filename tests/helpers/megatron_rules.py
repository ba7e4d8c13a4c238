"""The token rules (``kl_cov_global``, ``clip_cov_global``, ``archer``) through verl's Megatron engine on the CPU test
bed, one spawned run per layout (use with :func:`helpers.distributed.run_distributed`)::

    (one,) = run_distributed(one_rank_run, world_size=1, args=(model_dir,))   # + FSDP2 for Archer's agreement
    two = run_distributed(dp_rank_run, world_size=2, args=(model_dir,))      # DP 2, half the mini-batch each

Learning rate 0, so every run of a layout sees the same weights. The covariance presets run one mini-batch of
:data:`BATCH_KW` per micro-batch setting of :data:`SPLITS` (set on the worker's engine config between runs, as
``tests/helpers/parity.py`` does: what ``TrainingWorker.train_batch`` hands the engine); old log-probs come from
the engine's own pass on the whole batch (on-policy: the PPO clip clips nothing). Each run returns the positions
the loss selected per response (keyed by the response's content, :func:`helpers.grad_probe.row_ids`), the valid
token count and the step's metrics. Archer runs on a batch whose old log-probs are moved off the policy (seeded)
so that both clip classes clip, with a reference log-prob for the KL loss (``use_kl_loss=true``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from verl_tokensel_cpu import batches as B, worker as H

from helpers import distributed as D
from helpers.grad_probe import row_ids
from helpers.megatron_runs import SAME_PARAMS

#: one worker per layout; the update's micro-batching is changed per run (SPLITS)
WORKER_KW = dict(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=56, lr=0.0,
                 clip_grad=1e9, use_dynamic_bsz=False, use_remove_padding=True)
BATCH_KW = dict(n=8, seed=3, resp_len=(4, 12))  # one mini-batch of 8 responses (DP 2: 4 per rank)
RATIO = 0.05
#: run name -> (preset, token_selection knobs); clip_cov: cov_lb -10 so that nearly every token is a candidate
COV_PRESETS = {"kl_cov_global": ("kl_cov_global", {"ratio": RATIO}),
               "clip_cov_global": ("clip_cov_global", {"ratio": RATIO, "cov_lb": -10.0})}
#: the contrast: KL-Cov pooled inside each micro-batch in the loss (verl's own kl_cov), which moves with the split
PER_MICRO_BATCH = ("kl_cov_global", {"ratio": RATIO, "scope": "micro_batch", "score_source": "current"})
#: name -> (use_dynamic_bsz, ppo_micro_batch_size_per_gpu, ppo_max_token_len_per_gpu) of the update, and
#: token_selection.prepass_reuse (True: the pre-pass reads the old pass's values; False: its own no-grad forward,
#: micro-batched as the update)
SPLITS = {"micro2": (False, 2, 56, True), "dynamic40": (True, 2, 40, True), "dynamic40_forward": (True, 2, 40, False)}
#: the splits of the data-parallel run
DP_SPLITS = ("micro2", "dynamic40_forward")
ARCHER_BATCH_KW = dict(n=8, seed=11, resp_len=(6, 16))
ARCHER_ACTOR = dict(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl", clip_ratio_c=10.0)
OLD_SHIFT = 1.2  # old log-probs moved by uniform(-0.6, 0.6): ratios in [0.55, 1.8], beyond both clip bounds


def _plain_metrics(metrics: dict) -> dict[str, list[float]]:
    out = {}
    for k, v in metrics.items():
        vals = v if isinstance(v, list) else [v]
        try:
            out[k] = [float(getattr(x, "value", x)) for x in vals]
        except (TypeError, ValueError):
            continue
    return out


def _set_split(actor, split: str) -> None:
    dyn, micro, max_tokens, _ = SPLITS[split]
    ec = actor.worker.engine_config
    ec.use_dynamic_bsz, ec.micro_batch_size_per_gpu, ec.max_token_len_per_gpu = dyn, micro, max_tokens


def _by_prepass(preset: str, knobs: dict) -> bool:
    from verl_tokensel.core.config import PRESETS

    return knobs.get("score_source", PRESETS[preset].score_source) == "prepass"


def _renest(xs):
    return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)


def cov_run(actor, run: tuple, split: str, world: int = 1, rank: int = 0) -> dict:
    """``run`` (a ``(preset, knobs)`` pair) on this rank's part of one mini-batch, the update split as
    ``SPLITS[split]``."""
    from verl_tokensel.verl_glue.loss import SelectingLoss

    preset, knobs = run
    if _by_prepass(preset, knobs):
        knobs = {**knobs, "prepass_reuse": SPLITS[split][3]}
    cfg = H.selecting_actor_config(actor, preset, **knobs)
    full = B.make_update_batch(actor, **BATCH_KW)
    H.compute_old_log_probs(actor, full)  # the whole batch on every rank: what the driver holds
    shard = D.split_for_dp(full, world)[rank] if world > 1 else full
    _set_split(actor, split)
    picks: dict = {}
    micro_rows: list[int] = []
    n_valid = 0

    def observe(rec):
        nonlocal n_valid
        micro_rows.append(int(rec["response_mask"].shape[0]))
        for k, row in enumerate(row_ids(rec["data"])):
            n = int(rec["response_mask"][k].sum())
            picks[row] = tuple(rec["mask"][k, :n].nonzero().flatten().tolist())
            n_valid += n

    try:
        r = H.run_train_step(actor, shard, loss_fn=SelectingLoss(cfg, observer=observe), capture_grads=False,
                             capture_params=False)
    finally:
        _set_split(actor, "micro2")
    return dict(picks=picks, n_valid=n_valid, micro_rows=micro_rows, loss=r.loss, metrics=_plain_metrics(r.metrics))


def archer_batch(actor):
    """Archer's update batch: the engine's old pass, old log-probs moved off the policy, a reference log-prob."""
    batch = B.make_update_batch(actor, calculate_entropy=True, **ARCHER_BATCH_KW)
    olp, _ = H.compute_old_log_probs(actor, batch)
    gen = torch.Generator().manual_seed(ARCHER_BATCH_KW["seed"])
    olp = olp.unbind(0)
    batch["old_log_probs"] = _renest(x + OLD_SHIFT * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    batch["ref_log_prob"] = _renest(x + 0.4 * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    batch["rollout_log_probs"] = _renest(x + 1.0 * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    return batch


#: part 2 of the toolbox on the Archer batch: run name -> (preset, token_selection knobs, Lopti pass or None)
REWEIGHT_RUNS = {"ar": ("ar", {}, None), "entropy_adv": ("entropy_adv", {}, None),
                 "lopti_1": ("lopti", {}, 1), "lopti_2": ("ar_lopti", {}, 2),
                 # the test bed's tiny model puts most probabilities near 1 / vocabulary: tau_p 0.05 gives STAPO
                 # candidates in every positive answer
                 "stapo": ("stapo", {"stapo_prob": 0.05}, None),
                 "ce_gppo": ("ce_gppo", {}, None), "aspo": ("aspo", {}, None),
                 # the driver's rules: the tiny model's entropy is near log(vocabulary), above GTPO's 0.7 on every
                 # answer, so the threshold is raised for the conflict weights to act
                 "ktae": ("ktae", {}, None), "gtpo": ("gtpo", {"gtpo_entropy_threshold": 100.0}, None),
                 "fipo": ("fipo", {}, None),
                 "m2po_global": ("m2po_global", {}, None)}


def rule_run(actor, batch, preset: str = "archer", actor_kw: dict | None = None, knobs: dict | None = None,
             phase: int | None = None) -> dict:
    """``preset`` (with ``actor_kw`` on the actor and ``knobs`` on ``token_selection``; a Lopti pass number
    ``phase``) on ``batch`` (a copy is consumed): per response its mask and scores, the loss, the metrics and the
    gradients of :data:`SAME_PARAMS`. ``preset=None``: the stock loss."""
    from omegaconf import OmegaConf

    from verl.utils import tensordict_utils as tu

    from verl_tokensel.core.fields import UPDATE_PASS
    from verl_tokensel.verl_glue.loss import SelectingLoss

    cfg = actor.cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for key, value in (ARCHER_ACTOR if actor_kw is None else actor_kw).items():
        cfg.actor_rollout_ref.actor[key] = value
    sel_cfg = H.selecting_actor_config(dataclasses.replace(actor, cfg=cfg), preset or "none", **(knobs or {}))
    masks, entropy = {}, {}

    def observe(rec):
        for k, row in enumerate(row_ids(rec["data"])):
            n = int(rec["response_mask"][k].sum())
            masks[row] = rec["mask"][k, :n].clone()
            entropy[row] = rec["scores"][k, :n].detach().clone()

    data = batch.copy()
    if phase is not None:
        tu.assign_non_tensor(data, **{UPDATE_PASS: phase})
    if preset and sel_cfg.selection.score_source == "rollout":  # what the driver adds: from this engine's old pass
        if "entropy" not in data.keys():
            data["entropy"] = H.compute_old_log_probs(actor, data, write=False)[1]
        B.add_driver_selection(sel_cfg, data, eos_token_id=actor.tokenizer.eos_token_id)
    loss_fn = SelectingLoss(sel_cfg, observer=observe) if preset else SelectingLoss(sel_cfg)
    r = H.run_train_step(actor, data, loss_fn=loss_fn, capture_grads=True, capture_params=False)
    grads = {k: v for k, v in r.grads.items() if k in SAME_PARAMS or k in SAME_PARAMS.values()}
    return dict(masks=masks, entropy=entropy, loss=r.loss, metrics=_plain_metrics(r.metrics), grads=grads)


def archer_run(actor, batch) -> dict:
    """``archer`` with ``use_kl_loss`` on ``batch``: :func:`rule_run`."""
    return rule_run(actor, batch)


def with_response_mask(batch, masks: dict):
    """A copy of ``batch`` whose response (and loss) mask is ``masks[row]`` per response (STAPO's kept tokens): what
    stock verl's loss over the kept tokens only sees."""
    data = batch.copy()
    rm = data["response_mask"]
    rows = [masks[r].to(rm.dtype) for r in row_ids(data)]
    data["response_mask"] = _renest(rows)
    data["loss_mask"] = _renest(rows)
    return data


def median_old_prob(batch) -> float:
    """The median old probability of the batch's tokens: Lopti's eta that splits them in two halves (the tiny random
    model puts every probability under the paper's 0.5)."""
    return float(torch.exp(batch["old_log_probs"].values()).median())


def reweight_runs(actor, batch) -> dict:
    """Every run of :data:`REWEIGHT_RUNS` on ``batch`` (Lopti's eta: :func:`median_old_prob`), then the stock loss
    over STAPO's kept tokens."""
    eta = {"lopti_eta": median_old_prob(batch)}
    out = {name: rule_run(actor, batch, preset, {}, {**knobs, **(eta if phase else {})}, phase)
           for name, (preset, knobs, phase) in REWEIGHT_RUNS.items()}
    out["stock_over_kept"] = rule_run(actor, with_response_mask(batch, out["stapo"]["masks"]), None, {})
    return out


def one_rank_run(rank: int, world: int, model_dir: str) -> dict:
    """One process: both covariance presets (and :data:`PER_MICRO_BATCH`) at every split of :data:`SPLITS` and
    Archer on one Megatron worker, then Archer on an FSDP2 worker from the same checkpoint, on the very same batch."""
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 2)

    megatron = H.make_training_worker(model_dir, engine="megatron", **WORKER_KW)
    seconds = {"megatron_build": lap()}
    out = {"cov": {(name, s): cov_run(megatron, run, s) for name, run in COV_PRESETS.items() for s in SPLITS},
           "per_micro_batch": {s: cov_run(megatron, PER_MICRO_BATCH, s) for s in SPLITS}}
    seconds["cov_runs"] = lap()
    batch = archer_batch(megatron)
    out["archer"] = {"megatron": archer_run(megatron, batch)}
    seconds["archer_megatron"] = lap()
    fsdp = H.make_training_worker(model_dir, engine="fsdp", **WORKER_KW)
    seconds["fsdp_build"] = lap()
    out["archer"]["fsdp"] = archer_run(fsdp, batch)
    seconds["archer_fsdp"] = lap()
    out["reweight"] = {"megatron": reweight_runs(megatron, batch), "fsdp": reweight_runs(fsdp, batch)}
    seconds["reweight_both"] = lap()
    out["seconds"] = seconds
    return out


def dp_rank_run(rank: int, world: int, model_dir: str) -> dict:
    """One of ``world`` data-parallel Megatron ranks: both covariance presets on its part of the mini-batch."""
    actor = H.make_training_worker(model_dir, engine="megatron", rank=rank, world_size=world, **WORKER_KW)
    return {"cov": {(name, s): cov_run(actor, run, s, world, rank) for name, run in COV_PRESETS.items()
                    for s in DP_SPLITS}}
