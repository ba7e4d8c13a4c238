"""benchmarks/gpu_check.py and its shell scripts, exercised on CPU.

The script's real job needs a GPU (a Qwen3-0.6B-shaped model, 4k-token responses); here it runs in
its ``--tiny --device cpu`` mode end to end (verl's real TrainingWorker: FSDP2, then the Megatron engine
on the CPU test bed of ``verl_tokensel_cpu.megatron``, fp32) and the JSON it writes is checked; a second
run puts the GPU fallback's attention (torch SDPA per packed sequence) on the Megatron test bed. The
sanity checker (the part that must catch a leaking mask on the GPU) is also fed hand-made micro-batches,
one correct and one with a leak, and the watchdog is made to fire. About 40 s on two idle cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _run(args, timeout):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env=env)


@pytest.mark.parametrize("script", ["gpu_check.sh", "pack_wheels.sh", "pack_gpu_site.sh", "pack_megatron_wheels.sh"])
def test_shell_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_check_sh_refuses_a_machine_without_gpu_torch():
    """Step 1 of gpu_check.sh: no CUDA torch -> exit 4 with the reason, before installing anything."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "/nonexistent-wheels"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert "ERROR: torch" in r.stderr and "--tiny --device cpu" in r.stderr


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


HAVE_MEGATRON = _importable("megatron.core") and _importable("mbridge")
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core / mbridge are not installed "
                                    "(the Megatron phase's CPU test bed needs them; without them it reports itself "
                                    "skipped, checked in test_tiny_cpu_run_passes_and_prints_the_table)")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    if importlib.util.find_spec("verl") is None:  # pragma: no cover
        pytest.skip("verl is not installed")
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "gpu_check.json"
    r = _run(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp), "--warmup", "0",
              "--steps", "2", "--variants", "none", "forking", "gmts", "--deadline", "400"], timeout=500)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(out.read_text())


def test_tiny_cpu_run_passes_and_prints_the_table(tiny_run):
    r, res = tiny_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert res["status"] == "ok" and res["failures"] == []
    assert "FSDP2:" in r.stdout and "Megatron:" in r.stdout and "gpu_check: ok" in r.stdout
    if not HAVE_MEGATRON:  # pragma: no cover
        assert res["megatron"]["status"] == "skipped" and "not installed" in res["megatron"]["reason"]
        return
    assert "stack: " in r.stdout and "FSDP2 vs Megatron" in r.stdout
    for name in ("none", "forking", "gmts"):  # one row per variant in each table
        assert sum(line.startswith(name + " ") for line in r.stdout.splitlines()) == 2, r.stdout


def test_tiny_cpu_json_fields_and_values(tiny_run):
    _, res = tiny_run
    assert res["config"]["device"] == "cpu" and res["config"]["attn_implementation"] == "eager"
    assert res["env"]["verl"] and res["env"]["torch"]
    assert set(res["phases"]) >= {"env", "model", "fsdp_init", "fsdp_steps"}
    assert all(p["seconds"] >= 0 and p["status"] in ("ok", "over_budget") for p in res["phases"].values())
    fsdp = res["fsdp"]
    assert fsdp["status"] == "ok" and fsdp["rounds_done"] >= 1 and fsdp["tokens_per_step"] > 0
    v = fsdp["variants"]
    assert list(v) == ["none", "forking", "gmts"]
    assert v["none"]["step_ratio_vs_none"] == 1.0
    for name, p in v.items():
        assert p["step_s_median"] > 0 and 0.2 < p["step_ratio_vs_none"] < 5.0, (name, p)
        assert p["peak_mem_bytes"] is None  # CPU: no device memory statistics
        s = p["sanity"]
        assert s["failures"] == [] and s["micro_batches"] >= 2, s  # dynamic bsz split the mini-batch
        assert s["grad_checked"] == s["micro_batches"] and s["unselected_with_grad"] == 0
        assert s["selected_without_grad"] == 0
    assert v["none"]["sanity"]["selected_fraction"] == 1.0
    for name in ("forking", "gmts"):
        s = v[name]["sanity"]
        assert s["count_checked"] == s["micro_batches"]  # ceil(0.2 N) per micro-batch, checked each
        assert 0.2 <= s["selected_fraction"] < 0.3, s
        assert 0.2 <= s["metric_selected_fraction"] < 0.3 and not s["metric_nan_scores"]
        assert v[name]["calculate_entropy"] is True
        assert v[name]["selection"]["scope"] == "micro_batch"
        assert v[name]["selection"]["ratio"] == 0.2
    assert fsdp["old_log_prob_mean"] < 0 and fsdp["old_entropy_mean"] > 0


