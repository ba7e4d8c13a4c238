"""The seam for per-token reductions over the vocabulary (``Needs(vocab=...)``, ``VocabStat``).

- The reductions (``core/seam/vocab.py``) equal their dense formulas on full logits, chunked or not, in bf16 too; the
  update forward's top-k carries the gradient of ``log_softmax`` at those entries; two vocabulary shards merged over a
  gloo group equal one process (the tensor-parallel merge), and Lp-Reg's candidates over two data-parallel ranks
  those of one process (one spawn for both).
- Through verl's real FSDP2 ``TrainingWorker`` (remove-padding and padded, temperature 0.7): the old-log-prob pass's
  and the update forward's values reach the rule as ``x.vocab`` equal to the same reductions of the model's own
  logits, computed here from a plain forward of the module; the old pass adds no forward and its values never leave
  the worker.
- Through verl's real Megatron engine on the CPU test bed: two tensor-parallel ranks (each a half of the vocabulary)
  hand the rule the values one process does, in the old pass and the update forward.
- A rule that declares them where they cannot be computed is refused on the driver, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers.released_rules import lp_reg_proxy_log_prob
from verl_tokensel.core.rules import RULE_REGISTRY
from verl_tokensel.core.seam import vocab as V
from verl_tokensel.rules import Knobs, LossTransform, Needs, Pool, VocabStat, knob, register_rule

PROBE = "test_vocab_probe"


def _dense_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).topk(k, -1).values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 3])
def test_reductions_equal_their_dense_formulas(monkeypatch, dtype, chunk):
    if chunk is not None:  # 3 rows per chunk: every chunk boundary crossed
        monkeypatch.setattr(V, "CHUNK_ELEMENTS", 3 * 17)
    g = torch.Generator().manual_seed(0)
    n, vocab, k = 11, 17, 3
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    temperature = torch.full((n,), 0.7)
    stats = (VocabStat("top_k", "old", k=k), VocabStat("min_p", "old", kappa=0.1))
    out = V.reduce_rows(stats, logits, labels, temperature)
    assert out["old_top_k"].shape == (n, k) and out["old_min_p"].shape == (n,)
    torch.testing.assert_close(out["old_top_k"], _dense_top_k(logits, k), rtol=0, atol=1e-5)
    # the release's proxy: min-p on softmax(raw logits), then (filtered logits) / T; here the rows are already / T
    raw = (logits.float() * 0.7).unsqueeze(0)
    want = lp_reg_proxy_log_prob(raw, labels.unsqueeze(0), 0.1, 0.7).squeeze(0)
    kept = want > -1000
    assert 0 < int(kept.sum()) < n, "some sampled tokens filtered, some kept"
    torch.testing.assert_close(out["old_min_p"][kept], want[kept], rtol=0, atol=1e-5)
    assert (out["old_min_p"][~kept] < -1e4 / 0.7 + 10).all(), "a filtered sampled token sits at the -1e4 logit"


def test_the_update_top_k_carries_the_gradient_of_log_softmax(monkeypatch):
    monkeypatch.setattr(V, "CHUNK_ELEMENTS", 4 * 13)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 13, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (9,), generator=g)
    weights = torch.randn(9, 3, generator=g)
    got = V.reduce_rows((VocabStat("top_k", "update", k=3),), logits, labels, grad=True)["update_top_k"]
    (got * weights).sum().backward()
    ours, logits.grad = logits.grad.clone(), None
    want = _dense_top_k(logits, 3)
    (want * weights).sum().backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, logits.grad, rtol=0, atol=1e-6)


def test_a_declaration_is_checked_when_the_rule_registers():
    with pytest.raises(ValueError, match="valid kinds are top_k, min_p"):
        VocabStat("top_p")
    with pytest.raises(ValueError, match="valid forwards are old, update"):
        VocabStat("top_k", "rollout")

    @dataclass(frozen=True)
    class K(Knobs):
        kappa_here: float = knob(0.1, "threshold", "n/a", ge=0)

    with pytest.raises(TypeError, match="names no knob of K"):
        register_rule("test_vocab_bad", knobs=K, needs=Needs(vocab=(VocabStat("min_p", kappa="kappa_there"),)))(
            lambda x: LossTransform())
    with pytest.raises(TypeError, match="one reduction per kind and forward"):
        register_rule("test_vocab_bad", needs=Needs(vocab=(VocabStat("top_k", k=1), VocabStat("top_k", k=2))))(
            lambda x: LossTransform())
    assert "test_vocab_bad" not in RULE_REGISTRY


def _gloo_rank(rank: int, world: int, logits, labels, stats, pool_inputs) -> dict:
    """Both collectives' checks on one spawned rank: this rank's vocabulary shard through ``reduce_rows`` (the
    tensor-parallel merge), and Lp-Reg's candidates over this rank's half of a mini-batch (the data-parallel pool)."""
    from verl_tokensel.core.rules.lp_reg import regularised_tokens

    if not torch.distributed.is_initialized():  # the launcher set the rendezvous; no worker made the group here
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    group = torch.distributed.group.WORLD
    width = logits.shape[-1] // world
    shard = logits[:, rank * width:(rank + 1) * width].contiguous()
    tp = V.reduce_rows(stats, shard, labels, torch.full((logits.shape[0],), 0.8), tp_group=group,
                       vocab_start=rank * width)
    lp, proxy, adv, tokens, rho = pool_inputs
    rows = slice(rank * lp.shape[0] // world, (rank + 1) * lp.shape[0] // world)
    reg, k = regularised_tokens(lp[rows], proxy[rows], adv[rows], tokens[rows], rho, Pool(group))
    return {"tp": tp, "lp_reg": (reg, k)}


@pytest.fixture(scope="module")
def gloo_pair():
    """One spawn of two gloo ranks for every collective check of the module: the inputs and each rank's results."""
    from helpers.distributed import run_distributed

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 16, generator=g) * 2
    labels = torch.randint(0, 16, (7,), generator=g)
    stats = (VocabStat("top_k", "old", k=3), VocabStat("min_p", "old", kappa=0.2))
    lp = -torch.rand(8, 30, generator=g) * 6
    pool_inputs = (lp, lp + torch.randn(8, 30, generator=g), torch.randn(8, 1, generator=g).expand(8, 30).contiguous(),
                   torch.rand(8, 30, generator=g) < 0.9, 0.1)
    ranks = run_distributed(_gloo_rank, world_size=2, args=(logits, labels, stats, pool_inputs))
    return (logits, labels, stats, pool_inputs), ranks


