"""The selecting actor loss, called by verl's engines exactly like ``verl.workers.utils.losses.ppo_loss``.

``tokensel_ppo_loss(config, model_output, data, dp_group=None) -> (loss, metrics)``: per micro-batch, the rule step
(:func:`verl_tokensel.core.step.apply_rule`) picks the tokens, then verl's registered policy loss of
``policy_loss.loss_mode`` runs on inputs that carry the selection (the clip maths stays verl's):

- ``normaliser=all``: the policy loss gets ``where(mask, log_prob, log_prob.detach())``: forward values and every
  aggregation's denominator unchanged, zero gradient off the mask (the 80/20 paper's objective, the GMTS code's
  "zero the advantage"); ``actor/pg_loss`` is the full-token surrogate;
- ``normaliser=selected`` (token-mean only, the 80/20 released code): only the selected tokens' per-token losses
  enter the sum and the denominator is the micro-batch's selected tokens, weighted by its share of the mini-batch's
  responses; ``normaliser=kept``: only the kept tokens' enter, over the pre-pass's count of them;
- under every normaliser ``loss_mode``'s own sequence- and batch-level quantities (GSPO's sequence ratio, the
  covariance pools, bypass mode's sequence weights) run over every valid token, as stock verl's: how the unselected
  tokens leave the sum is the loss's route (:mod:`~verl_tokensel.core.seam.loss_modes`, docs/loss-modes.md);
- the entropy bonus and KL loss see the mask only with ``mask_entropy_bonus`` / ``mask_kl_loss``;
- the rule's :class:`~verl_tokensel.core.seam.rule.LossTransform` is applied as it is: its gate (None: every
  token keeps the gradient), the advantages' affine map, the KL and entropy weights, and the per-token policy loss
  it names (:func:`~verl_tokensel.verl_glue.policy_loss.transform_policy_loss`; None: ``loss_mode``'s).

``token_selector=none`` calls verl's ``ppo_loss`` itself (stock bit for bit). The part of ``ppo_loss`` the
selecting loss repeats is :func:`verl_ppo_loss_body`, pinned to verl's source by :data:`VERL_PPO_LOSS_SHA256`.
docs/how-it-plugs.md has the derivations.
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

from verl_tokensel.core import fields
from verl_tokensel.core.seam.loss_modes import loss_mode
from verl_tokensel.core.seam.rule import LossContext, RuleInput
from verl_tokensel.core.step import apply_rule
from verl_tokensel.core.ranking.select import EVERY_MICRO_BATCH_STATS
from verl_tokensel.core.resolve.selection import Selection
from verl_tokensel.verl_glue.announce import announce_loss
from verl_tokensel.verl_glue.micro_batch import unpack_micro_batch
from verl_tokensel.verl_glue.policy_loss import transform_policy_loss

METRIC_PREFIX = "tokensel/"
# the per-token fields a selection measured before the update writes into the batch (names: core/fields.py)
MASK_FIELD = fields.MASK
SCORE_FIELD = fields.SCORE


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


def update_pass(sel: Selection, data: TensorDict) -> int | None:
    """The driver's update pass this micro-batch belongs to (None for a rule with one pass)."""
    passes = sel.update_passes
    if passes == (None,):
        return None
    value = tu.get_non_tensor_data(data=data, key=fields.UPDATE_PASS, default=None)
    if value not in passes:
        raise RuntimeError(
            f"token_selection's rule {sel.rule} runs the update passes {passes} per step, but the update batch "
            f"carries {fields.UPDATE_PASS}={value!r}: the driver did not split the update into them. They are run by "
            "python -m verl_tokensel.main_ppo (trainer modes tokensel_*, and the v0 driver); a custom trainer must "
            f"call update_actor once per pass with {fields.UPDATE_PASS} set to each of {passes}.")
    return int(value)