@needs_megatron
def test_tiny_cpu_megatron_phase_on_the_test_bed(tiny_run):
    """The Megatron phase on the CPU test bed: same variants and checks as FSDP, gmts with its real pre-pass,
    the logit-gradient check through output_layer's hook, and the same numbers as FSDP on the same weights."""
    _, res = tiny_run
    assert set(res["phases"]) >= {"megatron"} and res["phases"]["megatron"]["status"] in ("ok", "over_budget")
    mega, fsdp = res["megatron"], res["fsdp"]
    assert mega["status"] == "ok" and mega["failures"] == [] and mega["engine"] == "megatron", mega.get("error")
    assert mega["rounds_done"] >= 1 and mega["tokens_per_step"] == fsdp["tokens_per_step"]
    stack = mega["stack"]
    assert stack["platform"].startswith("cpu test bed") and stack["layers"] == "local"
    assert stack["bridge"].startswith("mbridge") and stack["vanilla_mbridge"] is True
    assert stack["megatron_core"] and stack["engine_dtype"] == "float32" and stack["tensor_parallel"] == 1
    assert stack["core_attention_class"] == "DotProductAttention"
    v = mega["variants"]
    assert list(v) == ["none", "forking", "gmts"] and mega["baseline"] == "none"
    assert v["none"]["step_ratio_vs_none"] == 1.0
    for name, p in v.items():
        assert p["step_s_median"] > 0 and p["peak_mem_bytes"] is None, (name, p)
        s = p["sanity"]
        assert s["failures"] == [] and s["micro_batches"] >= 2, s
        # output_layer's forward hook saw every micro-batch; no unselected token got logit gradient
        assert s["grad_checked"] == s["micro_batches"] and s["unselected_with_grad"] == 0, s
        assert s["selected_without_grad"] == 0 and "grad_check_skipped" not in s
    assert v["none"]["sanity"]["selected_fraction"] == 1.0
    f = v["forking"]
    assert f["selection"]["score_source"] == "current" and f["selection"]["scope"] == "micro_batch"
    assert f["sanity"]["count_checked"] == f["sanity"]["micro_batches"] and f["calculate_entropy"] is True
    assert 0.2 <= f["sanity"]["selected_fraction"] < 0.3
    g = v["gmts"]  # the real pre-pass: group scope, one selection for the mini-batch before the update
    assert g["selection"]["score_source"] == "prepass" and g["selection"]["scope"] == "group"
    assert g["calculate_entropy"] is False  # the pre-pass scored; the update pass needs no entropy
    gs = g["sanity"]
    assert gs["expected_selected_tokens"] == gs["selected_tokens"] == round(gs["prepass_selected_tokens"])
    assert 0.2 <= gs["prepass_selected_fraction"] < 0.3 and gs["prepass_reused_old_pass"] == 0.0
    # same weights, same batch, fp32: the engines agree
    cmp = res["fsdp_vs_megatron"]
    assert abs(mega["old_log_prob_mean"] - fsdp["old_log_prob_mean"]) < 1e-4, cmp
    for name in ("none", "forking"):
        loss_f, loss_m = cmp["variants"][name]["loss"]
        gn_f, gn_m = cmp["variants"][name]["grad_norm"]
        assert abs(loss_f - loss_m) < 1e-5 and abs(gn_f - gn_m) < 1e-4 * gn_f, cmp
    assert "gmts" not in cmp["variants"]  # FSDP measured gmts in the loss, Megatron with its pre-pass