def test_two_vocabulary_shards_merge_to_one_process(gloo_pair):
    (logits, labels, stats, _), ranks = gloo_pair
    whole = V.reduce_rows(stats, logits, labels, torch.full((7,), 0.8))
    for rank in ranks:
        for key in whole:
            torch.testing.assert_close(rank["tp"][key], whole[key], rtol=0, atol=1e-6)


def test_lp_reg_candidates_over_two_data_parallel_ranks_are_those_of_one_process(gloo_pair):
    """Lp-Reg's default pool, the mini-batch over every data-parallel rank (``Pool``: exact counts and top-k)."""
    from verl_tokensel.core.rules.lp_reg import regularised_tokens

    (_, _, _, (lp, proxy, adv, tokens, rho)), ranks = gloo_pair
    whole, k = regularised_tokens(lp, proxy, adv, tokens, rho, Pool(None))
    assert k > 1 and whole.any()
    assert [r["lp_reg"][1] for r in ranks] == [k, k]
    assert torch.equal(torch.cat([r["lp_reg"][0] for r in ranks]), whole)


# ------------------------------------------------------------------------------------------------------------------
# through verl's real FSDP2 TrainingWorker


@dataclass(frozen=True)
class ProbeKnobs(Knobs):
    probe_kappa: float = knob(0.5, "min-p threshold of the probe", "n/a", ge=0, le=1)


