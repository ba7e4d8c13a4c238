"""Inputs for a tiny, download-free run of verl's whole ``main_ppo`` pipeline on CPU (helper, not a test).

* :func:`write_tiny_rl_dataset`: train/val parquet files in verl's RL format (``data_source``, chat
  ``prompt``, ``ability``, ``reward_model.ground_truth``, ``extra_info``) with arithmetic questions.
* :func:`write_reward_file`: a dense rule reward (``compute_score``) as a standalone ``.py`` file for
  ``reward.custom_reward_function.path``; it varies between the responses of a random model, so GRPO
  advantages are non-zero and the policy really moves.
* :func:`tiny_pipeline_overrides`: the model / data / batch-size overrides of such a run (two steps of
  GRPO, 4 prompts x 4 responses of at most 16 tokens). The CPU settings themselves come from the one
  switch ``trainer.device=cpu`` (:mod:`verl_tokensel_cpu.pipeline`), added by
  :func:`verl_tokensel_cpu.launch.run_main_ppo`.

Example (what ``tests/test_e2e_on_cpu.py`` does)::

    from pathlib import Path
    from verl_tokensel_cpu.launch import run_main_ppo
    from helpers.pipeline import prepare_tiny_run

    overrides = prepare_tiny_run(Path("/tmp/e2e"), token_selector="forking")
    run_main_ppo(overrides, timeout_s=600, log_path=Path("/tmp/e2e/run.log")).raise_for_status()
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Optional

from verl_tokensel_cpu.tiny_model import build_tiny_model_dir
from verl_tokensel_cpu.launch import HF_CHECKPOINT_DIRS

__all__ = ["write_tiny_rl_dataset", "write_reward_file", "tiny_pipeline_overrides", "prepare_tiny_run", "REWARD_SOURCE",
           "check_selecting_run", "check_params_changed", "HF_DIR", "loss_announcements", "FULL_CHECKPOINT",
           "with_overrides", "resume_overrides"]

DATA_SOURCE = "tokensel_tiny_arith"
#: overrides of a full checkpoint (what a resume loads) plus the HF weights (the parameter check) at every step
FULL_CHECKPOINT = ["trainer.save_freq=1",
                   "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]

#: the reward file's source: digits share of the response, +1 when the answer appears in it
REWARD_SOURCE = '''"""Dense toy reward for the tiny CPU pipeline (written by helpers.pipeline)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    text = solution_str or ""
    digits = sum(ch.isdigit() for ch in text) / max(len(text), 1)
    return float(digits + (1.0 if str(ground_truth) in text else 0.0))
