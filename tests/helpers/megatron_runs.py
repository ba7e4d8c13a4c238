"""One rank of a Megatron-engine run on the CPU test bed: every preset through one real ``TrainingWorker``.

Use with :func:`helpers.distributed.run_distributed` (spawned gloo ranks; Megatron's parallel state is
per process, so each layout gets its own processes)::

    run = run_distributed(megatron_rank_run, world_size=2, args=(model_dir, tp, pp, dyn, rmpad))

Each rank returns, per preset, what the loss saw per micro-batch (mask, rows, the log-prob gradient),
the logits' gradient norms per response token, what the pre-pass wrote per mini-batch, the driver's mask
per row (``forking_paper``), the per-token values the hidden-state passes wrote per row (``delta``, with and
without its cache: :data:`HIDDEN_PRESETS`) and, for ``none``, the loss and every parameter gradient next to stock
verl's.
"""

from __future__ import annotations

import time

import torch

from verl_tokensel_cpu import batches as B, worker as H

from helpers import distributed as D
from helpers.grad_probe import (capture_logit_grads, padded_response_field, prompt_lengths, response_lengths, row_ids,
                                token_grad_norms)

#: the same parameter in both engines (Megatron's name after the chunk index, HF's)
SAME_PARAMS = {"0.module.output_layer.weight": "lm_head.weight",
               "0.module.embedding.word_embeddings.weight": "model.embed_tokens.weight"}


def assert_grads_agree(megatron_grads: dict, fsdp_grads: dict, label: str) -> None:
    """The gradients of :data:`SAME_PARAMS` in both engines agree (rtol 1e-4 / atol 1e-6), each non-zero; prints
    the largest difference."""
    for mname, fname in SAME_PARAMS.items():
        gm, gf = megatron_grads[mname], fsdp_grads[fname]
        assert gm.shape == gf.shape and gf.abs().max() > 0
        print(f"{label} {fname}: max |megatron - fsdp| = {float((gm - gf).abs().max()):.2e}, "
              f"max |fsdp| = {float(gf.abs().max()):.2e}")
        torch.testing.assert_close(gm, gf, rtol=1e-4, atol=1e-6)


PRESETS = ["none", "forking", "forking_bottom", "random", "grad_norm", "forking_paper", "gmts", "gmts_mini_batch",
           "delta", "delta_cached"]
#: runs that are a preset with knobs: name -> (preset, token_selection knobs)
VARIANTS = {"gmts_mini_batch": ("gmts", {"scope": "mini_batch"}), "delta_cached": ("delta", {"delta_cache_gib": 0.5})}
#: the runs whose rule reads the last hidden states: the per-token values their passes wrote are kept
HIDDEN_PRESETS = ("delta", "delta_cached")
N = 12  # responses per update: 3 prompts x 4 responses, two mini-batches of 6 (DP 2: the middle prompt split 2 + 2)
BATCH_KW = dict(n=N, seed=5, resp_len=(3, 10), group_size=4)
WORKER_KW = dict(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=48,
                 lr=0.0, clip_grad=1e9)
#: gmts at group scope runs the whole batch as one mini-batch, so that a prompt group straddles the DP ranks
ONE_MINI_BATCH = ("gmts",)


def pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _plain_metrics(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        if k.startswith("tokensel/") or k in ("loss", "grad_norm"):
            vals = v if isinstance(v, list) else [v]
            out[k] = [float(getattr(x, "value", x)) for x in vals]
    return out


def _one_preset(actor, preset: str, tp: int, stock: bool = False) -> dict:
    from megatron.core import parallel_state as mpu

    from verl_tokensel.core import fields
    from verl_tokensel.verl_glue.loss import MASK_FIELD, SCORE_FIELD, SelectingLoss

    from verl.utils import tensordict_utils as tu

    name, knobs = VARIANTS.get(preset, (preset, {}))
    cfg = H.selecting_actor_config(actor, name, **knobs)
    full = B.make_update_batch(actor, calculate_entropy=bool(cfg.calculate_entropy), **BATCH_KW)
    if preset in ONE_MINI_BATCH:
        tu.assign_non_tensor(full, mini_batch_size=N, global_batch_size=N)
    olp, ent = H.compute_old_log_probs(actor, full)  # every rank, the whole batch: what the driver holds
    out: dict = {"micro": [], "minibatches": [], "logit_norms": []}
    if stock:
        out["old"] = {row: (lp.clone(), e.clone()) for row, lp, e in zip(row_ids(full), olp.unbind(0), ent.unbind(0))}
    if preset == "forking_paper":
        B.add_driver_selection(cfg, full)
        out["driver_mask_by_row"] = {row: m.bool().clone() for row, m in
                                     zip(row_ids(full), full[MASK_FIELD].unbind(0))}
    shard = D.split_for_dp(full, mpu.get_data_parallel_world_size())[mpu.get_data_parallel_rank()]
    out["rows_on_rank"] = int(shard.batch_size[0])

    def observe(rec):
        d = rec["data"]
        slot = dict(mask=rec["mask"].clone(), response_mask=rec["response_mask"].clone(), rows=row_ids(d),
                    prompt_lens=prompt_lengths(d), resp_lens=response_lengths(d))
        rec["log_prob"].register_hook(lambda g, slot=slot: slot.__setitem__("log_prob_grad", g.detach().clone()))
        out["micro"].append(slot)

    inner = actor.worker.train_batch  # the pre-pass wrap (install_prepass) around verl's train_batch

    def spy(data, *args, **kwargs):
        result = inner(data, *args, **kwargs)
        if MASK_FIELD in data.keys() and name == "gmts":
            lens = response_lengths(data)
            out["minibatches"].append(dict(uids=[str(u) for u in data.get("uid").tolist()], resp_lens=lens,
                                           mask=padded_response_field(data[MASK_FIELD], lens).bool(),
                                           scores=padded_response_field(data[SCORE_FIELD], lens)))
        return result

    actor.worker.train_batch = spy
    data = shard.copy()
    try:
        with capture_logit_grads(actor) as logit_grads:
            r = H.run_train_step(actor, data, loss_fn=SelectingLoss(cfg, observer=observe),
                                 capture_grads=stock, capture_params=False)
    finally:
        actor.worker.train_batch = inner
    if preset in HIDDEN_PRESETS:  # the values the passes wrote into this rank's share, per row
        out["weights"] = {row: w.clone() for row, w in zip(row_ids(data), data[fields.HIDDEN].unbind(0))}
    if out["micro"]:
        out["logit_norms"] = token_grad_norms(logit_grads, out["micro"], actor.use_remove_padding, align=tp)
    out["metrics"] = _plain_metrics(r.metrics)
    out["loss"] = r.loss
    if stock:  # the same shard through stock verl's ppo_loss, weights unchanged (lr 0)
        s = H.run_train_step(actor, shard.copy(), loss_fn=H.default_loss_fn(actor.actor_config),
                             capture_grads=True, capture_params=False)
        out["stock_loss"] = s.loss
        out["grads"] = {f"{i}:{k}": v for i, g in enumerate(r.grads_per_step) for k, v in g.items()}
        out["stock_grads"] = {f"{i}:{k}": v for i, g in enumerate(s.grads_per_step) for k, v in g.items()}
    return out


def megatron_rank_run(rank: int, world: int, model_dir: str, tp: int, pp: int, dyn: bool, rmpad: bool,
                      dtype: str = "fp32") -> dict:
    """Every preset of :data:`PRESETS` through this rank's Megatron ``TrainingWorker`` (lr 0)."""
    from megatron.core import parallel_state as mpu

    actor = H.make_training_worker(model_dir, engine="megatron", rank=rank, world_size=world, tensor_parallel=tp,
                                   pipeline_parallel=pp, use_dynamic_bsz=dyn, use_remove_padding=rmpad, dtype=dtype,
                                   **WORKER_KW)
    presets = {}
    for p in PRESETS:
        t0 = time.perf_counter()
        presets[p] = _one_preset(actor, p, tp, stock=(p == "none"))
        presets[p]["seconds"] = time.perf_counter() - t0
    # verl's TrainingWorker returns the step's metrics on the model-parallel source rank only
    out = {"rank": rank, "runs_loss": mpu.is_pipeline_last_stage(), "presets": presets,
           "returns_metrics": actor.engine.is_mp_src_rank_with_outputs()}
    if tp > 1:
        out["sequence_parallel"] = sequence_parallel_layouts(actor)
    return out


def sequence_parallel_layouts(actor, hidden: int = 4) -> dict:
    """The glue's unpacking of an output-layer input sharded along the sequence over the tensor-parallel ranks
    (Megatron's sequence parallelism, which this CPU test bed cannot run in a model: mbridge's norm then fails): a
    known ``[s, b, H]`` tensor, this rank's slice, a layer flagged ``sequence_parallel``, through
    :func:`~verl_tokensel.verl_glue.hidden.packed_hidden` in the ``thd`` and ``bshd`` layouts verl's preprocessing
    gives (padded for the TP size). Returns per layout what the shard gives, what the whole tensor gives, and the
    rows by hand."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as mpu
    from tensordict import TensorDict

    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    from verl_tokensel.verl_glue.hidden import packed_hidden

    lengths = [5, 3, 7]
    ids = torch.nested.as_nested_tensor([torch.arange(n) + 1 for n in lengths], layout=torch.jagged)
    micro_batch = TensorDict({"input_ids": ids}, batch_size=[len(lengths)])
    tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    _, packed, _ = preprocess_thd_engine(ids, pre_process=True)
    _, mask, _ = preprocess_bshd_engine(ids, pre_process=True)
    starts = packed.cu_seqlens_q_padded.tolist()
    out = {}
    for name, shape, call in (("thd", (starts[-1], 1, hidden), {"packed_seq_params": packed}),
                              ("bshd", (mask.shape[1], len(lengths), hidden), {"attention_mask": mask})):
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
        shard = full.chunk(tp, dim=0)[r]  # [s / tp, b, H]: this rank's slice of the sequence
        if name == "thd":
            by_hand = torch.cat([full[s:s + n, 0] for s, n in zip(starts, lengths)])
        else:
            by_hand = torch.cat([full[:n, i] for i, n in enumerate(lengths)])
        out[name] = dict(
            shard=packed_hidden(actor.engine, shard, micro_batch, call=call,
                                layer=SimpleNamespace(sequence_parallel=True)),
            whole=packed_hidden(actor.engine, full, micro_batch, call=call,
                                layer=SimpleNamespace(sequence_parallel=False)),
            by_hand=by_hand)
    return out


def megatron_checkpoint_round_trip(rank: int, world: int, model_dir: str, ckpt_dir: str) -> dict:
    """One update, ``engine.save_checkpoint`` (verl's Megatron checkpoint manager: HF weights through mbridge, the
    distributed optimizer through Megatron's dist checkpointing), then a FRESH engine that loads it, as a resumed
    run does. Returns the max differences of the weights and of Adam's moments, and both optimizers' steps."""
    kw = dict(engine="megatron", rank=rank, world_size=world, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    actor = H.make_training_worker(model_dir, **kw)
    batch = B.make_update_batch(actor, n=4, seed=0)
    H.compute_old_log_probs(actor, batch)
    H.run_train_step(actor, batch, capture_params=False)
    actor.engine.save_checkpoint(ckpt_dir, global_step=1)
    fresh = H.make_training_worker(model_dir, **kw)
    fresh.engine.load_checkpoint(ckpt_dir, del_local_after_load=False)

    def adam(a):
        opt = a.engine.optimizer
        return getattr(opt, "chained_optimizers", [opt])[0].optimizer.state

    saved, loaded = adam(actor), adam(fresh)
    w0, w1 = H.full_params(actor), H.full_params(fresh)
    out = {"weights": max((w0[k] - w1[k]).abs().max().item() for k in w0),
           "moments": max((s[m] - t[m]).abs().max().item() for s, t in zip(saved.values(), loaded.values())
                          for m in ("exp_avg", "exp_avg_sq")),
           "moment_size": max(s["exp_avg"].abs().max().item() for s in saved.values()),
           "states": (len(saved), len(loaded)),
           "steps": ({s["step"].item() for s in saved.values()}, {s["step"].item() for s in loaded.values()})}
    for a in (actor, fresh):  # the same second update on both: the resumed engine must move as the original does
        batch = B.make_update_batch(a, n=4, seed=1)
        H.compute_old_log_probs(a, batch)
        H.run_train_step(a, batch, capture_params=False)
    w2, w3 = H.full_params(actor), H.full_params(fresh)
    out["second_step"] = max((w2[k] - w0[k]).abs().max().item() for k in w0)
    out["second_step_apart"] = {k: (w2[k] - w3[k]).abs().max().item() for k in w0}
    return out
