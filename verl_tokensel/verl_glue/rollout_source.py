"""``token_selection.score_source=rollout`` in verl's two drivers: the driver selects, the workers apply.

Per step, after verl's old-log-prob pass and the advantages and right before ``update_actor``, the driver reads the
padded per-token fields of the whole batch, runs :func:`~verl_tokensel.core.driver_select.select_on_driver`
and sends the mask and scores as per-token fields keyed by row (:data:`~verl_tokensel.core.fields.MASK`,
:data:`~verl_tokensel.core.fields.SCORE`), so verl's row moves (balancing, DP dispatch, shuffling, dynamic
batching) carry the mask with its row. V1 driver: :meth:`DriverSelector.select_v1` through TransferQueue (the
field names are added to ``KVBatchMeta.fields``: workers fetch only listed fields). v0 driver:
:mod:`~verl_tokensel.verl_glue.v0`.
The ``ref_entropy`` score's field comes from a :class:`~verl_tokensel.analysis.ray_scorer.RayScorerGroup`; the
response fields (:data:`~verl_tokensel.core.fields.RESPONSE_EXTERNAL`: token ids, outcome reward, EOS) from the
batch's ``responses`` and ``token_level_rewards`` and the trainer's tokenizer (:meth:`DriverSelector.response_fields`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from verl_tokensel.core import fields
from verl_tokensel.core.ranking.batch import group_ids, row_keys
from verl_tokensel.core.resolve.selection import Selection
from verl_tokensel.verl_glue.actor_config import actor_selection
from verl_tokensel.verl_glue.errors import config_error_at
from verl_tokensel.core.driver_select import (
    DriverSelection,
    score_params,
    select_on_driver,
)

logger = logging.getLogger(__name__)

# external per-token fields this module knows how to fill (see ScoreSpec.needs_external)
DRIVER_EXTERNAL_FIELDS = ("ref_entropy", *fields.RESPONSE_EXTERNAL)


def rollout_selection(config: DictConfig) -> Optional[Selection]:
    """The resolved rule when ``score_source=rollout`` (None otherwise or for stock configs)."""
    sel = actor_selection(config)
    return sel if sel is not None and sel.score_source == "rollout" else None


def _bypass_mode(config: DictConfig) -> bool:
    return bool(OmegaConf.select(config, "algorithm.rollout_correction.bypass_mode", default=False))


def check_bypass_mode(config: DictConfig, sel: Optional[Selection]) -> None:
    """Bypass mode (``algorithm.rollout_correction.bypass_mode=True``) skips verl's old-log-prob pass and sets
    ``old_log_probs = rollout_log_probs``: refused for a selection that reads that pass (the old-policy entropy a
    driver-side score ranks by; ``old_log_probs`` beside ``rollout_log_probs`` for a score comparing the two).
    Raises :class:`~verl_tokensel.core.errors.TokenSelectionConfigError` naming the key, the value and the fix."""
    if sel is None or not _bypass_mode(config):
        return
    reads = []
    if sel.score_source == "rollout" and sel.score_needs_entropy:
        reads.append("the old-policy entropy, which score_source=rollout ranks by")
    if sel.needs_rollout_log_probs:
        reads.append("old_log_probs beside rollout_log_probs, which its score compares (in bypass mode they are one "
                     "policy: a score of 0 on every token)")
    if any(s.forward == "old" for s in sel.impl.needs.vocab):
        reads.append(f"the old policy's per-token reductions over the vocabulary that rule {sel.rule} reads "
                     "(Needs(vocab=...))")
    if not reads:
        return
    selector = OmegaConf.select(config, "actor_rollout_ref.actor.token_selector", default=None)
    raise config_error_at(
        "algorithm.rollout_correction.bypass_mode", True, "False",
        f"Bypass mode skips verl's old-log-prob pass and sets old_log_probs = rollout_log_probs, but "
        f"actor_rollout_ref.actor.token_selector={selector} reads from that pass {' and '.join(reads)}. Fix: "
        "algorithm.rollout_correction.bypass_mode=False, or a token selection that reads neither "
        "(token_selection.score_source=current, or a score without entropy: random, grad_norm, ref_entropy).")


def validate_rollout_config(config: DictConfig, selection: Optional[Selection] = None) -> None:
    """Driver checks of ``score_source=rollout`` against keys outside the actor node (before Ray starts).

    ``selection``: the config's resolved rule when the caller has it (else resolved here). Raises
    :class:`~verl_tokensel.core.errors.TokenSelectionConfigError` naming the key and its valid values (bypass mode:
    :func:`check_bypass_mode`).
    """
    sel = rollout_selection(config) if selection is None else selection
    if sel is None or sel.score_source != "rollout":
        return
    unknown = [f for f in sel.needs_external if f not in DRIVER_EXTERNAL_FIELDS]
    if unknown:
        raise config_error_at(
            "actor_rollout_ref.actor.token_selection.score", sel.score,
            "a score whose per-token fields the driver fills (with score_source=rollout)",
            f"The score needs the per-token field(s) {unknown}, which the driver cannot compute (it fills "
            f"{', '.join(DRIVER_EXTERNAL_FIELDS)}). Fix: pick another score or fill the field in your own glue.")
    if sel.uses_sum_pi_squared and not _bypass_mode(config) and OmegaConf.select(
            config, "actor_rollout_ref.model.use_fused_kernels", default=False):
        raise config_error_at(
            "actor_rollout_ref.model.use_fused_kernels", True, "False",
            f"token_selection.score={sel.score} with score_source=rollout reads sum_j p_j^2 from the "
            "old-log-prob pass, which verl's engines refuse to compute with fused kernels. Fix: "
            "actor_rollout_ref.model.use_fused_kernels=False, or another score.")


def prepare_rollout_config(config: DictConfig) -> None:
    """In place: ask verl's v0 old-log-prob pass for sum_j p_j^2 when the score reads it.

    ``actor.calculate_sum_pi_squared`` is read only by the v0 driver's old-log-prob pass (the V1
    driver never reads it; :meth:`DriverSelector.old_pass_extra_info` asks for it there).
    """
    sel = rollout_selection(config)
    if sel is None or not sel.uses_sum_pi_squared or _bypass_mode(config):
        return
    with open_dict(config):
        config.actor_rollout_ref.actor.calculate_sum_pi_squared = True


class RefEntropyScorer:
    """The ``ref_entropy`` field: per-token entropy of a reference model, by a Ray scorer group.

    The model is ``token_selection.ref_model_path`` or ``actor_rollout_ref.model.path`` (the base model
    the run starts from). With verl's CPU platform one CPU worker; on GPU clusters one worker per GPU
    bundle of the actor pool's first placement group, with a tenth of that GPU (verl's colocated workers
    take ``1 / max_colocate_count`` of a bundle each), so nothing waits for a GPU the trainer holds; the
    model then stays resident next to the actor (bf16 weights). The entropy is of the temperature-scaled
    distribution, like verl's old-policy entropy.
    """

    def __init__(self, model_path: str, temperature: float, trainer: Any = None, num_workers: int = 1):
        import ray

        from verl_tokensel.analysis.ray_scorer import RayScorerGroup
        from verl_tokensel.switches import cpu_platform_requested

        kwargs: dict[str, Any] = {}
        if cpu_platform_requested():  # verl's CPU platform: Ray's "GPU" resource is logical, the model runs on CPU
            kwargs["device"] = "cpu"
        elif ray.cluster_resources().get("GPU", 0) >= 1:
            pgs = _actor_placement_groups(trainer)
            if pgs:  # one scorer per GPU bundle of the first node's placement group
                num_workers = max(num_workers, int(pgs[0].bundle_count))
                kwargs.update(placement_group=pgs[0], resources={"num_gpus": 0.1, "num_cpus": 0})
        self.group = RayScorerGroup(model_path, num_workers=num_workers, temperature=temperature, **kwargs)
        self.model_path = model_path

    def __call__(self, prompts: list[torch.Tensor], responses: list[torch.Tensor], width: int) -> torch.Tensor:
        pairs = [(p.tolist(), r.tolist()) for p, r in zip(prompts, responses)]
        out = torch.zeros(len(pairs), width, dtype=torch.float32)
        for i, s in enumerate(self.group.score(pairs)):
            n = min(width, s.entropy.numel())
            out[i, :n] = s.entropy[:n].float()
        return out

    def shutdown(self) -> None:
        self.group.shutdown()


def column_as_list(values) -> list:
    """Plain Python list of a non-tensor column (NonTensorStack, numpy array or list)."""
    if hasattr(values, "tolist"):
        return list(values.tolist())
    return [getattr(v, "data", v) for v in values]


def _actor_placement_groups(trainer: Any) -> list:
    try:
        from verl.trainer.ppo.utils import Role

        pool = trainer.resource_pool_manager.get_resource_pool(Role.ActorRollout)
        return list(pool.pgs or [])
    except Exception:  # noqa: BLE001 - any layout we do not know: fall back to Ray's own scheduling
        return []


def _width(t: torch.Tensor, width: int) -> torch.Tensor:
    """A padded ``(batch, n)`` tensor cut or zero-padded to ``width`` columns (the response mask's)."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def response_fields(sel: Selection, responses: torch.Tensor, rewards: Optional[torch.Tensor],
                    response_mask: torch.Tensor, eos_token_id: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The response fields (:data:`~verl_tokensel.core.fields.RESPONSE_EXTERNAL`) the selection's score names,
    from padded ``(batch, response_len)`` token ids and per-token rewards (``token_level_rewards``, summed over each
    response's valid tokens, as verl's outcome estimators do); ``eos_token_id``: the tokenizer's."""
    need = sel.needs_external
    out: dict[str, torch.Tensor] = {}
    ids = responses.to(torch.int64)
    valid = response_mask.to(torch.bool)
    if fields.RESPONSE_IDS in need:
        out[fields.RESPONSE_IDS] = ids
    if fields.EOS_TOKEN in need:
        if eos_token_id is None:
            raise ValueError(f"token_selection.score={sel.score} reads the tokenizer's eos_token_id; none given")
        out[fields.EOS_TOKEN] = (ids == int(eos_token_id)) & valid
    if fields.SEQUENCE_REWARD in need:
        if rewards is None:
            raise RuntimeError(f"token_selection.score={sel.score} reads the responses' rewards, but the update "
                               f"batch has no '{fields.TOKEN_LEVEL_REWARDS}' field")
        total = (rewards.float() * valid).sum(-1, keepdim=True)
        out[fields.SEQUENCE_REWARD] = total.expand_as(ids).contiguous()
    return out


class DriverSelector:
    """Per-trainer state of the driver-side selection (the rule, clip/KL parameters, the ref scorer)."""

    def __init__(self, config: DictConfig, sel: Selection, trainer: Any = None):
        self.config = config
        self.sel = sel
        self.params = score_params(config.actor_rollout_ref.actor)
        self.trainer = trainer
        self._ref_scorer: Optional[RefEntropyScorer] = None
        self._warned_sp2 = False
        self._eos_token_id: Optional[int] = None

    @classmethod
    def from_config(cls, config: DictConfig, trainer: Any = None) -> Optional["DriverSelector"]:
        sel = rollout_selection(config)
        return None if sel is None else cls(config, sel, trainer)

    # ------------------------------------------------------------------ shared
    def old_pass_extra_info(self) -> dict[str, Any]:
        """Extra flags for the old-log-prob pass (V1 driver)."""
        return {"calculate_sum_pi_squared": True} if self.sel.uses_sum_pi_squared else {}

    @property
    def needs_responses(self) -> bool:
        """The score reads the batch's token ids or rewards (:data:`~verl_tokensel.core.fields.RESPONSE_EXTERNAL`)."""
        return any(f in fields.RESPONSE_EXTERNAL for f in self.sel.needs_external)

    def eos_token_id(self) -> int:
        """The trainer's tokenizer's ``eos_token_id`` (verl's trainers hold it; else the model path's tokenizer)."""
        if self._eos_token_id is None:
            tokenizer = getattr(self.trainer, "tokenizer", None)
            if tokenizer is None:
                from verl.utils import hf_tokenizer

                tokenizer = hf_tokenizer(self.config.actor_rollout_ref.model.path)
            eos = tokenizer.eos_token_id
            if eos is None:
                raise config_error_at(
                    "actor_rollout_ref.model.path", self.config.actor_rollout_ref.model.path,
                    "a model whose tokenizer has an eos_token_id",
                    f"token_selection.score={self.sel.score} reads it (the EOS token's exclusion). Fix: set the "
                    "tokenizer's eos_token, or switch the exclusion off in the rule's knobs.")
            self._eos_token_id = int(eos)
        return self._eos_token_id

    def response_fields(self, responses: torch.Tensor, rewards: Optional[torch.Tensor],
                        response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """:func:`response_fields` of this selection (the EOS id: the trainer's tokenizer's)."""
        eos = self.eos_token_id() if fields.EOS_TOKEN in self.sel.needs_external else None
        return response_fields(self.sel, responses, rewards, response_mask, eos)

    def external_fields(self, prompts, responses, width: int) -> dict[str, torch.Tensor]:
        if "ref_entropy" not in self.sel.needs_external:
            return {}
        if self._ref_scorer is None:
            path = self.sel.ref_model_path or self.config.actor_rollout_ref.model.path
            self._ref_scorer = RefEntropyScorer(path, float(self.config.actor_rollout_ref.rollout.temperature),
                                                trainer=self.trainer)
        return {"ref_entropy": self._ref_scorer(prompts, responses, width)}

    def select_rows(self, padded: dict[str, torch.Tensor], uids, keys, row_valid, external) -> DriverSelection:
        if self.sel.uses_sum_pi_squared and padded.get("sum_pi_squared") is None and not self._warned_sp2:
            self._warned_sp2 = True
            logger.warning("verl-tokensel: score %s without sum_j p_j^2 from the old-log-prob pass (bypass mode?): "
                           "using its (1 - p_a) lower bound", self.sel.score)
        tensors = {k: padded.get(k) for k in fields.DRIVER_INPUTS}
        if not self.params["kl_coef"]:
            tensors[fields.REF_LOG_PROB] = None
        return select_on_driver(self.sel, tensors, keys=keys,
                                group_ids=group_ids(uids) if self.sel.scope == "group" else None,
                                row_valid=row_valid, external=external, params=self.params)

    # ------------------------------------------------------------------ V1 (TransferQueue)
    def select_v1(self, batch, metrics: dict):
        """Compute the mask of a V1 update batch and store it in TransferQueue; returns ``batch``
        with the two field names added to ``batch.fields``."""
        import transfer_queue as tq
        from tensordict import TensorDict

        from verl.workers.utils.padding import response_from_nested, response_to_nested

        t0 = time.time()
        names = [fields.UID, *fields.LOSS_INPUTS, fields.ENTROPY, fields.ROLLOUT_IS_WEIGHTS]
        if self.params["kl_coef"]:
            names.append(fields.REF_LOG_PROB)
        if self.sel.uses_sum_pi_squared:
            names.append(fields.SUM_PI_SQUARED)
        if self.sel.needs_row_keys:
            names.append("input_ids")
        if self.sel.needs_external:
            names += ["prompts", "responses"]  # the reference model's input, or the response fields
        if fields.SEQUENCE_REWARD in self.sel.needs_external:  # as verl's V1 driver: rm_scores, less any KL in reward
            names += [fields.TOKEN_LEVEL_REWARDS, fields.RM_SCORES]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=names)
        nested_rm = data[fields.RESPONSE_MASK]
        uids = column_as_list(data[fields.UID])
        per_token = [k for k in fields.DRIVER_INPUTS if k != fields.SUM_PI_SQUARED and k in data.keys()]
        padded = dict(data.select(*per_token).to_padded_tensor().items())
        if fields.SUM_PI_SQUARED in data.keys():  # whole-sequence output of the old pass, as the engine wrote it
            sp2 = response_from_nested(data[fields.SUM_PI_SQUARED], nested_rm)
            padded[fields.SUM_PI_SQUARED] = sp2.to_padded_tensor(0.0)
        width = padded[fields.RESPONSE_MASK].shape[1]
        keys = row_keys(data["input_ids"]) if "input_ids" in data.keys() else None
        external = {}
        if "ref_entropy" in self.sel.needs_external:
            external = self.external_fields(data["prompts"].unbind(), data["responses"].unbind(), width)
        if self.needs_responses:
            reward_key = next((k for k in (fields.TOKEN_LEVEL_REWARDS, fields.RM_SCORES) if k in data.keys()), None)
            rewards = None if reward_key is None else data[reward_key].to_padded_tensor(0.0)
            external.update(self.response_fields(_width(data["responses"].to_padded_tensor(0), width),
                                                 None if rewards is None else _width(rewards, width),
                                                 padded[fields.RESPONSE_MASK]))
        row_valid = torch.tensor([not t.get("is_padding", False) for t in batch.tags], dtype=torch.bool)
        result = self.select_rows(padded, uids, keys, row_valid, external)

        out = TensorDict(
            {fields.MASK: response_to_nested(result.mask, nested_rm),
             fields.SCORE: response_to_nested(result.scores, nested_rm)},
            batch_size=len(batch.keys),
        )
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)
        if batch.fields is not None:  # the workers fetch only the listed fields
            batch.fields = list(dict.fromkeys([*batch.fields, fields.MASK, fields.SCORE]))
        metrics.update(result.metrics)
        metrics["timing_s/tokensel_driver_select"] = time.time() - t0
        return batch

    def shutdown(self) -> None:
        if self._ref_scorer is not None:
            self._ref_scorer.shutdown()
            self._ref_scorer = None


__all__ = [
    "DRIVER_EXTERNAL_FIELDS",
    "DriverSelector",
    "RefEntropyScorer",
    "check_bypass_mode",
    "prepare_rollout_config",
    "response_fields",
    "rollout_selection",
    "validate_rollout_config",
]
