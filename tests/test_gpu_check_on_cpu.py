"""benchmarks/gpu_check.py and its shell scripts, exercised on CPU.

The script's real job needs a GPU (a Qwen3-0.6B-shaped model, 4k-token responses); here it runs in
its ``--tiny --device cpu`` mode end to end (verl's real TrainingWorker, FSDP2, fp32) and the JSON it
writes is checked. The sanity checker (the part that must catch a leaking mask on the GPU) is also
fed hand-made micro-batches, one correct and one with a leak, and the watchdog is made to fire.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("script", ["gpu_check.sh", "pack_wheels.sh", "pack_gpu_site.sh"])
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
    assert "FSDP2:" in r.stdout and "gpu_check: ok" in r.stdout
    for name in ("none", "forking", "gmts"):
        assert any(line.startswith(name + " ") for line in r.stdout.splitlines()), r.stdout


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
    assert res["megatron"]["status"] == "skipped" and res["megatron"]["reason"]


def test_sanity_checker_catches_a_leak_and_a_wrong_count():
    from verl_tokensel.core.config import Selection

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
    sel = Selection(score="entropy", ratio=0.5, direction="top", scope="micro_batch", normaliser="all")
    ok = rec.check(sel, rmpad=True)
    assert ok["failures"] == [] and ok["selected_fraction"] == 0.5 and ok["grad_checked"] == 1

    rows[0, 4] = True  # sample 0, j = 3: unselected but got gradient
    leak = rec.check(sel, rmpad=True)
    assert leak["unselected_with_grad"] == 1 and any("non-zero logit gradient" in f for f in leak["failures"])

    wrong = rec.check(Selection(score="entropy", ratio=0.2, direction="top", scope="micro_batch",
                                normaliser="all"), rmpad=True)
    assert any("ceil(0.2 N) = 2" in f for f in wrong["failures"]), wrong["failures"]


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