@needs_megatron
def test_tiny_cpu_megatron_with_the_gpu_fallback_attention(tiny_run, tmp_path):
    """--megatron-attention sdpa: the attention gpu_check.py puts into megatron-core's local layers on a GPU
    without TransformerEngine, here on the CPU test bed: same log-probs as the test bed's own attention."""
    _, first = tiny_run
    out = tmp_path / "sdpa.json"
    r = _run(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path), "--no-fsdp",
              "--megatron-attention", "sdpa", "--warmup", "0", "--steps", "1", "--variants", "none", "forking",
              "--deadline", "300"], timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["fsdp"]["status"] == "skipped" and "FSDP2: skipped: --no-fsdp" in r.stdout
    mega = res["megatron"]
    assert mega["status"] == "ok" and mega["stack"]["attention"] == "torch sdpa per packed sequence"
    assert abs(mega["old_log_prob_mean"] - first["megatron"]["old_log_prob_mean"]) < 1e-5
    assert abs(mega["old_entropy_mean"] - first["megatron"]["old_entropy_mean"]) < 1e-5
    for name in ("none", "forking"):
        s = mega["variants"][name]["sanity"]
        assert s["failures"] == [] and s["grad_checked"] == s["micro_batches"] and s["unselected_with_grad"] == 0


def test_sanity_checker_catches_a_leak_and_a_wrong_count():
    from verl_tokensel.core.config import preset

    gc = _load_script()
    rec = gc.SanityRecorder(type("FakeActor", (), {"module": object()})())  # no lm_head: no hook
    rec.handle = object()  # pretend the hook ran: the rows below are what it would have stored
    # two responses: prompt 2 + response 4, prompt 3 + response 2 -> packed length 11
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)  # 3 of 6 = ceil(0.5 * 6)
    rows = torch.zeros(1, 11, dtype=torch.bool)
    # response token j of sample i is predicted at packed position offset_i + prompt_i - 1 + j
    rows[0, [2, 3]] = True  # sample 0, j = 1, 2
    rows[0, 6 + 3 - 1] = True  # sample 1, j = 0
    rec.calls = [{"prompt_lens": [2, 3], "resp_lens": [4, 2], "mask": mask, "valid": valid}]
    rec.grad_rows = [rows]
    sel = preset("gradient_mask", score="entropy", ratio=0.5, direction="top", scope="micro_batch", normaliser="all")
    ok = rec.check(sel, rmpad=True)
    assert ok["failures"] == [] and ok["selected_fraction"] == 0.5 and ok["grad_checked"] == 1

    rows[0, 4] = True  # sample 0, j = 3: unselected but got gradient
    leak = rec.check(sel, rmpad=True)
    assert leak["unselected_with_grad"] == 1 and any("non-zero logit gradient" in f for f in leak["failures"])

    wrong = rec.check(preset("gradient_mask", score="entropy", ratio=0.2, direction="top", scope="micro_batch",
                                    normaliser="all"), rmpad=True)
    assert any("ceil(0.2 N) = 2" in f for f in wrong["failures"]), wrong["failures"]


def test_sanity_checker_megatron_layout_and_step_totals():
    """Megatron's output_layer gives logits [tokens, 1, vocab] (flags [tokens, 1]); with align > 1 every packed
    sequence is padded to a multiple of it. A pre-pass selection is checked by its total over the step."""
    from verl_tokensel.core.config import preset

    gc = _load_script()
    rec = gc.SanityRecorder(type("FakeActor", (), {"module": object()})(), align=4)
    rec.handle = object()
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    # sample 0: 2 + 4 = 6 tokens, padded to 8; sample 1 starts at 8
    rows = torch.zeros(13, 1, dtype=torch.bool)
    rows[[2, 3], 0] = True  # sample 0, j = 1, 2 (position 2 - 1 + j)
    rows[8 + 3 - 1, 0] = True  # sample 1, j = 0
    rec.calls = [{"prompt_lens": [2, 3], "resp_lens": [4, 2], "mask": mask, "valid": valid}]
    rec.grad_rows = [rows]
    group = preset("gradient_mask", score="gmts", ratio=0.5, direction="top", scope="group", normaliser="all",
                   score_source="prepass")
    ok = rec.check(group, rmpad=True, expected_selected=3)
    assert ok["failures"] == [] and ok["grad_checked"] == 1 and ok["count_checked"] == 0, ok
    short = rec.check(group, rmpad=True, expected_selected=4)
    assert any("3 tokens selected over the step, 4 expected" in f for f in short["failures"]), short["failures"]
    # what the step must select: ceil(ratio n) per pool
    assert gc.expected_selected(group, [4, 2, 3, 5], ["a", "a", "b", "b"]) == 3 + 4
    assert gc.expected_selected(dataclasses.replace(group, scope="sequence"), [4, 2, 3, 5], ["a"] * 4) == 2 + 1 + 2 + 3
    assert gc.expected_selected(dataclasses.replace(group, scope="mini_batch"), [4, 2, 3, 5], ["a"] * 4) == 7
    per_micro_batch = dataclasses.replace(group, scope="micro_batch", score_source="current")
    assert gc.expected_selected(per_micro_batch, [4], ["a"]) is None


def test_recording_loss_stays_a_selecting_loss():
    """The sanity step's loss must still be a SelectingLoss: the pre-pass and the no-graph scores look for one."""
    from verl_tokensel.verl_glue.loss import SelectingLoss

    gc = _load_script()
    rec = gc.SanityRecorder(type("FakeActor", (), {"module": object()})())
    loss = rec.wrap(SelectingLoss(config=None))
    assert isinstance(loss, SelectingLoss) and type(loss).__name__ == "RecordingSelectingLoss"
    assert loss.selection is None


def test_packed_sdpa_matches_per_sequence_causal_attention():
    """The GPU fallback's attention: grouped-query heads (Megatron's repeat_interleave order), padded packing,
    nothing attended across sequences; against a plain softmax(q k^T) v per sequence and head."""
    gc = _load_script()
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    starts, lengths = [0, 6, 10], [5, 3, 4]  # row 5 and rows 9 are padding
    total = 14
    q, k, v = (torch.randn(total, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    out = gc.packed_sdpa(q, k, v, starts, lengths, scale=0.3)
    want = torch.zeros_like(out)
    for s0, n in zip(starts, lengths):
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = 0.3 * q[s0:s0 + n, h] @ k[s0:s0 + n, g].T
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            want[s0:s0 + n, h] = scores.softmax(-1) @ v[s0:s0 + n, g]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert out[5].abs().sum() == 0 and out[9].abs().sum() == 0


def test_variant_spec_parsing():
    from verl_tokensel.core.config import PRESETS

    gc = _load_script()
    assert gc.parse_variant("none") == ("none", False, {})
    assert gc.parse_variant("none+entropy") == ("none", True, {})
    assert gc.parse_variant("forking:ratio=0.3,direction=bottom") == ("forking", False,
                                                                      {"ratio": 0.3, "direction": "bottom"})
    for name, sel in PRESETS.items():  # presets scored outside the loss are measured inside it
        if sel is not None and getattr(sel, "score_source", "current") != "current":
            assert gc.parse_variant(name)[2] == {"score_source": "current", "scope": "micro_batch"}
    # the Megatron phase runs the worker's real pre-pass; the driver's rollout selection is still converted
    assert gc.parse_variant("gmts", run_prepass=True) == ("gmts", False, {})
    assert gc.parse_variant("forking_paper", run_prepass=True)[2] == {"score_source": "current",
                                                                     "scope": "micro_batch"}
    with pytest.raises(ValueError, match="PRESET"):
        gc.parse_variant("no_such_preset")


def test_deadline_writes_partial_json_and_exits_3(tmp_path):
    out = tmp_path / "partial.json"
    r = _run(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path), "--deadline", "2"],
             timeout=120)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "overall deadline of 2s exceeded" in r.stderr
    res = json.loads(out.read_text())
    assert res["status"] == "deadline_exceeded" and res["failures"]
