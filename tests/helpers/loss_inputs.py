"""Build a micro-batch exactly as verl's engines hand it to the actor loss (no engine needed).

``make_micro_batch`` returns ``(model_output, data)``: ``data`` is a TensorDict in verl's
no-padding layout (``left_right_2_no_padding``) with the driver's PPO fields, and ``model_output``
holds nested ``log_probs`` (a leaf that requires grad, so tests can read d loss / d log_prob)
and ``entropy`` over the full prompt+response sequences, as the engine returns them.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding


def engine_layout(input_ids: torch.Tensor, attn: torch.Tensor, prompt_width: int, **per_token) -> TensorDict:
    """Left-padded prompts + right-padded responses (``(batch, prompt_width + response_width)``) and the
    padded per-token response fields, as the engine's no-padding micro-batch (``left_right_2_no_padding``):
    nested ``input_ids``/``position_ids``, ``prompts``/``responses`` as nested tensors, the fields as given."""
    P = prompt_width
    batch = input_ids.shape[0]
    fields = dict(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        prompts=input_ids[:, :P],
        responses=input_ids[:, P:],
        response_mask=attn[:, P:].clone(),
        **per_token,
    )
    data = left_right_2_no_padding(TensorDict(fields, batch_size=[batch]))
    prompt_attn, resp_attn = attn[:, :P].bool(), attn[:, P:].bool()
    # the engine's no-padding micro-batch carries prompts/responses as nested tensors
    data["prompts"] = torch.nested.as_nested_tensor(
        [input_ids[i, :P][prompt_attn[i]] for i in range(batch)], layout=torch.jagged)
    data["responses"] = torch.nested.as_nested_tensor(
        [input_ids[i, P:][resp_attn[i]] for i in range(batch)], layout=torch.jagged)
    return data


def make_micro_batch(
    batch=4,
    prompt_len=5,
    resp_len=7,
    seed=0,
    extra_pad=0,
    dp_size=1,
    batch_num_tokens=None,
    with_ref=False,
    with_sum_pi_squared=False,
    global_batch_size=None,
):
    g = torch.Generator().manual_seed(seed)
    P, R = prompt_len, resp_len + extra_pad
    prompt_lens = torch.randint(2, prompt_len + 1, (batch,), generator=g)
    resp_lens = torch.randint(2, resp_len + 1, (batch,), generator=g)
    input_ids = torch.zeros(batch, P + R, dtype=torch.long)
    attn = torch.zeros(batch, P + R, dtype=torch.long)
    for i in range(batch):
        pl, rl = int(prompt_lens[i]), int(resp_lens[i])
        input_ids[i, P - pl:P + rl] = torch.randint(3, 100, (pl + rl,), generator=g)
        attn[i, P - pl:P + rl] = 1
    response_mask = attn[:, P:].clone()
    old_lp = -torch.rand(batch, R, generator=g) * 3 * response_mask
    adv = (torch.randn(batch, 1, generator=g).expand(batch, R) * response_mask).contiguous()
    extra = {}
    if with_ref:
        extra["ref_log_prob"] = -torch.rand(batch, R, generator=g) * 3 * response_mask
    data = engine_layout(input_ids, attn, P, old_log_probs=old_lp, advantages=adv, **extra)
    n_tok = int(response_mask.sum())
    # global_batch_size: the mini-batch's responses over all ranks (verl's drivers: ppo_mini_batch_size * rollout.n)
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens or n_tok * dp_size,
                         global_batch_size=global_batch_size or batch * dp_size)
    total = int(attn.sum())
    lp_values = (-torch.rand(total, generator=g) * 3).requires_grad_(True)
    ent_values = torch.rand(total, generator=g) * 2
    offsets = data["input_ids"].offsets()
    model_output = {
        "log_probs": torch.nested.nested_tensor_from_jagged(lp_values, offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(ent_values, offsets),
    }
    if with_sum_pi_squared:
        model_output["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(
            torch.rand(total, generator=g) * 0.5 + 0.3, offsets)
    return model_output, data, lp_values
