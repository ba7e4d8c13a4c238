"""What the selectors see in a demo run: entropy statistics and selection of its last step's rollouts.

verl dumps each step's rollouts (``trainer.rollout_data_dir``: ``<step>.jsonl`` with input, output,
score, uid). :func:`analyse_rollouts` scores the last step's responses under a model (the run's
final policy when its checkpoint is there, else the warm start; the result says which), then:

* ``entropy_below_0_01_share`` and ``entropy_p80``: the 80/20 paper's two statistics over all
  response tokens (share with H < 0.01 nats; 80th percentile of H, nats);
* ``decision_token_share``: share of response tokens on the task's decisions (:mod:`.task`: the
  route word's and the written value's tokens);
* ``think_share``: share of the responses that take the ``think`` route (the forking decision RL acts on);
* ``selected_on_decision_share``: share of the preset's selected tokens that sit on a decision
  (the same selector the loss uses, on-policy: r = 1; all responses form one pool, as
  ``verl-tokensel view`` does; ``none`` selects every token, so it equals ``decision_token_share``);
* ``decision_selected_share``: share of decision tokens that the preset selects;
* ``route_token_share`` and ``selected_on_route_share``: the same two shares for the route words alone;
* ``fork_token_share``, ``selected_on_fork_share`` and ``fork_selected_share``: the same for the tokens where a route
  is chosen (one per step), and the share of them the preset selects;

with ``task="multi"`` (:mod:`.task_multi`) the decisions are every step's route word and value,
``think_share`` is the share of the steps on the ``think`` route and ``all_think_share`` the share of the
responses on ``think`` at every step;

and writes the ``verl-tokensel view`` page of those responses, the preset's selected tokens marked.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Optional

import torch


def last_step_file(dump_dir: str | Path) -> Optional[Path]:
    """The ``<step>.jsonl`` with the highest step in ``dump_dir``, or None."""
    files = [p for p in Path(dump_dir).glob("*.jsonl") if p.stem.isdigit()]
    return max(files, key=lambda p: int(p.stem)) if files else None


# verl dumps the prompt decoded without special tokens: the ChatML markers of the chat template are gone
_DUMPED_CHAT = re.compile(r"^user\n(.*)\nassistant\n?$", re.S)


def prompt_ids(tokenizer, dumped_prompt: str, fallback: list[int]) -> list[int]:
    """The prompt ids the policy saw: the chat template re-applied to the user message of a verl dump's
    ``input`` (``"user\\n<message>\\nassistant\\n"``), else ``fallback`` (the text as it is)."""
    m = _DUMPED_CHAT.match(dumped_prompt)
    if not m:
        return fallback
    text = tokenizer.apply_chat_template([{"role": "user", "content": m.group(1)}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def analyse_rollouts(data: str | Path, model_dir: str | Path, preset: str, html_path: str | Path,
                     task: str = "route") -> dict:
    """Statistics of ``data`` (one rollout dump file) under ``model_dir`` for ``preset`` on the demo task ``task``
    (:mod:`.tasks`); writes the view page to ``html_path``. See the module docstring for the keys."""
    from verl_tokensel.analysis import io
    from verl_tokensel.analysis.scorer import score_responses
    from verl_tokensel.analysis.page import build_page, token_texts
    from verl_tokensel.analysis.training_masks import scored_batch, select_preset
    from verl_tokensel.analysis.stats import advantages_or_unit
    from verl_tokensel.core.resolve.presets import selection_for
    from verl_tokensel_cpu.demo.tasks import get_task

    spec = get_task(task)
    sel = selection_for(preset)
    records = io.load_records(data)
    tokenizer = io.load_tokenizer(model_dir)
    pairs = [(prompt_ids(tokenizer, rec.prompt, list(p)), list(r))
             for rec, (p, r) in zip(records, io.tokenize_records(tokenizer, records))]
    model = io.load_model(model_dir, device="cpu")
    advantages, adv_source = advantages_or_unit(records)
    with torch.no_grad():
        scored = score_responses(model, pairs, device="cpu")

    b = len(scored)
    batch = scored_batch(scored, advantages, sel.scores if sel is not None else "entropy", pairs=pairs,
                         seed=sel.seed if sel is not None else 0)
    valid, ent = batch.valid, batch.inputs.entropy
    decision, route, fork = torch.zeros_like(valid), torch.zeros_like(valid), torch.zeros_like(valid)
    think = steps = all_think = 0
    for i, (s, (p_ids, r_ids)) in enumerate(zip(scored, pairs)):
        n = len(s.token_ids)
        texts = token_texts(tokenizer, p_ids, r_ids)
        response = "".join(texts)
        decision[i, :n] = torch.tensor(spec.decision_mask(texts, response), dtype=torch.bool)
        route[i, :n] = torch.tensor(spec.decision_mask(texts, response, routes_only=True), dtype=torch.bool)
        fork[i, :n] = torch.tensor(spec.decision_mask(texts, response, forks_only=True), dtype=torch.bool)
        th, n_steps = spec.think_counts(response)
        think, steps, all_think = think + th, steps + n_steps, all_think + (n_steps > 0 and th == n_steps)
    mask = valid.clone() if sel is None else select_preset(batch, sel).mask

    h = ent[valid]
    n_tok, n_sel, n_dec, n_route = int(valid.sum()), int(mask.sum()), int(decision.sum()), int(route.sum())
    args = argparse.Namespace(preset=preset, ratio=None, scope=None, max_responses=None, temperature=1.0,
                              model=str(model_dir), data=str(data))
    shade = sel.score if sel is not None and sel.score != "random" else "entropy"
    page = build_page(args, records, pairs, scored, advantages, adv_source, tokenizer, sel, shade, len(records))
    Path(html_path).parent.mkdir(parents=True, exist_ok=True)
    Path(html_path).write_text(page, encoding="utf-8")

    def share(num: int, den: int) -> Optional[float]:
        return num / den if den else None

    extra = {} if task == "route" else {"all_think_share": share(all_think, b), "decision_steps": steps}
    return {
        "task": task,
        "responses": b,
        "response_tokens": n_tok,
        "entropy_below_0_01_share": share(int((h < 0.01).sum()), n_tok),
        "entropy_p80": float(torch.quantile(h.double(), 0.8)) if n_tok else math.nan,
        "entropy_decision_mean": float(ent[decision].mean()) if n_dec else None,
        "entropy_template_mean": float(ent[valid & ~decision].mean()) if n_tok > n_dec else None,
        "decision_token_share": share(n_dec, n_tok),
        "selected_on_decision_share": share(int((mask & decision).sum()), n_sel),
        "decision_selected_share": share(int((mask & decision).sum()), n_dec),
        "on_template_share": share(sum(1 for i in range(b) if decision[i].any()), b),
        "selected_share": share(n_sel, n_tok),
        "route_token_share": share(n_route, n_tok),
        "selected_on_route_share": share(int((mask & route).sum()), n_sel),
        "fork_token_share": share(int(fork.sum()), n_tok),
        "selected_on_fork_share": share(int((mask & fork).sum()), n_sel),
        "fork_selected_share": share(int((mask & fork).sum()), int(fork.sum())),
        "think_share": share(think, b if task == "route" else steps),
        **extra,
        "html": str(html_path),
        "data": str(data),
        "model": str(model_dir),
    }
