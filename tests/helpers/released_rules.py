"""Lp-Reg and SimKO as their releases compute them, in plain torch, for the parity tests (no verl, no project import).

Restated from the released code, not copied. Each function works on one micro-batch and on FULL logits, so a test can
feed a small vocabulary.

Lp-Reg (arXiv 2510.03222), CarlanLark/Lp-Reg-dev @ 33b27e2:
- scripts ``recipe/lp_reg/{Qwen2.5_32b,Qwen3_14b}_lp_reg_{offpolicy,onpolicy}_64gpu.sh``: kappa
  (``minp_p_threshold``) 0.02; rho (``logp_neg_k_percent``) 0.005 for Qwen2.5-32B, 0.01 for Qwen3-14B;
  ``logp_pos_k_percent`` 0 (the A>0 branch never fires: k = max(1, 0) = 1 fails the k > 1 gate); beta
  (``ppo_kl_coef``) 1; ``kl_type`` low_var_kl; ``minp_old_log_prob`` True; ``regular_type`` minp, ``minp_soft`` False
  (yaml defaults); clip_ratio_low 1.0, clip_ratio_high 9.0, ``clip_ratio_c`` 10.0; token-mean; temperature 1.0,
  top_p 1.0; entropy_coeff 0; no KL loss, no KL in reward; GRPO, n 8, 256 prompts a step, mini-batch 32 prompts
  (offpolicy, 8 updates a step) or 256 (onpolicy, 1 update); lr 1e-6, wd 0, grad_clip 1.0; ``use_dynamic_bsz`` True
  with 30720 tokens a GPU (so a "micro-batch" is a token-budget micro-batch; ``ppo_micro_batch_size_per_gpu=2`` is
  unused); max response 8192. ``use_clip`` and ``dynamic_coef`` are passed but no Python code reads them.
- proxy: an extra no-grad forward, ``fsdp_workers.compute_minp_log_prob``, run right after the old-log-prob pass on
  the same weights (so: the old policy). ``dp_actor.apply_min_p`` filters on softmax(RAW logits) (temperature not
  applied): p < kappa * p_max -> logit -1e4. Then the filtered logits are divided by the temperature (the -1e4 too)
  and the log-softmax is read at the sampled token. A filtered sampled token gets about -1e4 / T, so it is never
  regularised. log_prob / old_log_prob are log_softmax(logits / T) at the sampled token.
- loss (``core_algos.compute_policy_loss_lp_reg``): every token gets max(-A r, -A clamp(r, 1 - low, 1 + high)),
  NO dual clip (``clip_ratio_c`` is read in ``dp_actor.update_policy`` but never passed; the dual-clip lines are
  commented out). With low 1.0 / high 9.0: A < 0 tokens are never clipped, A > 0 tokens are capped at r = 10.
  Regularised tokens are overwritten with -A r + beta * clamp(k3, -10, 10), k3 = exp(lp_proxy - lp) - (lp_proxy - lp)
  - 1 (no clip on r). Token-mean: sum / (mask.sum() + 1e-8). The micro-batch loss is then scaled by
  len(micro) / ppo_mini_batch_size (dynamic bsz) before backward; that scaling is not restated here.

SimKO (arXiv 2510.14807), CLR-Lab/SimKO @ 306f4ff:
- scripts ``run_qwen2.5-math-7b_SimKO.sh``, ``run_llama3.2-3b_SimKO.sh``: ``top_k`` K 3, ``tau`` (quantile) 0.8,
  ``mix_topk_coef`` c 0.01; the 1.1 negative scale is hard-coded; ``clip_ratio`` 0.2 (yaml default, symmetric, no
  dual clip); rollout temperature 1.0 (default); GRPO, n 8, 1024 prompts a step, mini-batch 256; dynamic bsz 12000
  tokens a GPU; lr 1e-6; kl_coef 0, no KL loss. entropy_coeff: Llama script 0, Qwen script unset -> yaml 0.001, but
  the entropy is detached in the SimKO path, so the bonus shifts the loss value and gives no gradient.
- temperature: ``dp_actor._forward_micro_batch`` divides the logits by T first; entropy, log-probs, argmax and top-K
  all come from the scaled logits. Top-K log-probs are the full-vocab log-softmax read at the K largest logits (not
  renormalised over K), with grad in the update pass.
- old top-K: from the old-log-prob pass itself (``compute_log_prob(simko=True)``, batch key ``old_log_probs_topk``),
  the old policy's own top-K tokens; no extra forward. Current and old j-th top tokens need not be the same token.
- "correct": ``token_level_scores.sum(-1) == 1`` (reward-function scores, 1.0 right / 0 wrong, before any KL).
  Negative responses: ``advantages.sum(-1) < 0``. "argmax": sampled token == argmax of the CURRENT scaled logits.
  Hot: CURRENT entropy (detached) strictly above the response's masked ``torch.quantile`` (linear); a response with
  no valid token takes the quantile over all its positions.
- loss value and clip decisions equal plain PPO's up to rounding: each carrier's value is
  r * exp(d_j) / (exp(d_j) + 1e-8). Masked mean WITHOUT eps: an all-masked micro-batch gives NaN.
"""

from __future__ import annotations

import torch

# The released scripts' values (Lp-Reg: Qwen3-14B; rho is 0.005 for Qwen2.5-32B).
LP_REG_SCRIPT = dict(kappa=0.02, temperature=1.0, rho=0.01, beta=1.0, clip_ratio_low=1.0, clip_ratio_high=9.0)
SIMKO_SCRIPT = dict(k=3, temperature=1.0, c=0.01, neg_scale=1.1, quantile=0.8, clip_ratio=0.2)


