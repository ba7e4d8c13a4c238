"""benchmarks/gpu_check.py and its shell scripts, exercised on CPU.

The script's real job needs a GPU (a Qwen3-0.6B-shaped model, 4k-token responses); here it runs in
its ``--tiny --device cpu`` mode end to end (verl's real TrainingWorker: FSDP2 with its default variants,
every preset of PRESETS and the two references, in one process on one model build; then the Megatron engine
on the CPU test bed of ``verl_tokensel_cpu.megatron``, fp32, with none, forking and gmts) and the JSON it
writes is checked preset by preset; a second run puts the GPU fallback's attention (torch SDPA per packed
sequence) on the Megatron test bed. The sanity checker (the part that must catch a leaking mask on the GPU)
is also fed hand-made micro-batches, one correct and one with a leak, and the watchdog is made to fire.
About 45 s on two idle cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
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
    # FSDP: the default variants (every preset); Megatron: the comparison of its own default
    r = _run(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp), "--warmup", "0",
              "--steps", "2", "--megatron-variants", "none", "forking", "gmts", "--deadline", "400"], timeout=500)
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
    gc = _load_script()
    for name in gc.default_variants():  # a row in the FSDP2 table for every preset
        assert any(line.startswith(name + " ") for line in r.stdout.splitlines()), (name, r.stdout)
    n = len(gc.default_variants())
    assert f"{n} of {n} variants ran" in r.stdout and "presets not in --variants" not in r.stdout


def test_default_variants_are_every_preset_and_the_two_references():
    """The FSDP phase's default list is PRESETS (read at run time) plus the references: a preset added to PRESETS
    is in it without anyone listing it, and a registered one too."""
    from verl_tokensel.core.config import PRESETS
    from verl_tokensel.core.resolve.presets import register_preset

    gc = _load_script()
    names = gc.default_variants()
    assert names[0] == "none" and len(names) == len(set(names))
    assert [gc.variant_preset(v) for v in names if v not in gc.EXTRA_VARIANTS] == [
        "none", *(p for p in PRESETS if p != "none")]
    assert set(names) == set(PRESETS) | set(gc.EXTRA_VARIANTS)
    assert names.index("none+entropy") == 1
    assert names.index("forking:no_grad_scores=false") == names.index("forking") + 1
    args = gc.parse_args(["--tiny", "--device", "cpu"])
    assert args.variants == names and args.steps == 1 and args.warmup == 0 and args.workload == "sweep"
    assert gc.parse_args([]).workload == "sweep" and gc.parse_args([]).budget_steps == 360
    few = gc.parse_args(["--variants", "none", "forking", "gmts"])
    assert few.workload == "compare" and few.steps == 5 and few.warmup == 1 and few.budget_steps == 150
    for name in names:  # every default variant parses
        gc.parse_variant(name, run_prepass=True, run_driver=True)
    register_preset("_gpu_check_probe", rule="gradient_mask", score="entropy", ratio=0.3, scope="micro_batch",
                    normaliser="all")
    try:
        assert gc.default_variants()[-1] == "_gpu_check_probe"
    finally:
        del PRESETS["_gpu_check_probe"]


def test_tiny_cpu_json_fields_and_values(tiny_run):
    """Every preset ran through the FSDP phase with what it needs, and its checks held."""
    from verl_tokensel.core.config import PRESETS

    _, res = tiny_run
    assert res["config"]["device"] == "cpu" and res["config"]["attn_implementation"] == "eager"
    assert res["env"]["verl"] and res["env"]["torch"]
    assert set(res["phases"]) >= {"env", "model", "fsdp_init", "fsdp_steps"}
    assert all(p["seconds"] >= 0 and p["status"] in ("ok", "over_budget") for p in res["phases"].values())
    fsdp = res["fsdp"]
    assert fsdp["status"] == "ok" and fsdp["rounds_done"] >= 1 and fsdp["tokens_per_step"] > 0
    assert fsdp["old_log_prob_mean"] < 0 and fsdp["old_entropy_mean"] > 0
    assert res["config"]["presets_not_in_variants"] == []
    v = fsdp["variants"]
    assert list(v) == _load_script().default_variants()
    assert fsdp["ran"] == list(v) and fsdp["not_run"] == {}
    assert v["none"]["step_ratio_vs_none"] == 1.0 and v["none"]["sanity"]["selected_fraction"] == 1.0
    for name, p in v.items():
        assert p["status"] == "ok", (name, p.get("reason"), p.get("sanity", {}).get("failures"))
        assert p["step_s_median"] > 0 and 0.1 < p["step_ratio_vs_none"] < 10.0, (name, p)
        assert p["peak_mem_bytes"] is None  # CPU: no device memory statistics
        s = p["sanity"]
        assert s["failures"] == [] and s["micro_batches"] >= 2 * p["update_passes"], (name, s)  # dynamic bsz split
        assert s["loss"] is not None and math.isfinite(s["loss"]) and s["grad_norm"] > 0, (name, s)
        assert s["unselected_with_grad"] == 0 and s["selected_without_grad"] == 0, (name, s)
        if p["selection"] is None:
            continue
        if "selection_may_be_empty" in s:  # lp_reg: its regularised tokens, possibly none on a random model
            assert p["selection"]["rule"] in _load_script().MAY_SELECT_NONE, (name, s)
            assert 0 <= s["selected_fraction"] <= 1 and 0 <= s["metric_selected_fraction"] <= 1, (name, s)
        else:
            assert 0 < s["selected_fraction"] <= 1 and 0 < s["metric_selected_fraction"] <= 1, (name, s)
        assert "tokensel/selected_fraction" in s["metric_keys"] and not s["metric_nan_scores"], (name, s)
        sel = p["selection"]
        if sel["rule"] in ("gradient_mask", "stapo", "lopti", "fipo", "m2po"):  # a gradient gate: logits checked
            assert s["grad_checked"] == s["micro_batches"] and "grad_check_skipped" not in s, (name, s)
        else:
            assert s["grad_checked"] == 0 and "no gradient gate" in s["grad_check_skipped"], (name, s)
        if sel["score_source"] == "prepass":  # the worker's real pre-pass, and the loss applied its tokens
            assert p["calculate_entropy"] is (name == "none+entropy"), name
            assert round(s["prepass_selected_tokens"]) == s["selected_tokens"], (name, s)
            assert s["selected_tokens"] > 0 or "selection_may_be_empty" in s, (name, s)
            assert any(k.startswith("tokensel/prepass/") for k in s["metric_keys"]), name
        assert p["driver_selection"] is (sel["score_source"] == "rollout"), name
        if p["driver_selection"]:
            assert s["driver_select_s"] >= 0 and len(p["driver_select_s"]) == fsdp["rounds_done"], name
        assert p["update_passes"] == len(PRESETS[p["preset"]].update_passes), name
    for name in ("forking", "forking:no_grad_scores=false", "random", "grad_norm", "forking_bottom"):
        s = v[name]["sanity"]
        assert s["count_checked"] == s["micro_batches"]  # ceil(ratio N) per micro-batch, checked each
        ratio = v[name]["selection"]["ratio"]
        assert ratio <= s["selected_fraction"] < ratio + 0.1, (name, s)
        assert v[name]["selection"]["scope"] == "micro_batch"
    assert v["forking"]["calculate_entropy"] is True and v["none+entropy"]["calculate_entropy"] is True
    assert v["forking:no_grad_scores=false"]["knobs"] == {"no_grad_scores": False}
    # each preset ran with what it needs
    g = v["gmts"]  # its own pre-pass at group scope (not its in-loss twin)
    assert g["selection"]["score_source"] == "prepass" and g["selection"]["scope"] == "group"
    assert g["sanity"]["expected_selected_tokens"] == g["sanity"]["selected_tokens"]
    assert 0.2 <= g["sanity"]["prepass_selected_fraction"] < 0.3
    assert v["kl_cov_global"]["sanity"]["expected_selected_tokens"] == v["kl_cov_global"]["sanity"]["selected_tokens"]
    fp = v["forking_paper"]  # the driver's batch-scope selection: ceil(0.2 N) of the whole batch
    assert fp["selection"]["scope"] == "batch" and fp["sanity"]["expected_selected_tokens"] == fp["sanity"][
        "selected_tokens"]
    for name in ("ktae", "gtpo"):
        assert v[name]["selection"]["score_source"] == "rollout" and v[name]["sanity"]["selected_fraction"] == 1.0
    assert v["gtpo"]["knobs"] == {"gtpo_entropy_threshold": 100.0}  # RANDOM_MODEL_KNOBS
    for name in ("lopti", "ar_lopti"):  # two whole update passes per step, the selected tokens' check off
        s = v[name]["sanity"]
        assert v[name]["update_passes"] == 2 and len(s["pass_losses"]) == 2 and "selected_grad_check_skipped" in s
        assert all(math.isfinite(x) for x in s["pass_losses"]), s
        assert {"tokensel/lopti/phase1/actor/pg_loss", "tokensel/lopti/phase2/actor/pg_loss"} <= set(
            s["metric_keys"]), s["metric_keys"]  # the rule's merge of the two passes
    a = v["archer"]  # Archer's KL loss on, its quantile count per response
    assert a["actor_settings"] == {"use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001}
    assert a["sanity"]["metric_kl_loss"] is not None and a["sanity"]["count_checked"] == a["sanity"]["micro_batches"]
    assert v["aspo"]["sanity"]["count_checked"] == v["aspo"]["sanity"]["micro_batches"]
    assert v["entropy_adv"]["calculate_entropy"] is True  # its shaping reads the update pass's entropy
    m = v["m2po_global"]  # its pre-pass (no forward) over the rollout log-probs the batch carries
    assert m["selection"]["score_source"] == "prepass" and m["selection"]["scope"] == "mini_batch"
    # the 1.0-wide shift (mean square 1/12 > 0.04): the rule masks some tokens
    assert 0 < m["sanity"]["selected_fraction"] < 1 and m["sanity"]["grad_checked"] > 0, m["sanity"]


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
    # gmts: the real pre-pass in both phases, the same tokens selected
    assert fsdp["variants"]["gmts"]["sanity"]["selected_tokens"] == gs["selected_tokens"]
    loss_f, loss_m = cmp["variants"]["gmts"]["loss"]
    assert abs(loss_f - loss_m) < 1e-5, cmp


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
    for name, sel in PRESETS.items():  # a caller that cannot run a preset's source gets its in-loss twin
        if sel is not None and getattr(sel, "score_source", "current") != "current":
            assert gc.parse_variant(name)[2] == {"score_source": "current", "scope": "micro_batch"}
            # the engine phases run the real pre-pass and the driver's selection: every preset as configured
            assert gc.parse_variant(name, run_prepass=True, run_driver=True) == (name, False, {})
    assert gc.parse_variant("gmts", run_prepass=True) == ("gmts", False, {})
    assert gc.parse_variant("forking_paper", run_prepass=True)[2] == {"score_source": "current",
                                                                     "scope": "micro_batch"}
    # an explicit knob wins: gmts's in-loss twin in a phase that runs the pre-pass
    assert gc.parse_variant("gmts:score_source=current,scope=micro_batch", run_prepass=True)[2] == {
        "score_source": "current", "scope": "micro_batch"}
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


def test_a_variant_that_cannot_run_is_reported_and_fails(tmp_path):
    """A variant that cannot run is not silently dropped: a config refused, or the phase budget spent before its
    sanity step. Its row says why, it is a FAILURE, the run exits 1, and the variants that fit still run; the presets
    --variants leaves out are printed."""
    out = tmp_path / "not_run.json"
    r = _run(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path), "--no-megatron",
              "--variants", "none", "forking:ratio=7", "forking", "--steps", "1", "--budget-steps", "0.05",
              "--deadline", "200"], timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    fsdp = res["fsdp"]
    v = fsdp["variants"]
    assert v["none"]["status"] == "ok" and fsdp["ran"] == ["none"] and fsdp["rounds_done"] == 1
    assert v["forking:ratio=7"]["status"] == "error" and "token_selection.ratio" in v["forking:ratio=7"]["reason"]
    assert v["forking"]["status"] == "skipped" and "phase budget was spent" in v["forking"]["reason"]
    assert list(fsdp["not_run"]) == ["forking:ratio=7", "forking"]
    assert any(f.startswith("forking:ratio=7: not run (error): config:") for f in res["failures"])
    assert any(f.startswith("forking: not run (skipped): the phase budget") for f in res["failures"])
    rows = {line.split()[0]: line for line in r.stdout.splitlines()
            if line.startswith(("forking:ratio=7 ", "forking "))}
    assert "ERROR: config:" in rows["forking:ratio=7"] and "SKIPPED: the phase budget" in rows["forking"], r.stdout
    assert "1 of 3 variants ran; not run: forking:ratio=7, forking" in r.stdout
    assert "presets not in --variants (not run): " in r.stdout and " gmts " in r.stdout
