"""The stock-parity matrix: a seeded pairwise design over the actor settings users vary, each combination run
through stock verl (``ppo_loss``) and every preset on one real ``TrainingWorker`` (:mod:`verl_tokensel_cpu.worker`).

:func:`pairwise` is a greedy all-pairs generator (seeded, deterministic): every pair of levels of any two factors
appears in at least one row. :func:`run_rows` runs rows on one worker (one rank of it under data parallelism): the
worker's engine settings (micro-batch sizes, dynamic batch size and its token limits) are set on
``worker.engine_config`` (the object ``TrainingWorker.train_batch`` / ``infer_batch`` read at every call, which
``ActorRolloutRefWorker.init_model`` fills from the actor node), the rest (mini-batch, epochs, ``rollout.n``, loss
settings) go to the actor node the loss is bound to and to the driver meta of the batch, so one worker build
serves every row with the same ``use_remove_padding`` and DP size. :func:`render_markdown` writes the table.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import traceback
from typing import Optional

import torch

#: factor -> levels. ``log_prob_micro`` is relative to one mini-batch's rows per rank (smaller, equal, larger);
#: ``dyn`` is use_dynamic_bsz with its token limit per rank (sequences here are at most 18 tokens long).
FACTORS: dict[str, list] = {
    "dp": [1, 2],
    "rmpad": [True, False],
    "mini": [2, 3, 4],
    "rollout_n": [1, 2, 4],
    "micro": [1, 2, 8],
    "log_prob_micro": ["lt", "eq", "gt"],
    "dyn": ["off", "tight", "loose"],
    "epochs": [1, 2],
    "mini_batches": [1, 2],
    "loss_agg_mode": ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    "clip_ratio_c": [3.0, 1.5],
    "kl_loss": [False, True],
    "entropy_coeff": [0.0, 0.01],
}
#: ``policy_loss.loss_mode``, a factor whose every level appears at least once (not in every pair: 12 levels would
#: quadruple the design): the first rows of the pairwise design take verl 0.9.1's losses in turn, the others vanilla
LOSS_MODES = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
              "bypass_mode"]
#: the settings a loss needs (verl 0.9.1): DRO's beta, required positive ("policy_loss.dro_beta must be a positive
#: value when using DRO"); bypass mode's rollout correction as verl's RolloutCorrectionConfig.bypass_pg_is() sets it
#: (REINFORCE with sequence-level IS, the pair whose sequence weight reads the mask)
LOSS_SETTINGS = {
    "dro": {"dro_beta": 0.1},
    "bypass_mode": {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": None,
                                           "bypass_mode": True, "loss_type": "reinforce"}},
}
DYN_TOKENS = {"off": 64, "tight": 24, "loose": 96}
SEED = 20261202
PRESETS = ["forking", "forking_paper", "forking_bottom", "random", "gmts", "grad_norm", "kl_cov_global",
           "clip_cov_global", "archer", "ar", "entropy_adv", "ar_lopti", "stapo", "ce_gppo", "aspo", "ktae", "gtpo",
           "fipo", "m2po_global", "delta", "lp_reg", "simko"]
#: the Lopti pass each row's ``ar_lopti`` update runs as (the driver's second call differs only in the pass number)
LOPTI_PHASE = 1
#: a row every loss refuses (verl's dual-clip assert, clip_ratio_c must exceed 1): the matrix checks refusals too
REFUSAL_PROBE = {"dp": 1, "rmpad": True, "mini": 2, "rollout_n": 2, "micro": 2, "log_prob_micro": "eq", "dyn": "off",
                 "epochs": 1, "mini_batches": 1, "loss_agg_mode": "token-mean", "clip_ratio_c": 1.0, "kl_loss": False,
                 "entropy_coeff": 0.0, "loss_mode": "vanilla"}


def pairwise(factors: dict[str, list], seed: int = SEED, candidates: int = 30) -> list[dict]:
    """Rows (factor -> level) covering every pair of levels of every two factors at least once.

    Greedy (AETG-style): each new row is the best of ``candidates`` rows, each built factor by factor in a random
    order, a level picked to cover the most uncovered pairs with the levels already chosen (ties: random).
    Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in range(len(factors[a])) for y in range(len(factors[b]))}

    def pairs_of(row: dict) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2) if a in row and b in row}

    rows: list[dict] = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(candidates):
            # start from an uncovered pair so that every row makes progress
            (a, x), (b, y) = sorted(uncovered)[rng.randrange(len(uncovered))]
            row = {a: x, b: y}
            order = [n for n in names if n not in row]
            rng.shuffle(order)
            for name in order:
                gains = []
                for level in range(len(factors[name])):
                    gain = sum(1 for other, v in row.items()
                               if (tuple(sorted([(name, level), (other, v)], key=lambda p: names.index(p[0])))
                                   in uncovered))
                    gains.append((gain, rng.random(), level))
                row[name] = max(gains)[2]
            gain = len(pairs_of(row) & uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        uncovered -= pairs_of(best)
        rows.append({n: factors[n][best[n]] for n in names})
    return rows


def combo_id(row: dict) -> str:
    engine = "megatron-" if row.get("engine") == "megatron" else ""
    short = {"token-mean": "tm", "seq-mean-token-sum": "smts", "seq-mean-token-mean": "smtm",
             "seq-mean-token-sum-norm": "smtsn"}
    return (f"{engine}dp{row['dp']}-rmpad{int(row['rmpad'])}-mini{row['mini']}x{row['mini_batches']}"
            f"-n{row['rollout_n']}"
            f"-micro{row['micro']}-lp{row['log_prob_micro']}-dyn{row['dyn']}-ep{row['epochs']}"
            f"-{short[row['loss_agg_mode']]}-c{row['clip_ratio_c']}-kl{int(row['kl_loss'])}-ent{row['entropy_coeff']}"
            + ("" if row.get("loss_mode", "vanilla") == "vanilla" else f"-{row['loss_mode']}"))


def with_loss_modes(rows: list[dict]) -> list[dict]:
    """``rows`` with a ``loss_mode`` each: the first ``len(LOSS_MODES)`` take every loss in turn, the rest vanilla."""
    return [{**r, "loss_mode": LOSS_MODES[i] if i < len(LOSS_MODES) else "vanilla"} for i, r in enumerate(rows)]


def matrix(seed: int = SEED) -> list[dict]:
    """The full matrix: the pairwise rows with their loss_mode, then the refusal probe."""
    return [*with_loss_modes(pairwise(FACTORS, seed)), dict(REFUSAL_PROBE)]


def megatron_rows(rows: list[dict], n: int = 3) -> list[dict]:
    """A few one-process rows again on verl's Megatron engine (``engine="megatron"``, the CPU test bed): the
    default slice's picks among the packed (``use_remove_padding``) rows."""
    picks = [r for r in default_slice(rows) if r["rmpad"] and r != REFUSAL_PROBE][:n]
    return [{**r, "engine": "megatron"} for r in picks]


def default_slice(rows: list[dict], per_worker: int = 3) -> list[dict]:
    """The default suite's fixed subset: ``per_worker`` one-process rows for each ``use_remove_padding`` (two
    worker builds), each picked to add the most levels not yet in the subset, and the refusal probe."""
    out: list[dict] = []
    for rmpad in (True, False):
        pool = [r for r in rows if r["dp"] == 1 and r["rmpad"] == rmpad and r != REFUSAL_PROBE]
        for _ in range(min(per_worker, len(pool))):
            seen = {(k, v) for r in out for k, v in r.items()}
            best = max(pool, key=lambda r: (len(set(r.items()) - seen), -pool.index(r)))
            pool.remove(best)
            out.append(best)
    return [*out, REFUSAL_PROBE]


# --------------------------------------------------------------------------------------------------------------
# one row on one worker
# --------------------------------------------------------------------------------------------------------------


def _rows_per_rank(row: dict) -> int:
    return row["mini"] * row["rollout_n"] // row["dp"] if row["dp"] else 0


def _log_prob_micro(row: dict) -> int:
    per_rank = max(1, _rows_per_rank(row))
    return {"lt": max(1, per_rank // 2), "eq": per_rank, "gt": 2 * per_rank}[row["log_prob_micro"]]


def expected_config_refusal(preset: str, row: dict) -> Optional[tuple[str, ...]]:
    """The keys our validation must name when ``preset`` cannot serve ``row`` (None: it must run), in the order the
    validation checks them: a rule with its own policy loss and a score that reads omega take only vanilla
    (``policy_loss.loss_mode``), and a loss without a token-mean (sapo, geo_mean) only ``normaliser=all``."""
    from verl_tokensel.core.config import PRESETS as ALL
    from verl_tokensel.core.seam.loss_modes import loss_mode
    from verl_tokensel.core.seam.rule import OWN_LOSS_MODES
    from verl_tokensel.core.ranking.scores import SCORE_REGISTRY

    sel = ALL[preset]
    mode = row.get("loss_mode", "vanilla")
    if sel.normaliser == "selected" and row["loss_agg_mode"] != "token-mean":
        return ("token_selection.normaliser", "loss_agg_mode")
    if sel.impl.needs.policy_loss and mode not in OWN_LOSS_MODES:
        return ("policy_loss.loss_mode",)
    if not sel.impl.needs.policy_loss and sel.normaliser not in loss_mode(mode).normalisers:
        return ("policy_loss.loss_mode",)
    if SCORE_REGISTRY[sel.score].needs_omega and mode != "vanilla":
        return ("policy_loss.loss_mode",)
    if sel.rule == "archer" and sel.knobs.selected_kl_weight != 1.0 and not row["kl_loss"]:
        return ("use_kl_loss",)  # archer weights the KL loss per token
    return None


def runs_where_stock_refuses(preset: str, row: dict, stock: dict) -> bool:
    """Whether ``preset`` must run although stock refused ``row``: stock's refusal is verl's dual-clip assert
    (``clip_ratio_c <= 1``) and the preset's loss has no dual clip (KL-Cov's and Clip-Cov's, as verl's own
    ``loss_mode=kl_cov`` / ``clip_cov``, which run there too; Lp-Reg's and SimKO's, as released)."""
    from verl_tokensel.core.config import PRESETS as ALL

    return (ALL[preset].rule in ("kl_cov", "clip_cov", "lp_reg", "simko") and row["clip_ratio_c"] <= 1.0
            and stock.get("stage") == "update" and stock.get("error") == "AssertionError")


def _actor_view(actor, row: dict):
    """The actor with ``row``'s actor node (for the loss config and the driver meta); sets the engine settings."""
    from omegaconf import OmegaConf

    ec = actor.worker.engine_config
    ec.use_dynamic_bsz = row["dyn"] != "off"
    ec.max_token_len_per_gpu = ec.infer_max_token_len_per_gpu = DYN_TOKENS[row["dyn"]]
    ec.micro_batch_size_per_gpu = row["micro"]
    ec.infer_micro_batch_size_per_gpu = _log_prob_micro(row)
    cfg = actor.cfg.copy()
    OmegaConf.set_struct(cfg, False)
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    a.use_dynamic_bsz = r.log_prob_use_dynamic_bsz = row["dyn"] != "off"
    a.ppo_max_token_len_per_gpu = r.log_prob_max_token_len_per_gpu = DYN_TOKENS[row["dyn"]]
    a.ppo_micro_batch_size_per_gpu = row["micro"]
    r.log_prob_micro_batch_size_per_gpu = _log_prob_micro(row)
    a.ppo_mini_batch_size = row["mini"]
    r.n = row["rollout_n"]
    a.ppo_epochs = row["epochs"]
    a.loss_agg_mode = row["loss_agg_mode"]
    a.clip_ratio_c = row["clip_ratio_c"]
    a.use_kl_loss = row["kl_loss"]
    a.kl_loss_coef = 0.1
    a.kl_loss_type = "low_var_kl"
    a.entropy_coeff = row["entropy_coeff"]
    mode = row.get("loss_mode", "vanilla")
    a.policy_loss.loss_mode = mode
    for k, v in LOSS_SETTINGS.get(mode, {}).items():
        a.policy_loss[k] = v
    return dataclasses.replace(actor, cfg=cfg)


def _stock_config(view):
    from verl.utils.config import omega_conf_to_dataclass

    c = omega_conf_to_dataclass(view.cfg.actor_rollout_ref.actor)
    c.model_config = view.model_config
    return c


def _renest(xs):
    return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)


def _full_batch(view, row: dict, seed: int):
    """The driver's batch: the real old-log-prob pass (with the log-prob micro-batching), old log-probs moved off
    the current policy (seeded) so that clipping and dual-clip act, and a reference log-prob for the KL loss."""
    from verl_tokensel_cpu import batches as B, worker as H

    n = row["mini"] * row["rollout_n"] * row["mini_batches"]
    batch = B.make_update_batch(view, n=n, seed=seed, resp_len=(2, 10), group_size=row["rollout_n"])
    H.compute_old_log_probs(view, batch)
    gen = torch.Generator().manual_seed(seed)
    olp = batch["old_log_probs"].unbind(0)
    batch["old_log_probs"] = _renest(x + 0.6 * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    if row["kl_loss"]:
        batch["ref_log_prob"] = _renest(x + 0.4 * (torch.rand(x.shape, generator=gen) - 0.5) for x in olp)
    roll = torch.Generator().manual_seed(seed + 1)  # the rollout engine's log-probs (M2PO's behaviour policy)
    batch["rollout_log_probs"] = _renest(x + 1.0 * (torch.rand(x.shape, generator=roll) - 0.5) for x in olp)
    return batch


def _shard(batch, row: dict, rank: int):
    if row["dp"] == 1:
        return batch
    from helpers.distributed import split_for_dp

    return split_for_dp(batch, row["dp"])[rank]


def _error(e: BaseException, stage: str) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"status": "refused", "stage": stage, "error": type(e).__name__, "message": str(e)[:400],
            "traceback_tail": "".join(tb)[-1500:]}


def _config_error(e: BaseException):
    from verl_tokensel.core.config import TokenSelectionConfigError

    while e is not None:
        if isinstance(e, TokenSelectionConfigError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _plain(v) -> list[float]:
    vals = v if isinstance(v, list) else [v]
    return [float(getattr(x, "value", x)) for x in vals]


def _run_stock(view, row, full, rank) -> dict:
    from verl_tokensel_cpu import worker as H

    stage = "config"
    try:
        cfg = _stock_config(view)
        cfg.validate(n_gpus=row["dp"], train_batch_size=row["mini"] * row["mini_batches"])
        stage = "dispatch"
        shard = _shard(full.clone(), row, rank)
        stage = "update"
        r = H.run_train_step(view, shard, loss_fn=H.default_loss_fn(cfg), capture_params=False)
    except Exception as e:  # noqa: BLE001
        return _error(e, stage)
    return {"status": "ok", "loss": r.loss}


def _run_preset(view, row, full, rank, preset: str) -> dict:
    """One update under ``preset``: the outcome and, on success, what the budget checks need."""
    from verl.utils import tensordict_utils as tu

    from verl_tokensel.core import fields
    from verl_tokensel_cpu import batches as B, worker as H
    from verl_tokensel.verl_glue.loss import SelectingLoss

    stage = "config"
    try:
        cfg = H.selecting_actor_config(view, preset)
    except Exception as e:  # noqa: BLE001
        out = _error(e, stage)
        if _config_error(e) is not None:
            out.update(status="config_refused", message=str(_config_error(e))[:600])
        return out
    out: dict = {"micro": [], "minibatches": []}
    mini_idx = [-1]
    try:
        cfg.validate(n_gpus=row["dp"], train_batch_size=row["mini"] * row["mini_batches"])
        batch = full.clone()
        tu.assign_non_tensor(batch, calculate_entropy=bool(cfg.calculate_entropy or cfg.entropy_coeff != 0))
        if cfg.selection.update_passes != (None,):
            from verl_tokensel.core.fields import UPDATE_PASS

            tu.assign_non_tensor(batch, **{UPDATE_PASS: LOPTI_PHASE})
        if cfg.selection.score_source == "rollout":
            driver = B.add_driver_selection(cfg, batch, eos_token_id=view.tokenizer.eos_token_id)
            out["driver"] = {k: float(v) for k, v in driver.metrics.items()}
            out["driver_valid"] = int(batch[fields.RESPONSE_MASK].values().sum())
        if any(st.forward == "old" for st in cfg.selection.impl.needs.vocab):
            # the old-log-prob pass under the rule's loss computes its vocabulary reductions (kept on the worker);
            # the batch keeps its old log-probs moved off the policy
            stage = "old pass"
            view.set_loss_fn(SelectingLoss(cfg))
            H.compute_old_log_probs(view, batch.clone(), write=False)
        stage = "dispatch"
        shard = _shard(batch, row, rank)
        if fields.MASK in shard.keys():
            out["driver_rank_selected"] = int(shard[fields.MASK].values().sum())

        def observe(rec):
            out["micro"].append({"mini": mini_idx[0], "selected": int(rec["mask"].sum()),
                                 "valid": int(rec["response_mask"].sum()),
                                 "row_selected": rec["mask"].sum(-1).tolist(),
                                 "row_valid": rec["response_mask"].sum(-1).tolist()})

        inner = view.worker.train_batch

        def spy(data, *args, **kwargs):
            mini_idx[0] += 1
            uids = [str(u) for u in data.get(fields.UID).tolist()]
            lens = data[fields.RESPONSE_MASK].values().split(data[fields.RESPONSE_MASK].offsets().diff().tolist())
            out["minibatches"].append({"uids": uids, "valid": [int(x.sum()) for x in lens]})
            return inner(data, *args, **kwargs)

        stage = "update"
        view.worker.train_batch = spy
        try:
            r = H.run_train_step(view, shard, loss_fn=SelectingLoss(cfg, observer=observe), capture_params=False)
        finally:
            view.worker.train_batch = inner
    except Exception as e:  # noqa: BLE001
        return {**_error(e, stage), **{k: v for k, v in out.items() if k not in ("micro", "minibatches")}}
    out.update(status="ok", loss=r.loss, ratio=cfg.selection.ratio, scope=cfg.selection.scope,
               rule=cfg.selection.rule, quantile=getattr(cfg.selection.knobs, "simko_quantile", None),
               budget=getattr(cfg.selection.knobs, "budget", "count"), score=cfg.selection.score,
               metrics={k: _plain(v) for k, v in r.metrics.items()
                        if k.startswith("tokensel/") and ("tokens" in k or "groups" in k)})
    return out


def run_rows(actor, rows: list[dict], rank: int = 0, presets=PRESETS) -> dict[str, dict]:
    """Every row through stock verl and every preset on ``actor``; ``{combo_id: {"stock": ..., "presets": ...}}``.
    A row's old-log-prob pass failing counts as stock's refusal (and every preset's) at stage ``old_pass``.
    Megatron: the old-log-prob pass's outputs come from the model-parallel source rank
    (:func:`verl_tokensel_cpu.worker.compute_old_log_probs`)."""
    results = {}
    for i, row in enumerate(rows):
        view = _actor_view(actor, row)
        try:
            full = _full_batch(view, row, seed=1000 + i)
        except Exception as e:  # noqa: BLE001
            err = _error(e, "old_pass")
            results[combo_id(row)] = {"row": row, "stock": err, "presets": {p: dict(err) for p in presets}}
            continue
        stock = _run_stock(view, row, full, rank)
        results[combo_id(row)] = {"row": row, "stock": stock,
                                  "presets": {p: _run_preset(view, row, full, rank, p) for p in presets}}
    return results


def dp_rank_run(rank: int, world: int, model_dir: str, rmpad: bool, rows: list[dict], engine: str = "fsdp") -> dict:
    """One rank of the rows of a spawned run (use with :func:`helpers.distributed.run_distributed`): the
    data-parallel rows, or the Megatron rows (one process each, Megatron's parallel state is per process)."""
    from verl_tokensel_cpu import worker as H

    actor = H.make_training_worker(model_dir, rank=rank, world_size=world, use_remove_padding=rmpad, lr=1e-4,
                                   engine=engine)
    return run_rows(actor, rows, rank=rank)


# --------------------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------------------


def budget_problems(preset: str, per_rank: list[dict], row: dict) -> list[str]:
    """What is off in a preset's successful run: non-finite loss, or a selection not at the budget of its scope.
    ``per_rank``: that preset's outcome on each rank."""
    from verl_tokensel.core.ranking.scopes import budget

    problems = []
    first = per_rank[0]
    if not math.isfinite(first["loss"]):
        problems.append(f"loss {first['loss']} is not finite")
    ratio, scope = first["ratio"], first["scope"]
    if not any(res["micro"] for res in per_rank):
        problems.append("the selecting loss was never called")
    if first.get("rule") == "simko":  # its mask: each response's tokens strictly above its entropy quantile
        problems += _quantile_problems(per_rank, first["quantile"])
    elif first.get("rule") == "lp_reg":  # the pre-pass's regularised tokens (possibly none), applied by the loss
        problems += _stapo_problems(per_rank, may_be_empty=True)
    elif scope == "micro_batch":
        for r, res in enumerate(per_rank):
            for k, mb in enumerate(res["micro"]):
                if mb["selected"] != budget(ratio, mb["valid"]):
                    problems.append(f"rank {r} micro-batch {k}: {mb['selected']} selected of {mb['valid']}, "
                                    f"budget {budget(ratio, mb['valid'])}")
        # verl's metric: per mini-batch, the mean over the DP ranks of each rank's mean over its micro-batches
        got = first["metrics"].get("tokensel/selected_tokens")
        rank_means = []
        for res in per_rank:
            by_mini: dict[int, list[int]] = {}
            for mb in res["micro"]:
                by_mini.setdefault(mb["mini"], []).append(mb["selected"])
            rank_means.append([sum(v) / len(v) for _, v in sorted(by_mini.items())])
        want = [sum(col) / len(col) for col in zip(*rank_means)]
        if got is None or len(got) != len(want) or any(abs(a - b) > 1e-6 for a, b in zip(got, want)):
            problems.append(f"tokensel/selected_tokens {got}, the micro-batches' mean per mini-batch {want}")
    elif scope == "group" and first["metrics"].get("tokensel/prepass/selected_tokens") is not None:
        got = first["metrics"]["tokensel/prepass/selected_tokens"]
        n_mini = len(first["minibatches"])
        want = []
        for i in range(n_mini):
            per_group: dict[str, int] = {}
            for res in per_rank:
                for u, v in zip(res["minibatches"][i]["uids"], res["minibatches"][i]["valid"]):
                    per_group[u] = per_group.get(u, 0) + v
            want.append(float(sum(budget(ratio, v) for v in per_group.values())))
        if got != want:
            problems.append(f"tokensel/prepass/selected_tokens {got}, per mini-batch over its groups {want}")
        applied = [sum(mb["selected"] for mb in res["micro"]) for res in per_rank]
        if sum(applied) != sum(want):
            problems.append(f"the loss applied {applied} tokens, the pre-pass selected {sum(want)}")
    elif scope == "group" and first.get("driver") is not None:  # the driver's group rules (ktae, gtpo): every token
        d = first["driver"]
        if d.get("tokensel/driver_selected_tokens") != first["driver_valid"]:
            problems.append(f"driver metrics {d}: every one of the {first['driver_valid']} valid tokens")
        problems += _driver_mask_problems(row, per_rank)
    elif scope == "group":
        problems.append("gmts ran without tokensel/prepass/* metrics")
    elif scope == "mini_batch" and first["score"] in ("stapo", "m2po"):
        problems += _stapo_problems(per_rank)
    elif scope == "mini_batch":
        problems += _cov_problems(per_rank)
    elif scope == "sequence" and first["budget"] == "quantile":
        problems += _quantile_problems(per_rank, 1 - ratio)
    elif scope == "batch":
        d = first.get("driver", {})
        want = budget(ratio, first["driver_valid"])
        if d.get("tokensel/driver_selected_tokens") != want or d.get("tokensel/driver_valid_tokens") != first[
                "driver_valid"]:
            problems.append(f"driver metrics {d}, budget {want} of {first['driver_valid']}")
        problems += _driver_mask_problems(row, per_rank)
    return problems


def _quantile_problems(per_rank: list[dict], q: float) -> list[str]:
    """Strictly above the ``q`` quantile of the response, linear interpolation: with distinct scores the top
    ``n - 1 - floor(q (n - 1))`` of its ``n`` valid tokens (Archer's, ASPO's, SimKO's hot tokens)."""
    problems = []
    for r, res in enumerate(per_rank):
        for k, mb in enumerate(res["micro"]):
            want = [n - 1 - math.floor(q * (n - 1)) if n else 0 for n in mb["row_valid"]]
            if mb["row_selected"] != want:
                problems.append(f"rank {r} micro-batch {k}: {mb['row_selected']} selected per response of "
                                f"{mb['row_valid']}, above the {q:g} quantile {want}")
    return problems


def _cov_problems(per_rank: list[dict]) -> list[str]:
    """KL-Cov / Clip-Cov over the mini-batch (the pre-pass): per mini-batch, max(1, int(ratio N)) of its N valid
    tokens over the ranks (KL-Cov; Clip-Cov at most that many, its candidates may be fewer), and the loss applies
    exactly the pre-pass's tokens."""
    from verl_tokensel.core.rules.covariance import cov_budget

    first = per_rank[0]
    got = first["metrics"].get("tokensel/prepass/selected_tokens")
    valid = [sum(sum(res["minibatches"][i]["valid"]) for res in per_rank) for i in range(len(first["minibatches"]))]
    want = [float(cov_budget(first["ratio"], n)) for n in valid]
    if got is None or len(got) != len(want):
        return [f"tokensel/prepass/selected_tokens {got}, one value per mini-batch of {valid} valid tokens"]
    problems = []
    if first["score"] == "kl_cov" and got != want:
        problems.append(f"tokensel/prepass/selected_tokens {got}, max(1, int(ratio N)) of {valid}: {want}")
    if first["score"] == "clip_cov" and any(not 0 <= g <= w for g, w in zip(got, want)):
        problems.append(f"tokensel/prepass/selected_tokens {got}, at most max(1, int(ratio N)) of {valid}: {want}")
    applied = [0] * len(want)
    for res in per_rank:
        for mb in res["micro"]:
            applied[mb["mini"]] += mb["selected"]
    if applied != [int(g) for g in got]:
        problems.append(f"the loss applied {applied} tokens per mini-batch, the pre-pass selected {got}")
    return problems


def _stapo_problems(per_rank: list[dict], may_be_empty: bool = False) -> list[str]:
    """STAPO over the mini-batch (the pre-pass): per mini-batch, the kept and spurious tokens over the ranks add up to
    its valid tokens, and the loss applies exactly the kept ones. ``may_be_empty``: none kept is in range (Lp-Reg's
    regularised tokens)."""
    first = per_rank[0]
    got = first["metrics"].get("tokensel/prepass/selected_tokens")
    valid = [sum(sum(res["minibatches"][i]["valid"]) for res in per_rank) for i in range(len(first["minibatches"]))]
    if got is None or len(got) != len(valid):
        return [f"tokensel/prepass/selected_tokens {got}, one value per mini-batch of {valid} valid tokens"]
    problems = []
    if any(not (0 <= g if may_be_empty else 0 < g) or g > v for g, v in zip(got, valid)):
        problems.append(f"tokensel/prepass/selected_tokens {got} of {valid}: kept tokens out of range")
    applied = [0] * len(got)
    for res in per_rank:
        for mb in res["micro"]:
            applied[mb["mini"]] += mb["selected"]
    if applied != [int(g) for g in got]:
        problems.append(f"the loss applied {applied} tokens per mini-batch, the pre-pass kept {got}")
    return problems


def verdict(result_per_rank: list[dict], preset: str) -> tuple[str, str]:
    """(cell text, problem or '') for one preset of one row; ``result_per_rank``: the row's result on each rank."""
    row, stock = result_per_rank[0]["row"], result_per_rank[0]["stock"]
    res = [r["presets"][preset] for r in result_per_rank]
    first = res[0]
    keys = expected_config_refusal(preset, row)
    if first["status"] == "config_refused":
        missing = [k for k in (keys or ()) if k not in first["message"]]
        if keys is None:
            return "config refused (unexpected)", f"{preset}: refused by our validation: {first['message']}"
        if missing:
            return "config refused", f"{preset}: the refusal does not name {missing}: {first['message']}"
        return "config refused (" + ", ".join(keys) + ")", ""
    if keys is not None:
        return f"{first['status']} (config not refused)", f"{preset}: our validation let it through, it needs {keys}"
    if stock["status"] != "ok" and runs_where_stock_refuses(preset, row, stock):
        if any(r["status"] != "ok" for r in res):
            bad = next(r for r in res if r["status"] != "ok")
            return (f"FAILED {bad['error']}", f"{preset} has no dual clip, so it must run where stock's dual-clip "
                    f"assert refuses; it failed (stage {bad['stage']}): {bad['error']}: {bad['message']}")
        problems = budget_problems(preset, res, row)
        if problems:
            return "ok, budget off", f"{preset}: " + "; ".join(problems)
        return f"ok {first['loss']:.4g} (no dual clip)", ""
    if stock["status"] != "ok":
        if first["status"] == "refused" and first["error"] == stock["error"]:
            return f"refused {first['error']}", ""
        return (f"{first['status']} {first.get('error', '')}",
                f"{preset}: stock refused with {stock['error']}, the preset {first['status']} "
                f"{first.get('error', '')}")
    if any(r["status"] != "ok" for r in res):
        bad = next(r for r in res if r["status"] != "ok")
        return (f"FAILED {bad['error']}",
                f"{preset} failed where stock runs (stage {bad['stage']}): {bad['error']}: {bad['message']}\n"
                f"{bad['traceback_tail']}")
    problems = budget_problems(preset, res, row)
    if problems:
        return "ok, budget off", f"{preset}: " + "; ".join(problems)
    return f"ok {first['loss']:.4g}", ""


def render_markdown(results: dict[str, list[dict]], seconds: float, command: str) -> str:
    """The table: combination -> stock outcome -> each preset's outcome."""
    lines = [
        "# Stock-parity matrix (CPU, verl's FSDP2 TrainingWorker)",
        "",
        f"Written by `{command}` ({len(results)} combinations, {seconds:.0f} s). A seeded pairwise design "
        f"(seed {SEED}) over {', '.join(FACTORS)}, each of verl's {len(LOSS_MODES)} policy losses (`loss_mode`) on "
        "one row at least (the id ends with it; none: vanilla), plus a row every loss must refuse. "
        "`ok <loss>`: one update, "
        "finite loss, selection at its scope's budget; `refused <Error>`: stock and the preset refused alike; "
        "`config refused (keys)`: our validation refused a combination the preset cannot serve; `(no dual clip)`: "
        "the preset's loss, as verl's `loss_mode=kl_cov` / `clip_cov`, has no dual clip, so it runs where stock's "
        "dual-clip assert refuses.",
        "",
        "| combination | stock | " + " | ".join(PRESETS) + " |",
        "|---|---|" + "---|" * len(PRESETS),
    ]
    for cid, per_rank in results.items():
        stock = per_rank[0]["stock"]
        s = f"ok {stock['loss']:.4g}" if stock["status"] == "ok" else f"refused {stock['error']} ({stock['stage']})"
        lines.append(f"| `{cid}` | {s} | " + " | ".join(verdict(per_rank, p)[0] for p in PRESETS) + " |")
    return "\n".join(lines) + "\n"


def _driver_mask_problems(row: dict, per_rank: list[dict]) -> list[str]:
    """Each rank's loss applied the driver's mask of its rows once per epoch."""
    problems = []
    for r, res in enumerate(per_rank):
        applied = sum(mb["selected"] for mb in res["micro"])
        if applied != row["epochs"] * res["driver_rank_selected"]:
            problems.append(f"rank {r}: the loss applied {applied} tokens, the driver's mask has "
                            f"{res['driver_rank_selected']} per epoch")
    return problems
