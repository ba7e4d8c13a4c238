"""Every preset's loss and gradient through verl's real FSDP2 and Megatron ``TrainingWorker`` on one fixed, seeded
batch (learning rate 0): the record that holds the rules' maths fixed across a redesign of the rule seam.

``golden_run`` (spawned with :func:`helpers.distributed.run_distributed`, world size 1) builds a Megatron and an FSDP2
worker from one tiny checkpoint, makes Archer's batch (:func:`helpers.megatron_rules.archer_batch`: old log-probs off
the policy so that both clip bounds clip, a reference log-prob for the KL loss) and runs each entry of :data:`RUNS`
once per engine. It returns per engine and run the step's loss and, for each parameter of
:data:`helpers.megatron_runs.SAME_PARAMS` (the LM head and the embedding), the gradient's sum, its sum of squares
and its dot products with :data:`N_PROJECTIONS` seeded random directions (a change anywhere in the gradient moves
them). ``forking_paper``'s driver mask (its ``score_source=rollout``) is the top ``ceil(0.2 N)`` old-pass entropies of
the batch, made here: the loss's use of a measured mask is what is recorded.

Re-record (only for a deliberate change of a rule's maths, saying which in the commit)::

    cd tests && python -m helpers.rules_golden    # writes tests/data/rules_golden.json
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from verl_tokensel_cpu import worker as H

from helpers.megatron_rules import ARCHER_ACTOR, WORKER_KW, archer_batch, median_old_prob
from helpers.megatron_runs import SAME_PARAMS

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "rules_golden.json"
N_PROJECTIONS = 4
#: the non-tensor key of the update pass (Lopti's 1 / 2) under each name the drivers have used for it
PASS_KEYS = ("tokensel_lopti_phase", "tokensel_update_pass")
#: run name -> (preset, token_selection knobs, update pass or None); ``eta`` stands for the batch's median
#: probability (Lopti's split in two halves on the tiny model)
RUNS = {
    "none": ("none", {}, None),
    "forking": ("forking", {}, None),
    "forking_paper": ("forking_paper", {}, None),
    "forking_bottom": ("forking_bottom", {}, None),
    "random": ("random", {}, None),
    "gmts": ("gmts", {}, None),
    "grad_norm": ("grad_norm", {}, None),
    "kl_cov_global": ("kl_cov_global", {"ratio": 0.05}, None),
    "clip_cov_global": ("clip_cov_global", {"ratio": 0.05, "cov_lb": -10.0}, None),
    "archer": ("archer", {}, None),
    "archer_kl_mean_all": ("archer", {"archer_kl_mean": "all"}, None),
    "ar": ("ar", {}, None),
    "lopti_1": ("lopti", {"lopti_eta": "eta"}, 1),
    "lopti_2": ("lopti", {"lopti_eta": "eta"}, 2),
    "ar_lopti_1": ("ar_lopti", {"lopti_eta": "eta"}, 1),
    "ar_lopti_2": ("ar_lopti", {"lopti_eta": "eta"}, 2),
    "entropy_adv": ("entropy_adv", {}, None),
    "stapo": ("stapo", {"stapo_prob": 0.05}, None),
}


def _driver_mask(batch) -> None:
    """``forking_paper``'s driver selection: the top ``ceil(0.2 N)`` old-pass entropies of the batch's N valid
    tokens, written as the measured mask and scores (nested like ``response_mask``)."""
    from verl_tokensel.core import fields

    ent = batch["entropy"].values().float()
    k = math.ceil(0.2 * ent.numel())
    mask = torch.zeros_like(ent, dtype=torch.bool)
    mask[torch.topk(ent, k).indices] = True
    offsets = batch["entropy"].offsets()
    rows = [mask[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    srows = [ent[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    batch[fields.MASK] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    batch[fields.SCORE] = torch.nested.as_nested_tensor(srows, layout=torch.jagged)


def _summary(grad: torch.Tensor) -> list[float]:
    g = grad.double().flatten()
    gen = torch.Generator().manual_seed(1234)
    dirs = torch.randn(N_PROJECTIONS, g.numel(), generator=gen, dtype=torch.float64)
    return [float(g.sum()), float((g * g).sum()), *[float(x) for x in dirs @ g]]


def one_run(actor, batch, preset: str, knobs: dict, phase) -> dict:
    from omegaconf import OmegaConf

    from verl.utils import tensordict_utils as tu

    from verl_tokensel.verl_glue.loss import SelectingLoss

    cfg = actor.cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for key, value in ARCHER_ACTOR.items():
        cfg.actor_rollout_ref.actor[key] = value
    eta = median_old_prob(batch)
    knobs = {k: (eta if v == "eta" else v) for k, v in knobs.items()}
    sel_cfg = H.selecting_actor_config(dataclasses.replace(actor, cfg=cfg), preset, calculate_entropy=True, **knobs)
    data = batch.copy()
    if preset == "forking_paper":
        _driver_mask(data)
    if phase is not None:
        tu.assign_non_tensor(data, **{k: phase for k in PASS_KEYS})
    r = H.run_train_step(actor, data, loss_fn=SelectingLoss(sel_cfg), capture_grads=True, capture_params=False)
    grads = {}
    for mname, fname in SAME_PARAMS.items():
        g = r.grads.get(mname, r.grads.get(fname))
        grads[fname] = _summary(g)
    return {"loss": float(r.loss), "grads": grads}


def golden_run(rank: int, world: int, model_dir: str) -> dict:
    out = {}
    megatron = H.make_training_worker(model_dir, engine="megatron", **WORKER_KW)
    batch = archer_batch(megatron)
    out["megatron"] = {name: one_run(megatron, batch, *spec) for name, spec in RUNS.items()}
    fsdp = H.make_training_worker(model_dir, engine="fsdp", **WORKER_KW)
    out["fsdp"] = {name: one_run(fsdp, batch, *spec) for name, spec in RUNS.items()}
    return out


def record(model_dir: str) -> dict:
    from helpers import distributed as D

    (out,) = D.run_distributed(golden_run, world_size=1, args=(model_dir,), timeout=900)
    return out


if __name__ == "__main__":  # pragma: no cover
    import sys
    import tempfile
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from verl_tokensel_cpu import tiny_model

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(tiny_model.build_tiny_model_dir(Path(tmp) / "qwen2", **tiny_model.MEGATRON_TINY_CONFIG))
        out = record(model_dir)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} in {time.time() - t0:.0f} s")