'''


def write_tiny_rl_dataset(out_dir: Path, n_train: int = 16, n_val: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` (verl RL format) into ``out_dir``; returns their paths."""
    import pandas as pd

    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def rows(n: int, split: str) -> list[dict]:
        out = []
        for i in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            })
        return out

    train, val = out_dir / "train.parquet", out_dir / "val.parquet"
    pd.DataFrame(rows(n_train, "train")).to_parquet(train)
    pd.DataFrame(rows(n_val, "test")).to_parquet(val)
    return train, val


def write_reward_file(out_dir: Path) -> Path:
    """Write :data:`REWARD_SOURCE` to ``out_dir/tiny_reward.py``; returns the path."""
    path = Path(out_dir) / "tiny_reward.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(REWARD_SOURCE)
    return path


def tiny_pipeline_overrides(
    model_dir: str | Path,
    train_file: Path,
    val_file: Path,
    reward_file: Path,
    *,
    token_selector: str = "forking",
    use_v1: bool = True,
    steps: int = 2,
    train_batch_size: int = 4,
    rollout_n: int = 4,
    max_prompt_length: int = 32,
    max_response_length: int = 16,
    lr: float = 1e-3,
    default_local_dir: Optional[Path] = None,
) -> list[str]:
    """Hydra overrides for a tiny GRPO run (no CPU settings: add ``trainer.device=cpu`` for those).

    ``lr`` is large on purpose (random tiny model, two steps): the update must be visible in the
    rollout log-probs of the next step.
    """
    a = "actor_rollout_ref.actor"
    r = "actor_rollout_ref.rollout"
    ov = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        "data.dataloader_num_workers=0",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={reward_file}",
        "reward.custom_reward_function.name=compute_score",
        f"{a}.token_selector={token_selector}",
        f"{a}.ppo_mini_batch_size={train_batch_size}",
        f"{a}.ppo_micro_batch_size_per_gpu={train_batch_size * rollout_n}",
        f"{a}.use_kl_loss=False",
        f"{a}.optim.lr={lr}",
        f"{r}.n={rollout_n}",
        f"{r}.log_prob_micro_batch_size_per_gpu={train_batch_size * rollout_n}",
        f"{r}.max_model_len={max_prompt_length + max_response_length}",
        f"{r}.max_num_batched_tokens="
        f"{max(256, train_batch_size * rollout_n * (max_prompt_length + max_response_length))}",
        f"trainer.use_v1={str(use_v1).lower()}",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.save_freq=-1",
        "trainer.project_name=verl_tokensel_tiny",
        "trainer.experiment_name=" + f"{token_selector}_{'v1' if use_v1 else 'v0'}",
    ]
    if default_local_dir is not None:
        ov.append(f"trainer.default_local_dir={default_local_dir}")
    return ov


def prepare_tiny_run(work_dir: Path, *, model_dir: Optional[str | Path] = None, **kwargs) -> list[str]:
    """Build (or reuse) the tiny model, write data + reward into ``work_dir``; return the overrides."""
    work_dir = Path(work_dir)
    model_dir = model_dir or build_tiny_model_dir()
    train, val = write_tiny_rl_dataset(work_dir / "data")
    reward = write_reward_file(work_dir)
    kwargs.setdefault("default_local_dir", work_dir / "checkpoints")
    # Hydra's run directory: by default ``outputs/<date>/<time>`` under the driver's cwd (the test's, or the Ray
    # head's for a submitted job), which would litter the checkout
    return tiny_pipeline_overrides(model_dir, train, val, reward, **kwargs) + [f"hydra.run.dir={work_dir / 'hydra'}"]


def with_overrides(overrides: list[str], extra: list[str]) -> list[str]:
    """``overrides`` with the keys of ``extra`` replaced by ``extra``'s values."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + extra


def resume_overrides(overrides: list[str], checkpoint: Path, work: Path) -> list[str]:
    """The overrides of a run resumed from ``checkpoint`` (a full one: actor state and ``data.pt``, checked
    here), writing its checkpoints and Hydra folder into ``work``."""
    checkpoint = Path(checkpoint)
    assert (checkpoint / "actor").is_dir() and (checkpoint / "data.pt").is_file(), \
        sorted(p.name for p in checkpoint.iterdir())
    return with_overrides(overrides, [f"trainer.default_local_dir={work / 'checkpoints'}",
                                      f"hydra.run.dir={work / 'hydra'}", "trainer.resume_mode=resume_path",
                                      f"trainer.resume_from_path={checkpoint}"])


#: where a step's checkpoint keeps the actor's HF weights: FSDP, and Megatron (written through mbridge)
HF_DIR = {"fsdp": HF_CHECKPOINT_DIRS["fsdp2"], "megatron": HF_CHECKPOINT_DIRS["megatron"]}


def check_selecting_run(result, model_dir: Path, checkpoints: Path, *, steps: list[int], ratio: float = 0.2,
                        prefix: str = "actor/tokensel/", engine: str = "fsdp") -> None:
    """A finished selecting run: exit 0; exactly ``steps`` logged; per step the preset's budget (selected
    fraction ceil(ratio N)/N per pool: >= ratio and < ratio + 0.05 here), no dropped score, the rollout (vLLM)
    and actor log-probs equal (the weight sync works); the parameters at the last step differ from the
    initial ones. ``prefix``: where the selection is logged: the loss's per-micro-batch metrics for in-loss
    presets, ``actor/tokensel/prepass/`` (exact over the mini-batch) for pre-pass presets. ``engine``: the actor's
    (``fsdp`` or ``megatron``: where the checkpoint keeps the HF weights, :data:`HF_DIR`)."""
    result.raise_for_status()
    assert "has no attribute 'weight_loader'" not in result.log_path.read_text(errors="replace")
    assert [s["step"] for s in result.steps] == steps, result.describe()
    for s in result.steps:
        frac, sel, valid = (s[prefix + "selected_fraction"], s[prefix + "selected_tokens"], s[prefix + "valid_tokens"])
        assert ratio <= frac < ratio + 0.05, s
        assert sel >= math.ceil(ratio * valid) - 1e-6, s  # ceil per pool: never below the budget
        assert s["actor/tokensel/nan_scores"] == 0
        assert "critic/score/mean" in s and "actor/pg_loss" in s
        # vLLM's and the actor's log-probs of the same tokens: equal when the synced weights are the actor's
        assert s["training/rollout_probs_diff_max"] < 1e-4, s
        print(f"{result.log_path.name} step {s['step']}: {prefix}selected_fraction={frac:.4f} ({sel:.0f}/{valid:.0f}) "
              f"rollout_probs_diff_max={s['training/rollout_probs_diff_max']:.2e} "
              f"critic/score/mean={s['critic/score/mean']:.4f} actor/pg_loss={s['actor/pg_loss']:.4f}")
    check_params_changed(model_dir, checkpoints / f"global_step_{steps[-1]}" / HF_DIR[engine])


def check_params_changed(model_dir: Path, hf_dir: Path) -> None:
    """The HF weights saved in ``hf_dir`` differ from ``model_dir``'s (finite, the LM head moved)."""
    from safetensors.torch import load_file

    before = load_file(str(Path(model_dir) / "model.safetensors"))
    after = load_file(str(Path(hf_dir) / "model.safetensors"))
    assert set(after) == set(before)
    diffs = {k: (after[k].float() - before[k].float()).abs().max().item() for k in before}
    assert all(math.isfinite(d) for d in diffs.values())
    assert max(diffs.values()) > 1e-5, diffs
    assert diffs["lm_head.weight"] > 0, "the LM head did not move"
    print(f"parameters changed: max |delta| {max(diffs.values()):.2e}, lm_head {diffs['lm_head.weight']:.2e}")


_ANNOUNCEMENT = re.compile(r"verl_tokensel (\S+) \((\S+)\): token_selector=(\S+) loss installed in pid (\d+) "
                           r"on node (\S+)")


def loss_announcements(log_text: str) -> list[dict]:
    """The workers' "selecting loss installed" lines of a run's log (``verl_glue.loss.announce_loss``)."""
    return [{"version": m[1], "package": m[2], "selector": m[3], "pid": int(m[4]), "node": m[5]}
            for m in _ANNOUNCEMENT.finditer(log_text)]