PROBE_STATS = (VocabStat("top_k", "old", k=3), VocabStat("min_p", "old", kappa="probe_kappa"),
               VocabStat("top_k", "update", k=3))


@pytest.fixture
def probe_rule():
    seen = []

    @register_rule(PROBE, knobs=ProbeKnobs, needs=Needs(vocab=PROBE_STATS))
    def probe(x) -> LossTransform:
        seen.append({**{k: v.detach().clone() for k, v in x.vocab.items()}, "tokens": x.tokens.clone()})
        return LossTransform()

    try:
        yield seen
    finally:
        RULE_REGISTRY.pop(PROBE, None)


def _dense_reference(actor, batch, temperature: float, kappa: float):
    """The probe's three reductions from a plain forward of the module over each sequence: ``(b, R, ...)``."""
    module = actor.engine.module
    ids, responses = batch["input_ids"], batch["responses"]
    rows = {"old_top_k": [], "old_min_p": []}
    with torch.no_grad():
        for seq, resp in zip(ids.unbind(), responses.unbind()):
            logits = module(input_ids=seq.unsqueeze(0)).logits[0].float()  # row t predicts token t + 1
            start = seq.shape[0] - resp.shape[0] - 1
            z = logits[start:start + resp.shape[0]]
            rows["old_top_k"].append(_dense_top_k(z / temperature, 3))
            rows["old_min_p"].append(lp_reg_proxy_log_prob(z.unsqueeze(0), resp.unsqueeze(0), kappa,
                                                           temperature).squeeze(0))
    return rows


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_the_values_reach_the_rule_through_a_real_fsdp2_update(probe_rule, rmpad):
    from verl_tokensel.verl_glue.loss import SelectingLoss
    from verl_tokensel_cpu import worker as W
    from verl_tokensel_cpu.batches import make_update_batch

    temperature = 0.7
    actor = W.make_training_worker(lr=0.0, clip_grad=1e6, ppo_micro_batch_size_per_gpu=2,
                                   use_remove_padding=rmpad, temperature=temperature)
    cfg = W.selecting_actor_config(actor, PROBE)
    kappa = cfg.selection.knobs.probe_kappa
    actor.set_loss_fn(SelectingLoss(cfg))  # as the trainer installs it before the first old-log-prob pass
    batch = make_update_batch(actor, seed=5)
    reference = _dense_reference(actor, batch, temperature, kappa)
    outputs, infer = [], actor.worker.infer_batch
    actor.worker.infer_batch = lambda data, *a, **k: outputs.append(infer(data, *a, **k)) or outputs[-1]
    W.compute_old_log_probs(actor, batch)
    W.run_train_step(actor, batch, capture_params=False)
    seen = probe_rule
    assert seen, "the rule ran"
    got = {k: torch.cat([s[k][s["tokens"]] for s in seen]) for k in ("old_top_k", "old_min_p", "update_top_k")}
    # the micro-batches in order are the batch's rows in order (no dynamic batching, no shuffle)
    lengths = [r.shape[0] for r in batch["responses"].unbind()] if batch["responses"].is_nested else None
    want = {k: torch.cat(v) if lengths is None else torch.cat([t[:n] for t, n in zip(v, lengths)])
            for k, v in reference.items()}
    torch.testing.assert_close(got["old_top_k"], want["old_top_k"], rtol=0, atol=2e-5)
    torch.testing.assert_close(got["update_top_k"], want["old_top_k"], rtol=0, atol=2e-5)  # lr 0: same weights
    kept = want["old_min_p"] > -1000
    assert 0 < int(kept.sum()) < kept.numel(), "the probe's kappa filters some sampled tokens and keeps others"
    torch.testing.assert_close(got["old_min_p"][kept], want["old_min_p"][kept], rtol=0, atol=2e-5)
    assert (got["old_min_p"][~kept] < -1000).all()
    assert outputs and "log_probs" in outputs[0].keys()
    assert not [k for k in outputs[0].keys() if k.startswith("tokensel_vocab")], "they never leave the worker"


@pytest.mark.parametrize("key, value, override, match", [
    ("actor_rollout_ref.model.use_fused_kernels", True, "actor_rollout_ref.model.use_fused_kernels=True",
     "never form the logits"),
    ("algorithm.rollout_correction.bypass_mode", True, "algorithm.rollout_correction.bypass_mode=True",
     "reductions over the vocabulary"),
])
def test_a_rule_reading_the_vocabulary_is_refused_where_it_cannot_be_computed(probe_rule, key, value, override,
                                                                             match):
    from hydra import compose, initialize_config_module

    from verl_tokensel.core.errors import TokenSelectionConfigError
    from verl_tokensel.verl_glue.install import validate_driver_config

    with initialize_config_module("verl_tokensel.config", version_base=None):
        cfg = compose("tokensel_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                                     f"actor_rollout_ref.actor.token_selector={PROBE}", override])
    with pytest.raises(TokenSelectionConfigError, match=match) as err:
        validate_driver_config(cfg)
    assert key in str(err.value) and str(value) in str(err.value)


# ------------------------------------------------------------------------------------------------------------------
# through verl's real Megatron engine: two tensor-parallel ranks, one process


def _megatron_probe(rank: int, world: int, model_dir: str, tp: int) -> list:
    """The probe rule's values per micro-batch on this rank (lr 0, one update, temperature 0.7)."""
    from verl_tokensel.verl_glue.loss import SelectingLoss
    from verl_tokensel_cpu import batches as B, worker as W

    seen = []
    if PROBE not in RULE_REGISTRY:
        register_rule(PROBE, knobs=ProbeKnobs, needs=Needs(vocab=PROBE_STATS))(
            lambda x: seen.append({**{k: v.detach().clone() for k, v in x.vocab.items()},
                                   "tokens": x.tokens.clone()}) or LossTransform())
    actor = W.make_training_worker(model_dir, engine="megatron", rank=rank, world_size=world, tensor_parallel=tp,
                                   lr=0.0, clip_grad=1e9, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4,
                                   use_dynamic_bsz=False, use_remove_padding=True, temperature=0.7)
    cfg = W.selecting_actor_config(actor, PROBE)
    actor.set_loss_fn(SelectingLoss(cfg))
    batch = B.make_update_batch(actor, n=8, seed=4, resp_len=(3, 10))
    W.compute_old_log_probs(actor, batch)
    W.run_train_step(actor, batch, capture_params=False)
    return seen


@pytest.mark.requires("megatron", "mbridge")
def test_two_tensor_parallel_ranks_hand_the_rule_what_one_process_does(tmp_path):
    from helpers import distributed as D
    from verl_tokensel_cpu import tiny_model

    model_dir = str(tiny_model.build_tiny_model_dir(tmp_path / "qwen2", **tiny_model.MEGATRON_TINY_CONFIG))
    (one,) = D.run_distributed(_megatron_probe, world_size=1, args=(model_dir, 1), timeout=400)
    two = D.run_distributed(_megatron_probe, world_size=2, args=(model_dir, 2), timeout=400)
    assert one and all(len(r) == len(one) for r in two)
    kept = 0
    for rank in two:
        for a, b in zip(one, rank):
            assert torch.equal(a["tokens"], b["tokens"])
            tok = a["tokens"]
            for key in ("old_top_k", "update_top_k", "old_min_p"):
                torch.testing.assert_close(b[key][tok], a[key][tok], rtol=0, atol=1e-5)
            kept += int((a["old_min_p"][tok] > -1000).sum())
            torch.testing.assert_close(a["update_top_k"][tok], a["old_top_k"][tok], rtol=0, atol=1e-5)
    assert kept > 0, "some sampled tokens inside the proxy"