def _where(config, sel: Selection, data: TensorDict) -> LossContext:
    denominator = tu.get_non_tensor_data(data=data, key="batch_num_tokens", default=None)
    rows = tu.get_non_tensor_data(data=data, key="global_batch_size", default=None)
    return LossContext(update_pass=update_pass(sel, data), loss_agg_mode=config.loss_agg_mode,
                       denominator=None if denominator is None else float(denominator),
                       global_rows=None if rows is None else int(rows))


def _rule_step(config, sel: Selection, model_output, data: TensorDict, dp_group) -> RuleInput:
    """The rule step on the micro-batch; for a selection measured before the update (``score_source`` prepass or
    rollout), its mask and scores read back from the micro-batch instead of ranked again."""
    measured = sel.score_source != "current"
    if measured and fields.MASK not in data.keys():
        raise RuntimeError(
            f"token_selection.score_source={sel.score_source} but the update micro-batch has no "
            f"'{fields.MASK}' field: the selection that runs before the update (on the driver for "
            "rollout, at the start of each mini-batch for prepass) did not run. It is installed by "
            "python -m verl_tokensel.main_ppo (trainer modes tokensel_*); a custom trainer must keep it."
        )
    batch, padded = unpack_micro_batch(config, sel, model_output, data, rank=not measured,
                                       extra_fields=(fields.MASK, fields.SCORE) if measured else ())
    pair = None
    if measured:
        scores = padded[fields.SCORE] if fields.SCORE in padded.keys() else torch.zeros_like(batch.loss_log_prob)
        pair = (padded[fields.MASK], scores)
    return apply_rule(sel, batch, dp_group=None if measured else dp_group, measured=pair,
                      where=_where(config, sel, data))


def _policy_loss_kwargs(config, sel: Selection, x: RuleInput) -> tuple[dict, dict]:
    """verl's policy-loss keyword arguments carrying the selection (the gated log-prob, the rule's per-token outputs
    applied, finite stand-ins on dropped tokens: masked out, but verl's masked sums would turn NaN x 0 into NaN), and
    the entropy and KL terms' inputs."""
    batch, t = x.batch, x.transform
    log_prob, entropy = batch.loss_log_prob, batch.loss_entropy
    gated = log_prob if t.gate is None else torch.where(t.gate, log_prob, log_prob.detach())
    old, adv, weights = batch.inputs.old_log_prob, batch.advantages, batch.is_weights
    ref = batch.inputs.ref_log_prob if config.use_kl_loss else None
    kl_log_prob = log_prob
    if x.dropped:
        finite = x.tokens | ~batch.valid
        gated = torch.where(finite, gated, 0.0)
        old = torch.where(finite, old, gated.detach())
        adv = torch.where(finite, adv, 0.0)
        weights = None if weights is None else torch.where(finite, weights, 1.0)
        ref = None if ref is None else torch.where(finite, ref, gated.detach())
        entropy = None if entropy is None else torch.where(finite, entropy, 0.0)
        kl_log_prob = torch.where(finite, log_prob, 0.0)
    if t.advantage_weight is not None:
        adv = adv * t.advantage_weight
    if t.advantage_shift is not None:
        adv = adv + t.advantage_shift
    if entropy is not None and sel.mask_entropy_bonus:
        entropy = torch.where(x.mask, entropy, entropy.detach())
    if entropy is not None and t.entropy_weight is not None:
        entropy = entropy * t.entropy_weight
    kwargs = dict(old_log_prob=old, log_prob=gated, advantages=adv, response_mask=x.tokens,
                  loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=weights)
    terms = dict(entropy=entropy, kl_log_prob=gated if sel.mask_kl_loss else kl_log_prob, ref_log_prob=ref)
    return kwargs, terms


