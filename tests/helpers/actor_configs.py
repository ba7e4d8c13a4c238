"""Actor configs from verl's own Hydra tree and near-on-policy micro-batches, for the loss-level tests.

Configs: verl's ``ppo_trainer`` (or ``ppo_megatron_trainer``) tree composed with
``initialize_config_module("verl.trainer.config")`` and converted by verl's ``omega_conf_to_dataclass``: stock
``FSDPActorConfig`` for the reference, ``TokenselFSDPActorConfig`` (``_target_`` swapped, plus ``token_selector``
/ ``token_selection``) for ours.
"""

from __future__ import annotations

import copy

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPActorConfig
from verl.workers.utils.padding import no_padding_2_padding

from verl_tokensel.verl_glue.actor_config import TokenselFSDPActorConfig, TokenselMcoreActorConfig

from helpers.loss_inputs import make_micro_batch

OUR_ACTOR = "verl_tokensel.verl_glue.actor_config.TokenselFSDPActorConfig"
OUR_MCORE_ACTOR = "verl_tokensel.verl_glue.actor_config.TokenselMcoreActorConfig"
SELECTION_TARGET = "verl_tokensel.core.config.TokenSelectionConfig"


# --------------------------------------------------------------------------------------------
# configs from verl's own Hydra tree
# --------------------------------------------------------------------------------------------
_TREES: dict[str, object] = {}
_CONFIGS: dict[str, object] = {}


def _tree(name: str):
    if name not in _TREES:
        with initialize_config_module("verl.trainer.config", version_base=None):
            _TREES[name] = compose(name)
    return _TREES[name]


def actor_config(selector=None, selection=None, *, megatron=False, fresh=False, **actor):
    """Stock actor config when ``selector`` is None, else ours with ``token_selector=selector``.

    ``actor``: extra ``actor_rollout_ref.actor.*`` keys (use_kl_loss, entropy_coeff, ...).
    """
    key = repr((selector, sorted((selection or {}).items()), megatron, sorted(actor.items())))
    if not fresh and key in _CONFIGS:
        return _CONFIGS[key]
    cfg = copy.deepcopy(_tree("ppo_megatron_trainer" if megatron else "ppo_trainer"))
    node = cfg.actor_rollout_ref.actor
    with open_dict(node):
        if not megatron:
            node.strategy = "fsdp2"
        node.ppo_micro_batch_size_per_gpu = 2
        for k, v in actor.items():  # dotted keys reach nested nodes (policy_loss.loss_mode)
            OmegaConf.update(node, k, v, merge=True)
        if selector is not None:
            node._target_ = OUR_MCORE_ACTOR if megatron else OUR_ACTOR
            node.token_selector = selector
            node.token_selection = {"_target_": SELECTION_TARGET, **(selection or {})}
    out = omega_conf_to_dataclass(node)
    if selector is None:
        assert type(out) is FSDPActorConfig or megatron
    else:
        assert type(out) is (TokenselMcoreActorConfig if megatron else TokenselFSDPActorConfig)
    if not fresh:
        _CONFIGS[key] = out
    return out


# --------------------------------------------------------------------------------------------
# micro-batches and helpers
# --------------------------------------------------------------------------------------------
def micro_batch(seed=0, batch=6, resp_len=16, noise=0.15, with_ref=False, **kw):
    """A micro-batch from tests/helpers/loss_inputs.py, made near on-policy: old_log_probs = log_prob + noise,
    so that most tokens are unclipped (omega != 0) and some are clipped (omega == 0)."""
    mo, data, lp = make_micro_batch(batch=batch, resp_len=resp_len, seed=seed, with_ref=with_ref, **kw)
    # the drivers also send the global batch size (seq-mean-* modes need it when dp_size > 1)
    tu.assign_non_tensor(data, global_batch_size=batch * data["dp_size"])
    g = torch.Generator().manual_seed(1000 + seed)
    lp_pad = no_padding_2_padding(mo["log_probs"], data).detach()
    rm = data["response_mask"].to(lp_pad.dtype)
    data["old_log_probs"] = (lp_pad + torch.randn(lp_pad.shape, generator=g) * noise) * rm
    if with_ref:
        data["ref_log_prob"] = (lp_pad + torch.randn(lp_pad.shape, generator=g) * 0.5) * rm
    return mo, data, lp


def padded(values: torch.Tensor, data) -> torch.Tensor:
    """Per-token values over the full sequences (log-prob layout) -> (batch, response_len)."""
    return no_padding_2_padding(values, data)
