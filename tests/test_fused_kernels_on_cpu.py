"""verl's fused linear-cross-entropy kernels (``actor_rollout_ref.model.use_fused_kernels=true``, torch backend)
with every preset, through verl's real FSDP2 TrainingWorker on CPU.

The fused kernel returns log-probs and entropy (never sum_j p_j^2), in chunks and with its own backward, so the
no-graph path (``token_selection.no_grad_scores``) stands aside for it. For each preset the same update runs
with and without fused kernels, from the same weights and batch: the selection (the selected-token count) and
every parameter gradient must agree to float tolerance, and the pre-pass (``gmts``) and driver-side
(``forking_paper``) scores come from the fused passes. ``grad_norm`` with ``score_source=prepass`` needs sum p^2 and
is refused on the driver (``test_config_on_cpu``).

The model has tied embeddings. With untied ones, stock verl 0.9.1's FSDP2 wraps ``lm_head`` as its own FSDP unit and
its fused forward multiplies the plain hidden states by the still-sharded weight ("aten.mm.default got mixed
torch.Tensor and DTensor"), for every preset including ``none``: a verl limitation, written up in docs/cost.md.

verl's fused patch replaces the model CLASS's ``forward`` for the whole process: the unfused worker runs first, and
the class's own ``forward`` is put back afterwards so later tests in this process get stock verl.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import torch

from verl_tokensel_cpu import batches as B, tiny_model, worker as H
from verl_tokensel.verl_glue.loss import SelectingLoss

pytestmark = pytest.mark.requires("verl")

PRESETS = ["none", "forking", "forking_bottom", "random", "gmts", "grad_norm", "forking_paper"]
FUSED = ["actor_rollout_ref.model.use_fused_kernels=true",
         "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"]
WORKER_KW = dict(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, ppo_max_token_len_per_gpu=64,
                 lr=0.0, clip_grad=1e9)
BATCH_KW = dict(n=4, seed=3, resp_len=(6, 14), group_size=2)


def _tied_model_dir(root: Path) -> str:
    """The tiny model with tied input/output embeddings (the untied checkpoint minus ``lm_head.weight``)."""
    from safetensors.torch import load_file, save_file

    src = Path(tiny_model.build_tiny_model_dir(root / "untied"))
    dst = root / "tied"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        tensors.pop("lm_head.weight", None)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return str(dst)


def _run(actor, preset: str) -> dict:
    """One real update of ``preset``: its gradients, old-pass entropy and selection metrics."""
    from verl.utils import tensordict_utils as tu

    if preset == "none":
        loss_fn, entropy_in_update = H.default_loss_fn(actor.actor_config), False
    else:
        config = H.selecting_actor_config(actor, preset)
        loss_fn, entropy_in_update = SelectingLoss(config), config.needs_entropy
    batch = B.make_update_batch(actor, **BATCH_KW)
    H.compute_old_log_probs(actor, batch)
    old_entropy = batch["entropy"].values().clone()
    tu.assign_non_tensor(batch, calculate_entropy=entropy_in_update)
    if preset == "forking_paper":
        B.add_driver_selection(config, batch)
    r = H.run_train_step(actor, batch, loss_fn=loss_fn, capture_grads=True, capture_params=False)
    picked = {k: v for k, v in r.metrics.items() if k.startswith("tokensel/") and "seconds" not in k}
    return {"grads": r.grads, "old_entropy": old_entropy, "metrics": picked, "loss": r.loss}


COUNTS = ("selected_fraction", "selected_tokens", "valid_tokens", "nan_scores", "groups", "reused_old_pass")


def _floats(value) -> list[float]:
    return [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every preset's update without, then with, fused kernels (the fused patch is process-wide: see above)."""
    from transformers import Qwen2ForCausalLM

    model_dir = _tied_model_dir(tmp_path_factory.mktemp("fused"))
    stock_forward = Qwen2ForCausalLM.forward
    out = {}
    try:
        plain = H.make_training_worker(model_dir, **WORKER_KW)
        out["plain"] = {p: _run(plain, p) for p in PRESETS}
        fused = H.make_training_worker(model_dir, overrides=FUSED, **WORKER_KW)
        assert Qwen2ForCausalLM.forward is not stock_forward, "verl did not install its fused forward"
        out["fused"] = {p: _run(fused, p) for p in PRESETS}
    finally:
        Qwen2ForCausalLM.forward = stock_forward
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_kernels_train_every_preset_like_the_unfused_engine(runs, preset):
    plain, fused = runs["plain"][preset], runs["fused"][preset]
    assert fused["loss"] == fused["loss"], "NaN loss with fused kernels"
    torch.testing.assert_close(fused["old_entropy"], plain["old_entropy"], rtol=1e-4, atol=1e-4)
    # the selection: the same counts exactly, the same score range and entropy means to float tolerance
    assert fused["metrics"].keys() == plain["metrics"].keys()
    for key, want in plain["metrics"].items():
        got, want = _floats(fused["metrics"][key]), _floats(want)
        if key.endswith(COUNTS):
            assert got == want, f"{preset}: {key} {got} != {want} with fused kernels"
        else:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5, msg=key)
    if preset != "none":
        assert sum(_floats(fused["metrics"]["tokensel/selected_tokens"])) > 0, fused["metrics"]
    assert fused["grads"].keys() == plain["grads"].keys() and fused["grads"]
    for name, g in plain["grads"].items():
        torch.testing.assert_close(fused["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{preset}: gradient of {name}")
    # the presets do select: their gradients differ from the full-token update's
    if preset != "none":
        base = runs["fused"]["none"]["grads"]
        assert any(not torch.allclose(fused["grads"][n], base[n], rtol=1e-3, atol=1e-6) for n in base), preset
