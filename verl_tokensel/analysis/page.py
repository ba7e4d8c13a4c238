"""The HTML page of scored responses with a preset's selection marked (``verl-tokensel view``, the demo).

The selection is the training code's (:mod:`verl_tokensel.analysis.training_masks`); the page itself is rendered
by :mod:`verl_tokensel.analysis.html`.
"""

from __future__ import annotations

import torch

from verl_tokensel.analysis.html import PageInfo, ResponseView, TokenView, render_page
from verl_tokensel.analysis.training_masks import scored_batch, select_preset
from verl_tokensel.core.ranking.scopes import budget

SHADE_HELP = {
    "entropy": "H_t (nats) of the policy at the token",
    "logp": "log p(a_t); dark = low = surprising",
    "grad_norm": "|A| * ||e_a - p||: exact logit-gradient norm of the token's loss (on-policy)",
    "gmts": "H_t * |A| (GMTS delta, on-policy)",
    "random": "the seeded uniform draw of the random control",
}

#: where a preset's budget is taken from in training (``token_selection.scope``), in words
TRAINING_SCOPE = {
    "micro_batch": "each micro-batch on each rank",
    "micro_batch_dp": "each micro-batch, exact over all data-parallel ranks",
    "sequence": "each response on its own",
    "mini_batch": "the whole PPO mini-batch, exact over all data-parallel ranks",
    "group": "each prompt group (the responses sharing a prompt)",
    "batch": "the whole training batch of a step",
}
#: when the scores are measured in training (``token_selection.score_source``)
TRAINING_SOURCE = {
    "current": "the update forward of each micro-batch",
    "prepass": "a no-grad forward at the start of each PPO mini-batch, before its updates",
    "rollout": "verl's old-policy pass, ranked on the driver over the whole batch",
}
#: the token-mean's denominator in training (``token_selection.normaliser``)
TRAINING_NORMALISER = {
    "all": "all valid tokens (the paper formula; the others contribute zero)",
    "selected": "each micro-batch's selected tokens, weighted by its share of the mini-batch's responses",
    "kept": "the kept tokens of the whole mini-batch over all ranks",
}


def training_pool(sel) -> str:
    """The pool a preset's budget comes from in training, in words (``sel.scope``; a prompt group of the
    mini-batch with the pre-pass, of the training batch on the driver)."""
    words = TRAINING_SCOPE.get(sel.scope, f"scope {sel.scope}")
    if sel.scope == "group":
        words += " of the PPO mini-batch" if sel.score_source == "prepass" else " of the training batch"
    return words


def training_line(sel) -> str:
    """The scope, score source and normaliser a preset trains with (:class:`~verl_tokensel.core.config.
    Selection`), one line of the page: what the page's single pool stands in for."""
    source = TRAINING_SOURCE.get(sel.score_source, sel.score_source)
    norm = TRAINING_NORMALISER.get(sel.normaliser, sel.normaliser)
    return (f"scope {sel.scope}: the pool is {training_pool(sel)}; score_source {sel.score_source}: scores from "
            f"{source}; normaliser {sel.normaliser}: token-mean over {norm}")


def token_texts(tokenizer, prompt_ids, response_ids, window: int = 6) -> list[str]:
    """Text of each response token such that ``"".join(texts)`` is the decoded response.

    Incremental detokenisation: token t's text is ``decode(ids[t-w : t+1])`` minus
    ``decode(ids[t-w : t])`` over the prompt + response ids (so a word-initial space that a
    sentencepiece tokenizer only prints after a preceding token is kept). Bytes of an unfinished
    multi-byte character (a trailing U+FFFD) are held back and shown on the token that completes it;
    the token that only starts it shows no text.
    """
    ids = list(prompt_ids) + list(response_ids)
    p = len(prompt_ids)
    n = len(response_ids)
    if n == 0:
        return []
    prev_w, cur_w = [], []
    for t in range(p, p + n):
        lo = max(0, t - window)
        prev_w.append(ids[lo:t])
        cur_w.append(ids[lo:t + 1])
    kw = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    prevs = tokenizer.batch_decode(prev_w, **kw)
    curs = tokenizer.batch_decode(cur_w, **kw)
    out = []
    for i, (prev, cur) in enumerate(zip(prevs, curs)):
        base = prev.rstrip("\ufffd")
        if cur.startswith(base):
            text = cur[len(base):]
            if i < n - 1:
                text = text.rstrip("\ufffd")  # unfinished character: the next token shows it
        else:  # decoding is not prefix-stable here: fall back to the token on its own
            text = tokenizer.decode([response_ids[i]], **kw)
        out.append(text)
    return out



