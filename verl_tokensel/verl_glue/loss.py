"""The selecting actor loss, called by verl's engines exactly like ``verl.workers.utils.losses.ppo_loss``.

Signature: ``tokensel_ppo_loss(config, model_output, data, dp_group=None) -> (loss, metrics)``; the
FSDP/FSDP2 engine calls it once per micro-batch and back-propagates the result, the Megatron engine
calls it on the last pipeline stage and scales it by its micro-batch count. Both pass the same
``data`` (the whole micro-batch, with ``dp_size`` and ``batch_num_tokens`` of the global
mini-batch) and ``model_output`` (nested ``log_probs``, ``entropy`` when requested,
``sum_pi_squared`` when requested).

How the mask acts (the clip maths stays verl's: the registered policy loss of
``policy_loss.loss_mode`` is called, never re-derived):

- ``normaliser=all``: the policy loss gets ``where(mask, log_prob, log_prob.detach())``. Forward
  values are unchanged, so every aggregation mode keeps its stock denominator (all valid tokens of
  the global mini-batch for token-mean, per-sequence lengths for seq-mean-*), and the gradient
  reaching unselected tokens is exactly zero. This is the 80/20 paper's objective
  ``1/sum|o_i| * sum 1[selected] * surrogate`` and the GMTS code's "zero the advantage". The
  logged ``actor/pg_loss`` is therefore the full-token surrogate.
- ``normaliser=selected`` (token-mean only, the 80/20 released code): the policy loss gets
  ``response_mask & mask`` as its loss mask and a denominator of the micro-batch's selected
  tokens, weighted by the micro-batch's share of the mini-batch's RESPONSES, as that code weights
  its micro-batches (``1 / gradient_accumulation`` with fixed micro-batches, ``len(micro-batch) /
  ppo_mini_batch_size`` with dynamic batch size): the loss is
  ``sum_sel l / n_sel(mb) * rows(mb) * dp_size / global_batch_size`` (``global_batch_size``: the
  mini-batch's responses over all data-parallel ranks, which both verl drivers pass), so after the
  engines' data-parallel gradient average each micro-batch's mean counts ``rows(mb) / global_batch_size``.
  Clip metrics are then over the selected tokens, as in that code.
- entropy bonus and KL loss see the mask only when ``mask_entropy_bonus`` / ``mask_kl_loss``.

What is verl's and what is ours: the part of ``ppo_loss`` the selecting loss has to repeat (global batch
info, metric aggregation, the entropy and KL terms) is one function, :func:`verl_ppo_loss_body`, pinned
to verl's source by :data:`VERL_PPO_LOSS_SHA256` (a test fails when verl's ``ppo_loss`` changes); the
rest of this module is the selection.

``token_selector=none`` calls verl's ``ppo_loss`` itself, so it is stock bit for bit; ratio 1.0
with ``normaliser=all`` is bit-identical too (``where`` with an all-True mask is the identity in
both directions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from verl_tokensel.core.batch import ScoreBatch, score_batch
from verl_tokensel.core.config import Selection
from verl_tokensel.core.scores import grad_mass, score_params
from verl_tokensel.core.select import EVERY_MICRO_BATCH_STATS, select_tokens, selection_stats
from verl_tokensel.verl_glue.announce import announce_loss

METRIC_PREFIX = "tokensel/"
# Per-token fields a driver-side (score_source=rollout) or pre-pass (score_source=prepass) selection
# adds to the update batch, nested like verl's other per-token fields: the bool mask the loss applies
# and the float32 scores it was ranked by (for the threshold metrics).
MASK_FIELD = "token_select_mask"
SCORE_FIELD = "token_select_score"


UID_FIELD = "uid"
# the old-log-prob pass's per-token entropy, as the V1 driver stores it with the batch
OLD_ENTROPY_FIELD = "entropy"


def batch_uids(data: TensorDict):
    """verl's ``uid`` (prompt id) of each row of ``data``, for ``scope=group``; a clear error when absent."""
    if UID_FIELD not in data.keys():
        raise RuntimeError(
            f"token_selection.scope=group needs the '{UID_FIELD}' of each response in the update batch (the prompt "
            f"id verl's drivers attach to every rollout), and this mini-batch has none (keys: {sorted(data.keys())}). "
            "Fix: keep the uid field in the batch a custom trainer sends to update_actor, or use scope=mini_batch."
        )
    return data.get(UID_FIELD)


