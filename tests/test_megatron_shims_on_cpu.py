"""The Megatron CPU test bed's own pieces (``verl_tokensel_cpu.megatron``), without building an engine:

- it refuses to install off verl's CPU platform (a GPU host never runs with the shims), and bad settings are
  named with the valid values;
- the attention masks it builds for Megatron's local attention from verl's batches, against hand-written ones;
- a cached tiny model built with other config overrides is refused, not reused.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch

from verl_tokensel_cpu import megatron as M

pytestmark = pytest.mark.requires("megatron", "mbridge")


def test_refuses_off_the_cpu_platform():
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    code = ("from verl_tokensel_cpu.megatron import install_megatron_cpu_shims, MegatronCpuError\n"
            "import torch\n"
            "try:\n    install_megatron_cpu_shims()\nexcept MegatronCpuError as e:\n    print('REFUSED', e)\n"
            "from verl_tokensel_cpu.megatron import _tensor_cuda\n"
            "print('cuda untouched', torch.Tensor.cuda is not _tensor_cuda)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "VERL_PLATFORM=''" in out.stdout and "enable_cpu_mode()" in out.stdout
    assert "cuda untouched True" in out.stdout  # nothing was installed


def test_bad_dtype_names_the_valid_values():
    with pytest.raises(ValueError, match="dtype='fp16'.*fp32, bf16"):
        M.megatron_cpu_overrides(dtype="fp16")


def _causal_blocks(lengths):
    """Hand-written: token i may attend to j iff both are in the same segment and j <= i."""
    seg = [k for k, n in enumerate(lengths) for _ in range(n)]
    t = len(seg)
    return torch.tensor([[seg[i] == seg[j] and j <= i for j in range(t)] for i in range(t)])


def test_packed_mask_is_causal_within_each_sequence_only():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)  # three packed sequences (incl. TP padding)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=4, max_seqlen_kv=4)
    masked = M._packed_mask(params, 8, torch.device("cpu"))
    assert masked.shape == (1, 1, 8, 8)
    assert torch.equal(~masked[0, 0], _causal_blocks([3, 1, 4]))


def test_padded_mask_keeps_causal_valid_keys():
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # verl's [b, s] keep-mask, right-padded
    allowed = ~M._padded_mask(keep, 4, 4)[:, 0]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    for b in range(2):
        n = int(keep[b].sum())
        assert torch.equal(allowed[b, :n, :n], causal[:n, :n])  # valid rows: causal over valid keys
        assert not allowed[b, :n, n:].any()  # no valid token sees padding
        assert allowed[b, n:].any(dim=1).all()  # padded rows are never fully masked


def test_tiny_model_cache_with_other_overrides_is_refused(tmp_path):
    from verl_tokensel_cpu import tiny_model

    path = tiny_model.build_tiny_model_dir(tmp_path / "m", **tiny_model.MEGATRON_TINY_CONFIG)
    assert tiny_model.build_tiny_model_dir(path, **tiny_model.MEGATRON_TINY_CONFIG) == path
    with pytest.raises(ValueError, match="config overrides"):
        tiny_model.build_tiny_model_dir(path)