def build_page(args, records, pairs, scored, advantages, adv_source, tokenizer, sel, shade: str,
               n_total: int) -> str:
    """The HTML page of ``scored`` responses (``view``'s and the demo's): shaded by ``shade`` (``logp`` or a
    registered score), the selection of ``sel`` (None: nothing marked) with ``args.ratio`` / ``args.scope``
    overrides; ``args`` also names the preset, model, data, temperature and ``max_responses``."""
    b = len(scored)
    names = [shade] if shade != "logp" else []
    if sel is not None:
        names.extend(sel.scores)
    batch = scored_batch(scored, advantages, names or "entropy", pairs=pairs, seed=sel.seed if sel is not None else 0)
    valid = batch.valid
    shade_vals = batch.inputs.log_prob if shade == "logp" else batch.score(shade)
    score_vals = ranks = None
    mask = torch.zeros_like(valid)
    ratio = scope = None
    if sel is not None:
        chosen = select_preset(batch, sel, ratio=args.ratio, scope=args.scope)
        score_vals, mask, ranks, ratio, scope = chosen.scores, chosen.mask, chosen.ranks, chosen.ratio, chosen.scope

    responses = []
    for i, (rec, (p_ids, r_ids), s) in enumerate(zip(records, pairs, scored)):
        texts = token_texts(tokenizer, p_ids, r_ids)
        strs = tokenizer.convert_ids_to_tokens(list(r_ids))
        toks = []
        for t in range(len(r_ids)):
            toks.append(TokenView(
                text=texts[t], token_id=int(r_ids[t]), token_str=str(strs[t]),
                entropy=float(s.entropy[t]), logp=float(s.logp[t]), grad_norm=float(s.grad_norm[t]),
                advantage=float(advantages[i]), shade=float(shade_vals[i, t]),
                score=None if score_vals is None else float(score_vals[i, t]),
                rank=None if ranks is None else int(ranks[i, t]), selected=bool(mask[i, t]),
            ))
        pool = pool_size = pool_budget = None
        if sel is not None:
            pool = i if scope == "sequence" else 0
            pool_size = len(r_ids) if scope == "sequence" else int(valid.sum())
            pool_budget = budget(ratio, pool_size)
        responses.append(ResponseView(
            index=i, prompt_text=rec.prompt, prompt_tokens=len(p_ids), tokens=toks, uid=rec.group,
            reward=rec.reward, advantage=float(advantages[i]), pool=pool, pool_size=pool_size,
            pool_budget=pool_budget,
        ))

    n_tok = int(valid.sum())
    rows = []
    notes = []
    if sel is not None:
        direction = getattr(sel.knobs, "direction", "top")
        rows.append(("selection", f"score {sel.score}, {direction} {ratio:g} (ceil(ratio*N) tokens), "
                                  f"scope {scope}, normaliser {sel.normaliser}"))
        rows.append(("in training", training_line(sel)))
        if scope == "sequence":
            notes.append(f"Scope sequence: each response is its own pool; ceil({ratio:g} * n) of its n tokens "
                         "are selected" + ("." if sel.scope == "sequence" else
                                           f"; in training the pool is {training_pool(sel)}."))
        else:
            notes.append(f"Scope micro_batch: all {b} rendered responses form ONE pool of {n_tok} tokens, as if "
                         f"they were one micro-batch; ceil({ratio:g} * {n_tok}) = {budget(ratio, n_tok)} are "
                         f"selected. In training the pool is {training_pool(sel)} (scope {sel.scope}).")
        notes.append("On-policy: ratio r = 1 (old log-prob = current log-prob), so no token is clipped and "
                     "omega = A.")
    else:
        rows.append(("selection", "none: stock verl, every response token gets gradient; nothing is marked"))
    rows.append(("advantages", adv_source))
    rows.append(("temperature", f"{args.temperature:g}"))
    rows.append(("responses", f"{b} rendered of {n_total} in the data"
                              + (f" (--max-responses {args.max_responses})" if b < n_total else "")))
    notes.append("Text is re-tokenised from the data (prompt and response separately, no special tokens "
                 "added); grad norm = ||e_a - p||, the logit-gradient norm of log p(a_t) (times 1/T).")
    reversed_ = shade == "logp"
    info = PageInfo(
        title=f"verl-tokensel view: {args.preset}", model=str(args.model), data=str(args.data),
        preset=args.preset, shade=shade, shade_help=SHADE_HELP.get(shade, "registered score"),
        shade_reversed=reversed_, rows=rows, notes=notes,
    )
    return render_page(info, responses, score_name=None if sel is None else sel.score)