def _leave_the_sum(route: str, mode: str, mask: torch.Tensor, kwargs: dict) -> dict:
    """The policy loss's inputs with the unselected tokens' per-token losses out of its sum (normaliser selected /
    kept), by the loss's route (:mod:`~verl_tokensel.core.seam.loss_modes`): the selected tokens as
    ``response_mask``, or every valid token as ``response_mask`` (its own sequence and batch quantities over all of
    them, as stock) and the selection multiplying the per-token loss's ``rollout_is_weights`` or the advantages (0 on
    an unselected token)."""
    if route == "mask":
        return {"response_mask": mask}
    weight = mask.to(kwargs["log_prob"].dtype)
    if route == "weight":
        w = kwargs["rollout_is_weights"]
        return {"rollout_is_weights": weight if w is None else w * weight}
    if route == "advantage":
        return {"advantages": kwargs["advantages"] * weight}
    raise RuntimeError(f"policy_loss.loss_mode={mode} serves only token_selection.normaliser=all (docs/loss-modes.md); "
                       "the config validation refuses the pair, so this config was not validated")


def _selecting_loss(config, sel: Selection, model_output, data: TensorDict, dp_group, observer=None):
    x = _rule_step(config, sel, model_output, data, dp_group)
    if observer is not None:
        observer({"mask": x.mask, "scores": x.scores, "response_mask": x.valid, "data": data,
                  "log_prob": x.batch.loss_log_prob, "advantages": x.advantages})
    kwargs, terms = _policy_loss_kwargs(config, sel, x)

    def policy_loss(info):  # verl's registered loss for loss_mode (only its inputs are ours), or the rule's
        rule_loss = transform_policy_loss(x.transform)
        mode = config.policy_loss.get("loss_mode", "vanilla")
        policy_loss_fn = rule_loss or get_policy_loss_fn(mode)
        saved = info["batch_num_tokens"]
        call = dict(kwargs)
        leave = sel.normaliser == "kept"  # the unselected tokens' per-token losses leave the sum
        if sel.normaliser == "selected":
            n_sel = int(x.mask.sum())
            if n_sel > 0:
                leave = True
                # token-mean divides by batch_num_tokens: n_sel * G / rows makes it the selected mean x rows / G
                info["batch_num_tokens"] = n_sel * _global_responses(data) / int(x.valid.shape[0])
        if leave:
            call.update(_leave_the_sum("mask" if rule_loss is not None else loss_mode(mode).route, mode, x.mask, call))
        try:
            return policy_loss_fn(**call)
        finally:
            info["batch_num_tokens"] = saved

    # normaliser kept: the unselected tokens leave the loss (the pre-pass made the mini-batch's loss_mask the kept
    # tokens, so verl's batch_num_tokens counts them over all ranks)
    loss, metrics = verl_ppo_loss_body(
        config, data, policy_loss, response_mask=x.mask if sel.normaliser == "kept" else x.tokens,
        kl_weight=x.transform.kl_weight, **terms)
    for key, value in x.stats.items():
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


def verl_ppo_loss_body(config, data: TensorDict, policy_loss, *, response_mask, entropy, kl_log_prob, ref_log_prob,
                       kl_weight=None):
    """verl's ``ppo_loss`` after its inputs are padded: global batch info, metric aggregation, the policy loss
    term, the entropy bonus and the KL loss, in verl's order and with verl's metric names.

    ``policy_loss(global_batch_info) -> (pg_loss, pg_metrics)`` calls verl's registered policy loss (the
    selection chooses its log-prob and loss mask); ``entropy`` (or None) and ``kl_log_prob`` are the
    ``(batch, response_len)`` tensors verl's entropy and KL terms would use, already gated by the caller when
    ``mask_entropy_bonus`` / ``mask_kl_loss`` ask for it; ``kl_weight`` (or None) multiplies the per-token KL
    penalty (a rule's per-token KL coefficient; ours, not verl's). Returns ``(loss, metrics)`` as ``ppo_loss`` does.
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
        if kl_weight is not None:
            kld = kld * kl_weight
        kl_loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **info)
        loss += kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics
