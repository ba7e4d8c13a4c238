"""Synthetic PPO update batches shaped like what verl's drivers send to ``update_actor``.

Batch formats (:func:`make_ppo_batch`): ``fmt="v1"`` is what the default TransferQueue driver
(``trainer.use_v1=true``) hands the worker: every per-sample field is a jagged nested tensor (prompts,
responses, response_mask, loss_mask, input_ids, position_ids, old_log_probs, advantages, ...).
``fmt="v0"`` is the legacy ``RayPPOTrainer._update_actor`` path: padded ``DataProto`` fields passed through
``verl.workers.utils.padding.left_right_2_no_padding`` (input_ids/position_ids nested, the rest padded,
``attention_mask`` kept). :func:`add_driver_meta` then adds the non-tensor keys the drivers add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

if TYPE_CHECKING:
    from verl_tokensel_cpu.worker import CpuActor


def _vocab_range(tokenizer_or_vocab) -> tuple[int, int]:
    """Token ids to sample from: skip the special tokens at the start of the tiny vocab."""
    if isinstance(tokenizer_or_vocab, int):
        return 0, tokenizer_or_vocab
    n = len(tokenizer_or_vocab)
    low = max(int(i) for i in tokenizer_or_vocab.all_special_ids) + 1 if tokenizer_or_vocab.all_special_ids else 0
    return (low if low < n else 0), n


def _lengths(spec, n: int, gen: torch.Generator) -> list[int]:
    if isinstance(spec, int):
        return [spec] * n
    if isinstance(spec, list):  # one length per sample
        if len(spec) != n:
            raise ValueError(f"lengths {spec}: need one per sample ({n})")
        return [int(x) for x in spec]
    lo, hi = spec
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


def make_ppo_batch(
    tokenizer_or_vocab: Any,
    n: int = 8,
    prompt_len: int | tuple[int, int] = (3, 8),
    resp_len: int | tuple[int, int] = (2, 10),
    seed: int = 0,
    fmt: str = "v1",
    old_log_probs: Optional[Sequence[torch.Tensor]] = None,
    response_mask_holes: bool = False,
    extra_token_fields: Optional[dict[str, Sequence[torch.Tensor]]] = None,
    group_size: int = 1,
):
    """A synthetic PPO update batch (tensor fields only; add driver meta with :func:`add_driver_meta`).

    ``tokenizer_or_vocab``: a tokenizer (ids sampled outside its special tokens) or a vocab size.
    ``prompt_len``/``resp_len``: an int, a list (one per sample) or an inclusive (lo, hi) range per sample
    (ranges make the nested tensors genuinely jagged, like real rollouts). ``fmt``: "v1" (TransferQueue
    driver, all nested) or "v0" (legacy driver: padded + ``left_right_2_no_padding``). ``old_log_probs``:
    per-sample response log-probs (default: random in [-3, -0.1]; use :func:`compute_old_log_probs` for the real pass).
    ``response_mask_holes``: zero a few response tokens (multi-turn tool tokens). ``extra_token_fields``:
    more per-response-token fields (one 1-D tensor per sample), e.g. a ``token_select_mask``; they are
    nested in v1 and right-padded with 0 in v0, as each driver would store them. ``group_size``: samples
    per prompt (GRPO groups share ``uid`` and prompt).

    Fields: prompts, responses, response_mask, loss_mask (=response_mask), input_ids, position_ids,
    old_log_probs, advantages, returns, token_level_rewards, token_level_scores, uid (non-tensor); v0 also
    attention_mask and the non-tensor max_seq_len, max_response_len, indices.
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    assert fmt in ("v1", "v0"), fmt
    assert n % group_size == 0, (n, group_size)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = _vocab_range(tokenizer_or_vocab)
    n_groups = n // group_size
    p_lens = [pl for pl in _lengths(prompt_len, n_groups, gen) for _ in range(group_size)]
    r_lens = _lengths(resp_len, n, gen)
    group_prompts = [torch.randint(lo, hi, (p_lens[g * group_size],), generator=gen) for g in range(n_groups)]
    prompts = [group_prompts[i // group_size].clone() for i in range(n)]
    responses = [torch.randint(lo, hi, (r,), generator=gen) for r in r_lens]
    response_mask = [torch.ones(r, dtype=torch.int64) for r in r_lens]
    if response_mask_holes:
        for m in response_mask:
            if m.numel() >= 3:
                m[1 : 1 + max(1, m.numel() // 3)] = 0
    if old_log_probs is None:
        old_log_probs = [-(0.1 + 2.9 * torch.rand(r, generator=gen)) for r in r_lens]
    seq_scores = torch.randn(n, generator=gen)
    if group_size > 1:  # GRPO-style normalised outcome advantages
        g = seq_scores.view(n_groups, group_size)
        adv_seq = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
    else:
        adv_seq = seq_scores
    advantages = [torch.full((r,), float(adv_seq[i])) * response_mask[i] for i, r in enumerate(r_lens)]
    token_level_scores = [torch.zeros(r) for r in r_lens]
    for i, r in enumerate(r_lens):
        token_level_scores[i][-1] = seq_scores[i]
    uids = [f"uid-{seed}-{i // group_size}" for i in range(n)]
    extra_token_fields = dict(extra_token_fields or {})
    for k, vals in extra_token_fields.items():
        assert len(vals) == n and all(v.shape[0] == r for v, r in zip(vals, r_lens)), f"bad extra field {k}"

    if fmt == "v1":
        # AgentLoopWorkerTQ._agent_loop_postprocess stores 1-D per-sample tensors; TransferQueue returns
        # them to the worker as jagged nested tensors (list_of_dict_to_tensordict).
        def nt(xs):
            return torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)

        input_ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
        fields = {
            "prompts": nt(prompts),
            "responses": nt(responses),
            "response_mask": nt(response_mask),
            "loss_mask": nt(response_mask),
            "input_ids": nt(input_ids),
            "position_ids": nt(torch.arange(x.numel()) for x in input_ids),
            "old_log_probs": nt(x.float() for x in old_log_probs),
            "advantages": nt(advantages),
            "returns": nt(advantages),
            "token_level_scores": nt(token_level_scores),
            "token_level_rewards": nt(token_level_scores),
        }
        for k, vals in extra_token_fields.items():
            fields[k] = nt(vals)
        td = TensorDict(fields, batch_size=[n])
        td["uid"] = NonTensorStack(*[NonTensorData(u) for u in uids])
        return td

    # v0: DataProto with left-padded prompts and right-padded responses, then left_right_2_no_padding
    from verl.workers.utils.padding import left_right_2_no_padding

    P, R = max(p_lens), max(r_lens)
    pad_id = 0
    prompts_pad = torch.full((n, P), pad_id, dtype=torch.int64)
    prompt_attn = torch.zeros((n, P), dtype=torch.int64)
    resp_pad = torch.full((n, R), pad_id, dtype=torch.int64)
    resp_attn = torch.zeros((n, R), dtype=torch.int64)

    def rpad(xs, dtype=torch.float32):
        out = torch.zeros((n, R), dtype=dtype)
        for i, x in enumerate(xs):
            out[i, : x.numel()] = x.to(dtype)
        return out

    for i in range(n):
        prompts_pad[i, P - p_lens[i] :] = prompts[i]
        prompt_attn[i, P - p_lens[i] :] = 1
        resp_pad[i, : r_lens[i]] = responses[i]
        resp_attn[i, : r_lens[i]] = 1
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    fields = {
        "prompts": prompts_pad,
        "responses": resp_pad,
        "input_ids": torch.cat([prompts_pad, resp_pad], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": rpad(response_mask, torch.int64),
        "old_log_probs": rpad(old_log_probs),
        "advantages": rpad(advantages),
        "returns": rpad(advantages),
        "token_level_scores": rpad(token_level_scores),
        "token_level_rewards": rpad(token_level_scores),
    }
    for k, vals in extra_token_fields.items():
        fields[k] = rpad(vals, vals[0].dtype)
    td = TensorDict(fields, batch_size=[n])
    td["uid"] = NonTensorStack(*[NonTensorData(u) for u in uids])
    return left_right_2_no_padding(td)


def add_driver_meta(
    batch,
    *,
    ppo_mini_batch_size: int,
    rollout_n: int = 1,
    ppo_epochs: int = 1,
    data_loader_seed: int = 42,
    shuffle: bool = False,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    fmt: str = "v1",
    multi_turn: bool = False,
):
    """Add the non-tensor keys a driver's ``_update_actor`` adds before ``update_actor`` (in place).

    Both drivers: calculate_entropy, distillation_use_topk, distillation_only, global_batch_size and
    mini_batch_size (= ppo_mini_batch_size * rollout.n, i.e. GLOBAL over DP), epochs, seed,
    dataloader_kwargs, temperature. v0 additionally: compute_loss, multi_turn and global_token_num (from
    ``fit``). ``train_mini_batch`` pops mini_batch_size/epochs/seed/dataloader_kwargs and adds
    global_token_num/update_lr_scheduler per mini-batch; ``train_batch`` adds use_remove_padding,
    use_dynamic_bsz, max_token_len_per_gpu, micro_batch_size_per_gpu, use_fused_kernels; the engine adds
    sp_size, batch_num_tokens and dp_size.
    """
    from verl.utils import tensordict_utils as tu

    mini = ppo_mini_batch_size * rollout_n
    meta = dict(
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=ppo_epochs,
        seed=data_loader_seed,
        dataloader_kwargs={"shuffle": shuffle},
        temperature=temperature,
    )
    if fmt == "v0":
        meta.update(compute_loss=True, multi_turn=multi_turn)
        seq_lens = batch["input_ids"].offsets().diff().tolist()
        meta["global_token_num"] = seq_lens
    tu.assign_non_tensor(batch, **meta)
    return batch


def add_driver_selection(config, batch, eos_token_id=None):
    """What verl's driver adds for ``score_source=rollout`` (``forking_paper``), in place: the mask and scores
    that :func:`~verl_tokensel.core.driver_select.select_on_driver` computes from the batch's
    old-log-prob values (``old_log_probs``, ``advantages``, ``entropy``, ``uid``), as nested fields; for a score
    that reads the responses (token ids, rewards, EOS: ``ktae``, ``gtpo``), the fields the driver fills from
    ``responses``, ``token_level_rewards`` and ``eos_token_id`` (the tokenizer's).

    ``config`` is the actor's :class:`~verl_tokensel.core.config.TokenSelectConfig`. Returns the driver's
    selection output.
    """
    from verl.workers.utils.padding import response_to_nested

    from verl_tokensel.core import fields
    from verl_tokensel.core.ranking.batch import group_ids
    from verl_tokensel.core.driver_select import score_params, select_on_driver
    from verl_tokensel.verl_glue.rollout_source import response_fields

    padded = batch.select(*fields.LOSS_INPUTS, fields.ENTROPY).to_padded_tensor()
    external = {}
    if any(f in fields.RESPONSE_EXTERNAL for f in config.selection.needs_external):
        width = padded[fields.RESPONSE_MASK].shape[1]
        ids = batch[fields.RESPONSES].to_padded_tensor(0)[:, :width]
        rewards = batch[fields.TOKEN_LEVEL_REWARDS].to_padded_tensor(0.0)[:, :width]
        external = response_fields(config.selection, ids, rewards, padded[fields.RESPONSE_MASK], eos_token_id)
    out = select_on_driver(config.selection, dict(padded.items()), group_ids=group_ids(batch.get(fields.UID).tolist()),
                           params=score_params(config), external=external)
    rm = batch[fields.RESPONSE_MASK]
    batch[fields.MASK] = response_to_nested(out.mask.to(rm.dtype), rm)
    batch[fields.SCORE] = response_to_nested(out.scores, rm)
    return out


def make_update_batch(
    actor: CpuActor,
    n: Optional[int] = None,
    seed: int = 0,
    fmt: str = "v1",
    calculate_entropy: Optional[bool] = None,
    **batch_kwargs,
):
    """:func:`make_config_batch` with the actor's own config and tokenizer. ``n`` defaults to one mini-batch."""
    return make_config_batch(actor.cfg, actor.tokenizer, n=n, seed=seed, fmt=fmt,
                             calculate_entropy=calculate_entropy, **batch_kwargs)


def make_config_batch(
    cfg,
    tokenizer,
    n: Optional[int] = None,
    seed: int = 0,
    fmt: str = "v1",
    calculate_entropy: Optional[bool] = None,
    **batch_kwargs,
):
    """:func:`make_ppo_batch` + :func:`add_driver_meta` with the meta a driver derives from ``cfg``
    (mini-batch size, rollout.n, epochs, seed, shuffle, temperature and ``calculate_entropy``, which
    defaults to ``actor.calculate_entropy or entropy_coeff != 0`` as in verl's drivers)."""
    a = cfg.actor_rollout_ref.actor
    rollout_n = int(cfg.actor_rollout_ref.rollout.n)
    if n is None:
        n = int(a.ppo_mini_batch_size) * rollout_n
    batch = make_ppo_batch(tokenizer, n=n, seed=seed, fmt=fmt, **batch_kwargs)
    if calculate_entropy is None:
        calculate_entropy = bool(a.calculate_entropy or a.entropy_coeff != 0)
    return add_driver_meta(
        batch,
        ppo_mini_batch_size=int(a.ppo_mini_batch_size),
        rollout_n=rollout_n,
        ppo_epochs=int(a.ppo_epochs),
        data_loader_seed=int(a.data_loader_seed),
        shuffle=bool(a.shuffle),
        temperature=float(cfg.actor_rollout_ref.rollout.temperature),
        calculate_entropy=calculate_entropy,
        fmt=fmt,
    )
