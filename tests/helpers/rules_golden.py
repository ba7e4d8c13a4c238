"""Every preset's loss and gradient through verl's real FSDP2 and Megatron ``TrainingWorker`` on one fixed, seeded
batch (learning rate 0): the record that holds the rules' maths fixed across a redesign of the rule seam.

``golden_run`` (spawned with :func:`helpers.distributed.run_distributed`, world size 1) builds a Megatron and an FSDP2
worker from one tiny checkpoint, makes Archer's batch (:func:`helpers.megatron_rules.archer_batch`: old log-probs off
the policy so that both clip bounds clip, a reference log-prob for the KL loss, seeded ``rollout_log_probs``, which
``m2po_global`` reads) and the driver batch (:func:`driver_batch`) and runs each entry of :data:`RUNS` once per
engine, on the driver batch for :data:`GROUP_PRESETS` and on Archer's for the others. It returns per engine and run
the step's loss and, for each parameter of :data:`helpers.megatron_runs.SAME_PARAMS` (the LM head and the
embedding), the gradient's sum, its sum of squares and its dot products with :data:`N_PROJECTIONS` seeded random
directions (a change anywhere in the gradient moves them).

The measured fields of ``score_source=rollout``: ``forking_paper``'s driver mask is the top ``ceil(0.2 N)`` old-pass
entropies of the batch, made here (the loss's use of a measured mask is what is recorded); ``ktae``'s key-token
bonus and ``gtpo``'s conflict-weighted advantages are the driver's own selection
(:func:`verl_tokensel_cpu.batches.add_driver_selection`: ``select_on_driver`` on the batch's old pass, responses,
rewards, prompt groups and EOS), written as the measured mask and scores.

Re-record (only for a deliberate change of a rule's maths, saying which in the commit)::

    cd tests && python -m helpers.rules_golden    # writes tests/data/rules_golden.json
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from verl_tokensel_cpu import batches as B, worker as H

from helpers.megatron_rules import ARCHER_ACTOR, ARCHER_BATCH_KW, OLD_SHIFT, WORKER_KW, archer_batch, median_old_prob
from helpers.megatron_runs import SAME_PARAMS

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "rules_golden.json"
N_PROJECTIONS = 4
#: the non-tensor key of the update pass (Lopti's 1 / 2) under each name the drivers have used for it
PASS_KEYS = ("tokensel_lopti_phase", "tokensel_update_pass")
#: the driver batch's prompt groups (of ``ARCHER_BATCH_KW['n']`` responses) and the opening and closing tokens each
#: group's responses share
GROUP_SIZE = 4
SHARED_ENDS = 2
#: the presets scored on the driver from the whole prompt group: they run on :func:`driver_batch`
GROUP_PRESETS = ("ktae", "gtpo")
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
    "ce_gppo": ("ce_gppo", {}, None),
    "aspo": ("aspo", {}, None),
    "fipo": ("fipo", {}, None),
    "ktae": ("ktae", {}, None),
    # the tiny model's entropy is near log(vocabulary), above GTPO's 0.7 on every answer: the threshold is raised
    # so that the conflict weights act rather than the entropy filter dropping every response
    "gtpo": ("gtpo", {"gtpo_entropy_threshold": 100.0}, None),
    "m2po_global": ("m2po_global", {}, None),
    # added after the rule seam (the preset did not exist at 8b11462): recorded at f24a104, Megatron's passes included
    "delta": ("delta", {}, None),
    # added with the vocabulary seam, FSDP only (the Megatron engine refuses them); their old-log-prob pass runs under
    # the selecting loss (its reductions are kept on the worker). The tiny model is near uniform: kappa 0.5 keeps a
    # few sampled tokens in Lp-Reg's proxy, rho 0.3 passes its k > 1 gate on the batch
    "lp_reg": ("lp_reg", {"lp_reg_kappa": 0.5, "lp_reg_rho": 0.3}, None),
    "simko": ("simko", {"simko_quantile": 0.5, "simko_mix": 0.3}, None),
}
#: the runs only the FSDP engine has (rules with per-token reductions over the vocabulary)
FSDP_ONLY = ("lp_reg", "simko")


def _renest(xs):
    return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)


def driver_batch(actor):
    """The batch of the presets scored per prompt group on the driver (``ktae``, ``gtpo``): built as Archer's
    (:func:`helpers.megatron_rules.archer_batch`: its seed, length ranges and shifts) from GRPO groups of
    :data:`GROUP_SIZE` (one prompt, group-normalised advantages: both signs in each group), whose responses share the
    first response's :data:`SHARED_ENDS` opening and closing tokens (GTPO's conflict runs, KTAE's tokens in correct
    and wrong responses), then the engine's old pass, old log-probs moved off the policy and a reference log-prob."""
    batch = B.make_update_batch(actor, calculate_entropy=True, group_size=GROUP_SIZE, **ARCHER_BATCH_KW)
    responses = [r.clone() for r in batch["responses"].unbind(0)]
    for i, r in enumerate(responses):
        first = responses[i - i % GROUP_SIZE]
        r[:SHARED_ENDS] = first[:SHARED_ENDS]
        r[-SHARED_ENDS:] = first[-SHARED_ENDS:]
    ids = [torch.cat([x[:x.numel() - r.numel()], r]) for x, r in zip(batch["input_ids"].unbind(0), responses)]
    batch["responses"] = _renest(responses)
    batch["input_ids"] = _renest(ids)
    olp, _ = H.compute_old_log_probs(actor, batch)
    gen = torch.Generator().manual_seed(ARCHER_BATCH_KW["seed"])
    olp = olp.unbind(0)
    batch["old_log_probs"] = _renest(x + OLD_SHIFT * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    batch["ref_log_prob"] = _renest(x + 0.4 * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    return batch


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
    elif sel_cfg.selection is not None and sel_cfg.selection.score_source == "rollout":
        B.add_driver_selection(sel_cfg, data, eos_token_id=actor.tokenizer.eos_token_id)
    if phase is not None:
        tu.assign_non_tensor(data, **{k: phase for k in PASS_KEYS})
    loss = SelectingLoss(sel_cfg)
    if sel_cfg.selection is not None and sel_cfg.selection.impl.needs.vocab:
        actor.set_loss_fn(loss)  # the old pass under the rule: its vocabulary reductions, the batch's fields kept
        H.compute_old_log_probs(actor, data.copy(), write=False)
    r = H.run_train_step(actor, data, loss_fn=loss, capture_grads=True, capture_params=False)
    grads = {}
    for mname, fname in SAME_PARAMS.items():
        g = r.grads.get(mname, r.grads.get(fname))
        grads[fname] = _summary(g)
    return {"loss": float(r.loss), "grads": grads}


def golden_run(rank: int, world: int, model_dir: str) -> dict:
    out = {}
    megatron = H.make_training_worker(model_dir, engine="megatron", **WORKER_KW)
    batches = {False: archer_batch(megatron), True: driver_batch(megatron)}

    def runs(actor):
        skip = FSDP_ONLY if actor.engine_name == "megatron" else ()
        return {name: one_run(actor, batches[spec[0] in GROUP_PRESETS], *spec) for name, spec in RUNS.items()
                if name not in skip}

    out["megatron"] = runs(megatron)
    fsdp = H.make_training_worker(model_dir, engine="fsdp", **WORKER_KW)
    out["fsdp"] = runs(fsdp)
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