@torch.no_grad()
def lp_reg_proxy_log_prob(old_logits, tokens, kappa, temperature):
    """(B, T, V) raw old logits, (B, T) sampled tokens -> (B, T) proxy log-prob, no grad.

    ``dp_actor.apply_min_p`` (regular_type minp, hard) then ``_forward_micro_batch``'s ``div_(temperature)`` and
    ``logprobs_from_logits``, as called by ``fsdp_workers.compute_minp_log_prob``."""
    p = old_logits.softmax(-1)
    filtered = old_logits.masked_fill(p < kappa * p.amax(-1, keepdim=True), -1e4)
    return (filtered / temperature).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def lp_reg_loss(log_prob, old_log_prob, proxy_log_prob, advantages, response_mask, *, rho, beta, clip_ratio_low,
                clip_ratio_high, rho_pos=0.0):
    """One micro-batch's Lp-Reg loss -> (scalar loss, (B, T) bool regularised mask).

    ``core_algos.compute_policy_loss_lp_reg`` with kl_type low_var_kl, loss_agg_mode token-mean. All (B, T);
    ``proxy_log_prob`` serves both branches (``minp_old_log_prob=True``). ``rho_pos`` is ``logp_pos_k_percent``
    (0 in the scripts). Ties among the lowest log-probs go as ``topk`` picks them: tests should avoid ties."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high))
    valid = response_mask > 0
    lp = log_prob.detach()
    regularised = torch.zeros_like(valid)
    for sign, share in ((1, rho_pos), (-1, rho)):
        idx = (valid & (sign * advantages > 0)).flatten().nonzero().squeeze(-1)  # flat order, as the release
        k = max(1, int(len(idx) * share))
        if len(idx) == 0 or k <= 1:  # the release's gate: one candidate is no candidate
            continue
        candidates = torch.zeros_like(valid).flatten()
        candidates[idx[lp.flatten()[idx].topk(k, largest=False).indices]] = True
        regularised |= candidates.view_as(valid) & (lp < proxy_log_prob)
    pg_losses = pg_losses.clone()
    kl = proxy_log_prob[regularised] - log_prob[regularised]  # written only where regularised, as the release
    k3 = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    pg_losses[regularised] = -advantages[regularised] * ratio[regularised] + beta * k3
    mask = response_mask.to(pg_losses.dtype)
    return (pg_losses * mask).sum() / (mask.sum() + 1e-8), regularised


def row_quantile_masked(x, mask, q):
    """(B, T), (B, T) bool -> (B,): per row, ``torch.quantile`` (linear) of the masked entries, or of the whole row
    when none is masked in. ``core_algos.row_quantile_masked``."""
    rows = [x[b][mask[b]] if mask[b].any() else x[b] for b in range(x.shape[0])]
    return torch.stack([torch.quantile(row, q) for row in rows])


def simko_top_k_log_probs(logits, k, temperature):
    """(..., V) raw logits -> (..., k): full-vocab log-softmax of logits / T at the k largest, with grad.

    ``dp_actor._forward_micro_batch(simko=True)``: ``topk`` of the detached scaled logits, ``logprobs_from_logits``
    on K copies of the row."""
    scaled = logits / temperature
    return scaled.log_softmax(-1).gather(-1, scaled.detach().topk(k, dim=-1).indices)


def simko_forward(logits, tokens, k, temperature):
    """(B, T, V) raw logits, (B, T) tokens -> log_prob, entropy (detached), is_argmax, top_k_log_prob.

    ``dp_actor._forward_micro_batch(simko=True)``. Under ``torch.no_grad`` on the old logits this is the old-log-prob
    pass (``old_log_probs``, ``old_log_probs_topk``); on the current logits it is the update pass."""
    scaled = logits / temperature
    log_prob = scaled.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(scaled, -1) - (scaled.softmax(-1) * scaled).sum(-1)  # verl_F.entropy_from_logits
    is_argmax = scaled.argmax(-1) == tokens
    return log_prob, entropy.detach(), is_argmax, simko_top_k_log_probs(logits, k, temperature)


def simko_loss(log_prob, old_log_prob, top_k_log_prob, old_top_k_log_prob, entropy, is_argmax, advantages,
               response_mask, correct, *, c, neg_scale, quantile, clip_ratio):
    """One micro-batch's SimKO policy loss (``core_algos.compute_policy_loss_simko``) -> scalar.

    (B, T) tensors, (B, T, K) top-K log-probs (K read from the shape, as released), ``correct`` (B,) bool. Returns the
    pg loss only (the release subtracts entropy_coeff * masked_mean(detached entropy): no gradient).
    The release's bug, NOT reproduced: ``if correct_idx.size(0) == T`` it lays the per-response flag along time
    (``correct_mask[b, t] = correct[t]``), so a micro-batch of B == padded response length mixes the wrong tokens."""
    valid = response_mask > 0
    K = top_k_log_prob.size(-1)
    d = log_prob - old_log_prob
    d_top = top_k_log_prob - old_top_k_log_prob  # current j-th top vs the OLD policy's own j-th top
    carriers = d.detach().exp().unsqueeze(-1) / (d_top.detach().exp() + 1e-8) * d_top.exp()
    entropy = entropy.detach()
    hot = entropy > row_quantile_masked(entropy, valid, quantile).view(-1, 1)
    mix = c * (hot & valid).float()  # float32 whatever the inputs' dtype: the release's ``w = (...).float()``
    ratio = torch.where(correct.view(-1, 1) & valid, (1 - mix) * d.exp() + mix / K * carriers.sum(-1), d.exp())
    neg = (advantages.sum(-1, keepdim=True) < 0) & is_argmax & hot
    advantages = advantages * torch.ones_like(advantages).masked_fill(neg, neg_scale)
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    mask = response_mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum()
