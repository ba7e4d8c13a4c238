"""Render scored responses as one self-contained HTML page: every response token shaded by a score,
the tokens a preset would train on marked.

The responses are scored with the model (entropy, log-prob, exact logit-gradient norm per token,
chunked over the vocabulary) and the preset's selection is applied with the same selector the loss
uses, on-policy (ratio r = 1, nothing clipped):

* scope ``micro_batch`` (every preset's default; also ``micro_batch_dp``): all rendered responses form
  one pool, as if they were one micro-batch, and exactly ceil(ratio * N) of its N tokens are kept;
  ``--scope sequence``: ceil(ratio * n) per response;
* advantages: the data's ``advantage`` column, else GRPO from ``reward``/``score`` per prompt group
  exactly as verl computes it ((r - mean) / (std + 1e-6), unbiased std, a group of one gets A = r),
  else A = 1 (the page says which);
* the ``random`` score uses the seeded per-token draw of the loss, keyed by the prompt + response ids.

Inputs: a verl rollout dump (``trainer.rollout_data_dir``, or one ``<step>.jsonl``: input/output/score/uid)
or a ``.jsonl``/``.parquet`` with prompt/response and optional reward/advantage/uid. The page has no
external request; hover a token for its numbers.

Examples::

    verl-tokensel view --model ./Qwen3-8B --data rollouts/12.jsonl --out step12.html   # local HF folder
    verl-tokensel view --model ./ckpt --data rollouts/ --out gmts.html --preset gmts --shade entropy \\
        --max-responses 32 --device cuda --dtype bfloat16
    verl-tokensel view --model ./ckpt --data answers.parquet --out seq.html --scope sequence --shade logp
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HELP = "HTML page of responses: tokens shaded by a score, the preset's selected tokens marked"

SHADE_HELP = {
    "entropy": "H_t (nats) of the policy at the token",
    "logp": "log p(a_t); dark = low = surprising",
    "grad_norm": "|A| * ||e_a - p||: exact logit-gradient norm of the token's loss (on-policy)",
    "gmts": "H_t * |A| (GMTS delta, on-policy)",
    "random": "the seeded uniform draw of the random control",
}


def shade_choices() -> list[str]:
    from verl_tokensel.core.scores import SCORE_REGISTRY

    return ["logp"] + list(SCORE_REGISTRY)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (its tokenizer is used too)")
    parser.add_argument("--data", required=True,
                        help="rollout dump directory / <step>.jsonl, or a .jsonl/.parquet with prompt and response")
    parser.add_argument("--out", required=True, help="HTML file to write")
    parser.add_argument("--preset", default="forking", help="token_selector preset whose selection is marked "
                        "(default forking; 'none' marks nothing)")
    parser.add_argument("--shade", default=None,
                        help="per-token value for the background: logp or a score (entropy, gmts, grad_norm, random); "
                        "default: the preset's score, entropy for 'none'")
    parser.add_argument("--scope", default=None, choices=["micro_batch", "sequence"],
                        help="selection pool: all rendered responses (micro_batch) or each response (sequence); "
                        "default: the preset's")
    parser.add_argument("--ratio", type=float, default=None, help="override the preset's ratio, in (0, 1]")
    parser.add_argument("--max-responses", type=int, default=None, help="render only the first N responses")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (default 1.0)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (bfloat16 only on cuda)")


def _advantages(records) -> tuple[list[float], str]:
    """The analysis advantages (:func:`~verl_tokensel.analysis.stats.resolve_advantages`), or A = 1."""
    from verl_tokensel.analysis.stats import resolve_advantages

    advantages, source = resolve_advantages(records)
    if advantages is None:
        return [1.0] * len(records), "A = 1 for every response: the data has no advantage and no reward/score column"
    return advantages, source


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


def run(args) -> int:
    from verl_tokensel.cli.analyze import _error, score_with_progress
    from verl_tokensel.core.config import PRESETS

    if args.preset not in PRESETS:
        return _error(f"--preset {args.preset!r} is unknown; valid: {', '.join(PRESETS)}")
    sel = PRESETS[args.preset]
    shades = shade_choices()
    shade = args.shade if args.shade is not None else (sel.score if sel is not None and sel.score in shades
                                                       else "entropy")
    if shade not in shades:
        return _error(f"--shade {shade!r} is unknown; valid: {', '.join(shades)}")
    if args.ratio is not None and not (0 < args.ratio <= 1):
        return _error(f"--ratio {args.ratio!r} is invalid; valid: a number in (0, 1]")
    if sel is None and (args.ratio is not None or args.scope is not None):
        return _error("--ratio/--scope set with --preset none, which selects nothing; pick a selector preset")
    if args.max_responses is not None and args.max_responses < 1:
        return _error(f"--max-responses {args.max_responses} is invalid; valid: an integer >= 1")
    if not (args.temperature > 0):
        return _error(f"--temperature {args.temperature!r} is invalid; valid: a number > 0")
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        return _error(f"--model {model_dir}: no such directory")
    if not (model_dir / "config.json").is_file():
        return _error(f"--model {model_dir}: not a HF model directory (no config.json)")
    data = Path(args.data)
    if not data.exists():
        return _error(f"--data {data}: no such file or directory")
    out = Path(args.out)
    if out.exists() and out.is_dir():
        return _error(f"--out {out} is a directory; give an .html file path")

    from verl_tokensel.analysis import io

    try:
        records = io.load_records(data)
    except io.AnalysisInputError as e:
        return _error(f"--data {e}")
    if not records:
        return _error(f"--data {data}: holds no responses")
    n_total = len(records)
    records = records[: args.max_responses] if args.max_responses else records
    try:
        tokenizer = io.load_tokenizer(model_dir)
        io.check_vocab(tokenizer, model_dir, model_dir)
        pairs = io.tokenize_records(tokenizer, records)
    except io.AnalysisInputError as e:
        return _error(str(e))

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = io.load_model(model_dir, device=device, dtype=args.dtype)
    except io.AnalysisInputError as e:
        return _error(str(e))
    advantages, adv_source = _advantages(records)

    scored = score_with_progress(model, pairs, desc="scoring", temperature=args.temperature, device=device)

    page = build_page(args, records, pairs, scored, advantages, adv_source, tokenizer, sel, shade, n_total)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=str(out.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    n_tok = sum(len(s.token_ids) for s in scored)
    print(f"wrote {out} ({len(records)} responses, {n_tok} response tokens)")
    return 0


def selection_ranks(scores, valid, direction: str, scope: str):
    """Rank (1 = kept first) of every valid token in its pool, in the selector's order.

    Order: best score first (highest for ``top``, lowest for ``bottom``), NaN last, ties by position
    (row-major over ``(responses, tokens)``), exactly the order :func:`select_tokens` keeps tokens in.
    Returns an int64 tensor shaped like ``scores`` (0 on padding).
    """
    import torch

    from verl_tokensel.core.select import _rank_keys

    key = _rank_keys(scores, direction)  # larger = kept first, NaN last: the selector's own order
    ranks = torch.zeros(scores.shape, dtype=torch.int64)
    rows = [list(range(scores.shape[0]))] if scope != "sequence" else [[i] for i in range(scores.shape[0])]
    for pool in rows:
        k = key[pool][valid[pool]]  # row-major valid entries of the pool
        order = torch.sort(k, descending=True, stable=True).indices
        r = torch.empty_like(order)
        r[order] = torch.arange(1, order.numel() + 1)
        sub = torch.zeros(valid[pool].shape, dtype=torch.int64)
        sub[valid[pool]] = r
        ranks[pool] = sub
    return ranks


def build_page(args, records, pairs, scored, advantages, adv_source, tokenizer, sel, shade: str,
               n_total: int) -> str:
    import torch

    from verl_tokensel.analysis.html import PageInfo, ResponseView, TokenView, render_page
    from verl_tokensel.core.scores import ScoreInputs, compute_score, row_keys_from_tokens
    from verl_tokensel.core.pools import budget
    from verl_tokensel.core.select import select_tokens

    b = len(scored)
    lmax = max([len(s.token_ids) for s in scored] + [1])
    valid = torch.zeros(b, lmax, dtype=torch.bool)
    lp = torch.zeros(b, lmax)
    ent = torch.zeros(b, lmax)
    sp2 = torch.zeros(b, lmax)
    adv = torch.zeros(b, lmax)
    for i, s in enumerate(scored):
        n = len(s.token_ids)
        valid[i, :n] = True
        lp[i, :n], ent[i, :n], sp2[i, :n] = s.logp, s.entropy, s.sum_p2
        adv[i, :n] = advantages[i]
    seed = sel.seed if sel is not None else 0
    row_keys = row_keys_from_tokens([torch.tensor(list(p) + list(r), dtype=torch.long) for p, r in pairs])

    def inputs():
        # on-policy: old log-prob = current log-prob, so r = 1 and no token is clipped
        return ScoreInputs(log_prob=lp, response_mask=valid, entropy=ent, old_log_prob=lp, advantages=adv,
                           sum_pi_squared=sp2, row_keys=row_keys, seed=seed)

    shade_vals = lp if shade == "logp" else compute_score(shade, inputs())
    score_vals = ranks = None
    mask = torch.zeros_like(valid)
    ratio = scope = None
    if sel is not None:
        ratio = args.ratio if args.ratio is not None else sel.ratio
        scope = args.scope if args.scope is not None else ("sequence" if sel.scope == "sequence" else "micro_batch")
        score_vals = compute_score(sel.score, inputs())
        mask = select_tokens(score_vals, valid, ratio, scope=scope, direction=sel.direction)
        ranks = selection_ranks(score_vals, valid, sel.direction, scope)
        if scope == "sequence":
            budgets = [budget(ratio, int(valid[i].sum())) for i in range(b)]
        else:
            budgets = [budget(ratio, int(valid.sum()))] * b
        # the ranks are the selector's order: the kept tokens are exactly ranks 1..budget
        want = valid & (ranks <= torch.tensor(budgets).unsqueeze(-1))
        if not torch.equal(want, mask):
            raise AssertionError("internal: selection ranks disagree with select_tokens")

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
        rows.append(("selection", f"score {sel.score}, {sel.direction} {ratio:g} (ceil(ratio*N) tokens), "
                                  f"scope {scope}, normaliser {sel.normaliser}"))
        if scope == "sequence":
            notes.append(f"Scope sequence: each response is its own pool; ceil({ratio:g} * n) of its n tokens "
                         "are selected.")
        else:
            notes.append(f"Scope micro_batch: all {b} rendered responses form ONE pool of {n_tok} tokens, as if "
                         f"they were one micro-batch; ceil({ratio:g} * {n_tok}) = {budget(ratio, n_tok)} are "
                         "selected. In training the pool is each micro-batch on each rank.")
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