@dataclass
class MicroBatch:
    """One engine micro-batch (or a rank's mini-batch) laid out for scoring: padded ``(batch, response_len)``.

    ``log_prob`` / ``entropy`` keep their autograd graph (the loss needs it); ``scores`` holds detached copies.
    """

    log_prob: torch.Tensor
    entropy: Optional[torch.Tensor]
    padded: TensorDict
    response_mask: torch.Tensor
    scores: ScoreBatch


def unpack_micro_batch(config, sel: Selection, model_output, data: TensorDict, *, rank: bool = True,
                       extra_fields: tuple[str, ...] = ()) -> MicroBatch:
    """The engine's nested ``model_output`` and micro-batch ``data`` as padded tensors and their
    :func:`~verl_tokensel.core.batch.score_batch` (the loss and the pre-pass both call this).

    ``model_output=None``: the policy values are the old-log-prob pass's (``old_log_probs`` and, when present,
    ``entropy`` of ``data``): the pre-pass at the weights that pass measured.
    ``rank=False`` skips the row keys and group ids (the mask was measured before the update).
    ``extra_fields``: more per-token fields of ``data`` to pad (the pre-measured mask and scores).
    """
    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += [k for k in ("rollout_is_weights", "ref_log_prob") if k in data.keys()]
    fields += [k for k in extra_fields if k in data.keys()]
    if model_output is None and OLD_ENTROPY_FIELD in data.keys():
        fields.append(OLD_ENTROPY_FIELD)
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(torch.bool)
    if model_output is None:
        log_prob, sum_pi_squared = padded["old_log_probs"], None
        entropy = padded.get(OLD_ENTROPY_FIELD, None)
    else:
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data)
        sum_pi_squared = model_output.get("sum_pi_squared", None)
        if sum_pi_squared is not None:
            sum_pi_squared = no_padding_2_padding(sum_pi_squared, data)
    ids = attn = uids = None
    if rank:
        ids = data["input_ids"]
        if not getattr(ids, "is_nested", False) and "attention_mask" in data.keys():
            attn = data["attention_mask"]  # padded rows: hash only the real tokens
        if sel.scope == "group":
            uids = batch_uids(data)
    sb = score_batch(
        sel.score,
        response_mask=response_mask,
        log_prob=log_prob,
        old_log_prob=padded["old_log_probs"],
        advantages=padded["advantages"],
        entropy=entropy,
        sum_pi_squared=sum_pi_squared,
        ref_log_prob=padded.get("ref_log_prob", None),
        rollout_is_weights=padded.get("rollout_is_weights", None),
        input_ids=ids,
        attention_mask=attn,
        uids=uids,
        scope=sel.scope,
        seed=sel.seed,
        params=score_params(config),
    )
    return MicroBatch(log_prob=log_prob, entropy=entropy, padded=padded, response_mask=response_mask, scores=sb)


def finite_tokens(config, log_prob, entropy, padded: TensorDict, scores, response_mask) -> torch.Tensor:
    """Bool ``(batch, response_len)``: the tokens whose loss inputs (log-prob, old log-prob, advantage, rollout IS
    weight, reference log-prob when the KL loss is on, entropy when computed) are finite and whose score is not
    NaN. True on padding."""
    ok = ~torch.isnan(scores) & torch.isfinite(log_prob.detach())
    for key in ("old_log_probs", "advantages", "rollout_is_weights"):
        v = padded.get(key, None)
        if v is not None:
            ok &= torch.isfinite(v)
    if config.use_kl_loss and padded.get("ref_log_prob", None) is not None:
        ok &= torch.isfinite(padded["ref_log_prob"])
    if entropy is not None:
        ok &= torch.isfinite(entropy.detach())
    return ok | ~response_mask


def _global_responses(data: TensorDict) -> int:
    """The mini-batch's responses over all data-parallel ranks (``global_batch_size``, set by verl's drivers)."""
    g = tu.get_non_tensor_data(data=data, key="global_batch_size", default=None)
    if g is None or int(g) <= 0:
        raise RuntimeError(
            f"token_selection.normaliser=selected weights each micro-batch by its share of the mini-batch's "
            f"responses, but the micro-batch carries global_batch_size={g!r} (verl's drivers set it to "
            "ppo_mini_batch_size * rollout.n in _update_actor). A custom driver must pass it, or use "
            "token_selection.normaliser=all.")
    return int(g)


class SelectingLoss:
    """The selecting actor loss bound to its resolved actor config: what ``set_loss_fn`` installs.

    Called by the engines like ``partial(ppo_loss, config=...)``; the pre-pass reads the rule from
    :attr:`config` (the one resolution of the actor node in this process). ``observer``: see
    :func:`tokensel_ppo_loss`. Picklable (Ray ships it to the workers).
    """

    def __init__(self, config, observer=None):
        self.config = config
        self.observer = observer

    @property
    def selection(self) -> Optional[Selection]:
        return getattr(self.config, "selection", None)

    def __call__(self, model_output, data: TensorDict, dp_group=None):
        return tokensel_ppo_loss(self.config, model_output, data, dp_group, observer=self.observer)

    def __setstate__(self, state) -> None:
        # unpickled = received by a worker (``set_loss_fn`` over Ray): say so once per process, so a
        # multi-node run's log shows on which node, from which installed package, selection is active
        self.__dict__.update(state)
        announce_loss(self)

    def __repr__(self) -> str:
        return f"SelectingLoss(selection={self.selection!r})"


def tokensel_ppo_loss(config, model_output, data: TensorDict, dp_group=None, observer=None):
    """verl's PPO actor loss with the policy gradient restricted to the selected tokens.

    ``observer`` (bind it with ``functools.partial``; engines never pass it) is called once per
    micro-batch with ``{"mask", "scores", "response_mask", "data", "log_prob", "advantages"}`` (padded
    ``(batch, response_len)`` tensors, ``log_prob`` still in the graph, and the micro-batch as the engine
    passed it), for analysis and tests.
    """
    sel: Selection | None = getattr(config, "selection", None)
    if sel is None:
        return ppo_loss(config, model_output, data, dp_group)

    guard = config.global_batch_info
    guard.active = True
    try:
        return _selecting_loss(config, sel, model_output, data, dp_group, observer)
    finally:
        guard.active = False


def _selecting_loss(config, sel: Selection, model_output, data: TensorDict, dp_group, observer=None):
    precomputed = sel.score_source != "current"
    if precomputed and MASK_FIELD not in data.keys():
        raise RuntimeError(
            f"token_selection.score_source={sel.score_source} but the update micro-batch has no "
            f"'{MASK_FIELD}' field: the selection that runs before the update (on the driver for "
            "rollout, at the start of each mini-batch for prepass) did not run. It is installed by "
            "python -m verl_tokensel.main_ppo (trainer modes tokensel_*); a custom trainer must keep it."
        )
    mb = unpack_micro_batch(config, sel, model_output, data, rank=not precomputed,
                            extra_fields=(MASK_FIELD, SCORE_FIELD) if precomputed else ())
    log_prob, entropy, padded, response_mask = mb.log_prob, mb.entropy, mb.padded, mb.response_mask
    inp = mb.scores.inputs

    # ---- score and select (no gradient) ----
    if precomputed:
        scores = padded[SCORE_FIELD].float() if SCORE_FIELD in padded.keys() else torch.zeros_like(log_prob)
    else:
        scores = mb.scores.score(sel.score)
    # a token whose loss inputs or score are not finite is dropped: out of the pool, no gradient, no loss term,
    # counted in tokensel/nan_scores (its surrogate is undefined)
    finite = finite_tokens(config, log_prob, entropy, padded, scores, response_mask)
    dropped = bool((response_mask & ~finite).any())
    pool = response_mask & finite if dropped else response_mask
    if precomputed:
        mask = padded[MASK_FIELD].to(torch.bool) & pool
    else:
        mask = select_tokens(scores, pool, sel.ratio, scope=sel.scope, direction=sel.direction,
                             dp_group=dp_group, pool=sel.pool)
    if observer is not None:
        observer({"mask": mask, "scores": scores, "response_mask": response_mask, "data": data,
                  "log_prob": log_prob, "advantages": padded["advantages"]})

    # ---- policy loss, via verl's registered loss for loss_mode; only its inputs are ours ----
    gated_log_prob = torch.where(mask, log_prob, log_prob.detach())
    inputs = {k: padded.get(k, None) for k in ("old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob")}
    if dropped:  # finite stand-ins where dropped (masked out below; verl's masked sums would turn NaN x 0 into NaN)
        gated_log_prob = torch.where(finite, gated_log_prob, 0.0)
        fill = {"old_log_probs": gated_log_prob.detach(), "advantages": 0.0, "rollout_is_weights": 1.0,
                "ref_log_prob": gated_log_prob.detach()}
        inputs = {k: None if v is None else torch.where(finite, v, fill[k]) for k, v in inputs.items()}
        if entropy is not None:
            entropy = torch.where(finite, entropy, 0.0)

    def policy_loss(info):
        policy_loss_fn = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
        loss_mask = pool
        saved = info["batch_num_tokens"]
        if sel.normaliser == "selected":
            n_sel = int(mask.sum())
            if n_sel > 0:
                loss_mask = mask
                # token-mean divides by batch_num_tokens: n_sel * G / rows makes it the selected mean x rows / G
                info["batch_num_tokens"] = n_sel * _global_responses(data) / int(response_mask.shape[0])
        try:
            return policy_loss_fn(
                old_log_prob=inputs["old_log_probs"],
                log_prob=gated_log_prob,
                advantages=inputs["advantages"],
                response_mask=loss_mask,
                loss_agg_mode=config.loss_agg_mode,
                config=config,
                rollout_is_weights=inputs["rollout_is_weights"],
            )
        finally:
            info["batch_num_tokens"] = saved

    ent_term = entropy
    if entropy is not None and sel.mask_entropy_bonus:
        ent_term = torch.where(mask, entropy, entropy.detach())
    loss, metrics = verl_ppo_loss_body(
        config, data, policy_loss, response_mask=pool, entropy=ent_term,
        kl_log_prob=gated_log_prob if sel.mask_kl_loss else (
            torch.where(finite, log_prob, 0.0) if dropped else log_prob),
        ref_log_prob=inputs["ref_log_prob"] if config.use_kl_loss else None,
    )

    # ---- selection metrics (per micro-batch, averaged over micro-batches and ranks) ----
    if dropped:  # tokensel/nan_scores counts the dropped tokens
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
    stats = selection_stats(mask, response_mask, scores, entropy=entropy, grad_mass=grad_mass(sel.score, scores, inp))
    for key, value in stats.items():
        # A stat that exists only where it is defined (no selected token in this micro-batch: no threshold, no
        # selected entropy) is a plain value: verl concatenates those over data-parallel ranks, while its
        # Metric.aggregate_dp needs the same count on every rank and fails the update otherwise. The driver
        # reduces plain values by name (np.min for *_min_*, np.max for *_max_*, else the mean).
        metrics[METRIC_PREFIX + key] = (Metric(value=value, aggregation=AggregationType.MEAN)
                                        if key in EVERY_MICRO_BATCH_STATS else value)
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------------------
# The part of verl's ppo_loss that the selecting loss must repeat, kept in one place. Source: ppo_loss in
# verl/workers/utils/losses.py, verl 0.9.1; its hash is pinned below and tests/test_loss_on_cpu.py fails when verl's
# source changes ("re-check loss.py against verl's ppo_loss").
# ---------------------------------------------------------------------------------------------------------------------
#: sha256 of ``inspect.getsource(verl.workers.utils.losses.ppo_loss)`` this copy was checked against
VERL_PPO_LOSS_SHA256 = "d7c0f8772b444f55a59975a1fae154c43a2dab4724a88c89d95237e0a128c561"


def verl_ppo_loss_body(config, data: TensorDict, policy_loss, *, response_mask, entropy, kl_log_prob, ref_log_prob):
    """verl's ``ppo_loss`` after its inputs are padded: global batch info, metric aggregation, the policy loss
    term, the entropy bonus and the KL loss, in verl's order and with verl's metric names.

    ``policy_loss(global_batch_info) -> (pg_loss, pg_metrics)`` calls verl's registered policy loss (the
    selection chooses its log-prob and loss mask); ``entropy`` (or None) and ``kl_log_prob`` are the
    ``(batch, response_len)`` tensors verl's entropy and KL terms would use, already gated by the caller when
    ``mask_entropy_bonus`` / ``mask_kl_loss`` ask for it. Returns ``(loss, metrics)`` as ``ppo_loss`` does.
    """
    # global batch info for loss aggregation
    info = config.global_batch_info
    info["dp_size"] = data["dp_size"]
    info["batch_num_tokens"] = data["batch_num_tokens"]
    info["global_batch_size"] = data["global_batch_size"]
    info["loss_scale_factor"] = config.loss_scale_factor
    # any global batch info set: the losses normalise globally, so the metric is a SUM over micro-batches
    if (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    ):
        metric_aggregation = AggregationType.SUM
    else:
        metric_aggregation = AggregationType.MEAN

    pg_loss, pg_metrics = policy_loss(info)
    metrics = dict(Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN))
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=metric_aggregation)
    loss = pg_loss

    if entropy is not None:
        entropy_loss = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **info)
        loss -= config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=metric_aggregation)

    if config.use_kl_loss:
        kld = kl_penalty(logprob=kl_log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **info)
        loss += kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics
