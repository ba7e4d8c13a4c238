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
  tokens, weighted by the micro-batch's share of the mini-batch's valid tokens: the loss is
  ``sum_sel l / n_sel(mb) * n_valid(mb) * dp_size / batch_num_tokens``, i.e. the released code's
  per-micro-batch mean over selected tokens when micro-batches are equal-sized. Clip metrics are
  then over the selected tokens, as in that code.
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

import torch
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from verl_tokensel.core.config import Selection
from verl_tokensel.core.scores import SCORE_REGISTRY, ScoreInputs, compute_score, grad_mass, score_params
from verl_tokensel.core.select import select_tokens, selection_stats

METRIC_PREFIX = "tokensel/"
# Per-token fields a driver-side (score_source=rollout) or pre-pass (score_source=prepass) selection
# adds to the update batch, nested like verl's other per-token fields: the bool mask the loss applies
# and the float32 scores it was ranked by (for the threshold metrics).
MASK_FIELD = "token_select_mask"
SCORE_FIELD = "token_select_score"


def _row_keys(data: TensorDict, batch: int) -> torch.Tensor:
    """An int64 key per response from its full token ids (stable across ranks, splits and reruns)."""
    from verl_tokensel.core.scores import row_keys_from_packed, row_keys_from_tokens

    ids = data["input_ids"]
    if getattr(ids, "is_nested", False):
        return row_keys_from_packed(ids.values(), ids.offsets())
    if "attention_mask" in data.keys():  # padded rows: hash only the real tokens
        attn = data["attention_mask"].bool()
        return row_keys_from_tokens([ids[i][attn[i]] for i in range(batch)])
    return row_keys_from_tokens([ids[i] for i in range(batch)])


def build_score_inputs(config, sel: Selection, log_prob, entropy, sum_pi_squared, padded, data,
                       with_row_keys: bool = True) -> ScoreInputs:
    """:class:`ScoreInputs` of one micro-batch (padded tensors). ``with_row_keys=False`` skips hashing the
    rows' token ids when the caller will not rank (a mask measured before the update is applied)."""
    spec = SCORE_REGISTRY[sel.score]
    inp = ScoreInputs(
        log_prob=log_prob.detach(),
        response_mask=padded["response_mask"].to(torch.bool),
        entropy=entropy.detach() if entropy is not None else None,
        old_log_prob=padded["old_log_probs"],
        advantages=padded["advantages"],
        sum_pi_squared=sum_pi_squared,
        ref_log_prob=padded.get("ref_log_prob", None),
        seed=sel.seed,
        **score_params(config),
    )
    if with_row_keys and spec.needs_row_keys:
        inp.row_keys = _row_keys(data, log_prob.shape[0]).to(log_prob.device)
    if "rollout_is_weights" in padded.keys():
        # the rollout-correction weight multiplies the token loss, hence its gradient
        inp.advantages = inp.advantages * padded["rollout_is_weights"]
    return inp


def tokensel_ppo_loss(config, model_output, data: TensorDict, dp_group=None, observer=None):
    """verl's PPO actor loss with the policy gradient restricted to the selected tokens.

    ``observer`` (bind it with ``functools.partial``; engines never pass it) is called once per
    micro-batch with ``{"mask", "scores", "response_mask", "data"}`` (padded
    ``(batch, response_len)`` tensors and the micro-batch as the engine passed it), for analysis
    and tests.
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
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)
    sum_pi_squared = model_output.get("sum_pi_squared", None)
    if sum_pi_squared is not None:
        sum_pi_squared = no_padding_2_padding(sum_pi_squared, data)

    fields = ["response_mask", "old_log_probs", "advantages"]
    if "rollout_is_weights" in data:
        fields.append("rollout_is_weights")
    if "ref_log_prob" in data:
        fields.append("ref_log_prob")
    precomputed = sel.score_source != "current"
    if precomputed:
        if MASK_FIELD not in data.keys():
            raise RuntimeError(
                f"token_selection.score_source={sel.score_source} but the update micro-batch has no "
                f"'{MASK_FIELD}' field: the selection that runs before the update (on the driver for "
                "rollout, at the start of each mini-batch for prepass) did not run. It is installed by "
                "python -m verl_tokensel.main_ppo (trainer modes tokensel_*); a custom trainer must keep it."
            )
        fields.append(MASK_FIELD)
        if SCORE_FIELD in data.keys():
            fields.append(SCORE_FIELD)
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)

    # ---- score and select (no gradient) ----
    inp = build_score_inputs(config, sel, log_prob, entropy, sum_pi_squared, padded, data,
                             with_row_keys=not precomputed)
    if precomputed:
        mask = padded[MASK_FIELD].to(torch.bool) & response_mask
        scores = padded[SCORE_FIELD].float() if SCORE_FIELD in padded.keys() else torch.zeros_like(log_prob)
    else:
        scores = compute_score(sel.score, inp)
        mask = select_tokens(scores, response_mask, sel.ratio, scope=sel.scope, direction=sel.direction,
                             dp_group=dp_group)
    if observer is not None:
        observer({"mask": mask, "scores": scores, "response_mask": response_mask, "data": data})

    # ---- policy loss, via verl's registered loss for loss_mode; only its inputs are ours ----
    gated_log_prob = torch.where(mask, log_prob, log_prob.detach())

    def policy_loss(info):
        policy_loss_fn = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
        loss_mask = response_mask
        saved = info["batch_num_tokens"]
        if sel.normaliser == "selected":
            n_sel = int(mask.sum())
            if n_sel > 0:
                loss_mask = mask
                if saved is not None:
                    info["batch_num_tokens"] = saved * n_sel / int(response_mask.sum())
        try:
            return policy_loss_fn(
                old_log_prob=padded["old_log_probs"],
                log_prob=gated_log_prob,
                advantages=padded["advantages"],
                response_mask=loss_mask,
                loss_agg_mode=config.loss_agg_mode,
                config=config,
                rollout_is_weights=padded.get("rollout_is_weights", None),
            )
        finally:
            info["batch_num_tokens"] = saved

    ent_term = entropy
    if entropy is not None and sel.mask_entropy_bonus:
        ent_term = torch.where(mask, entropy, entropy.detach())
    loss, metrics = verl_ppo_loss_body(
        config, data, policy_loss, response_mask=response_mask, entropy=ent_term,
        kl_log_prob=gated_log_prob if sel.mask_kl_loss else log_prob,
        ref_log_prob=padded["ref_log_prob"] if config.use_kl_loss else None,
    )

    # ---- selection metrics (per micro-batch, averaged over micro-batches and ranks) ----
    stats = selection_stats(mask, response_mask, scores, entropy=entropy, grad_mass=grad_mass(sel.score, scores, inp))
    for key, value in stats.items():
        metrics[METRIC_PREFIX + key] = Metric(value=value, aggregation=AggregationType.MEAN)
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
