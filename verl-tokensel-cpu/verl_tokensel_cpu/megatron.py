"""verl's Megatron engine on CPU: the runtime shims of the CPU test bed (gloo, tiny models, no GPU).

Why one file over 400 lines: the seven shims are installed together, in order, by one call, and each is
short; about 45 lines are this docstring (the test bed's manual).

What it is for: running verl 0.9's REAL ``MegatronEngineWithLMHead`` (``TrainingWorker`` with
``model_engine=megatron``, megatron-core + mbridge) on a CPU host, with tensor, pipeline and data
parallelism over gloo, so that the token-selection loss, the pre-pass and the driver-side mask are tested
inside the engine they run in on a cluster. It is a functional test bed, not a training path: local
pure-torch layers instead of TransformerEngine, attention O(tokens^2), tiny models only.

Nothing here is imported by the selection product, and nothing is installed unless
:func:`install_megatron_cpu_shims` is called in a process whose env selects verl's CPU platform
(``VERL_PLATFORM=cpu``): it refuses otherwise, so a GPU host never runs with these shims. Callers: the
in-process harness (:mod:`verl_tokensel_cpu.worker`, ``engine="megatron"``) and, for verl's whole pipeline
(``trainer.device=cpu model_engine=megatron``), the CPU port's loading step in every Ray worker
(:func:`install_on_megatron_import`, armed by ``VERL_TOKENSEL_CPU_MEGATRON=1``).

Versions it was written against (``pip install 'verl_tokensel[megatron]'`` on Python 3.11):
megatron-core 0.16.1 (the newest release that declares Python 3.11 support; 0.17+ require 3.12) and
mbridge 0.15.1, with verl 0.9.1 and torch 2.13.0+cpu. No file of verl, megatron-core or mbridge is
edited; every shim below replaces a name at run time and says which upstream line it stands in for.

Settings the test bed needs (:func:`megatron_cpu_overrides` returns them as Hydra overrides):

* ``megatron.vanilla_mbridge=True`` (mbridge; megatron-bridge needs Python >= 3.12),
  ``override_transformer_config.attention_backend=local``, ``gradient_accumulation_fusion=False``,
  ``megatron.sequence_parallel=False`` (mbridge turns sequence parallelism on whenever TP > 1, and
  Megatron's torch norm then fails on CPU);
* ``TORCHDYNAMO_DISABLE=1``: verl wraps its Megatron entropy / log-prob kernels in ``torch.compile``,
  which needs a C++ toolchain per shape on CPU and is slow; eager gives the same values.

The shims (all installed together, idempotently):

1. ``torch.cuda`` as Megatron sees it: each ``megatron.*`` / ``mbridge.*`` module's global ``torch`` is
   a proxy whose ``cuda`` answers ``current_device()`` with ``"cpu"``, streams and events with
   ``torch.cpu``'s, and RNG calls with the CPU generator; its tensor factories map ``device='cuda'``
   (literal in Megatron's optimizer, grad scaler, clip_grads) to the CPU. Modules imported later get it
   too (an import hook).
2. ``megatron/core/tensor_parallel/random.py`` ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and
   write the CPU generator (upstream: ``torch.cuda.default_generators[idx]``); the tracker's warning that the
   CPU generator moved inside a fork (it always does, being the "GPU" one) is filtered out.
3. ``Tensor.cuda()`` / ``Module.cuda()`` return the CPU object (Megatron moves parameters with
   ``.cuda()`` in ``optimizer.py`` and the distributed optimizer's buffers).
4. ``param.type()`` reports CUDA type names inside Megatron's optimizer builders and ``clip_grads``, which
   accept only ``'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'`` / ``'torch.cuda.HalfTensor'``
   (``distrib_optimizer.py`` ``_build_model_and_main_param_groups``, ``optimizer.py``
   ``Float16OptimizerWithFloat16Params.__init__``, ``clip_grads.py`` ``clip_grad_by_total_norm_fp32``).
5. mbridge asks for the TransformerEngine layer spec unconditionally (``mbridge/core/llm_bridge.py``,
   ``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``): without TransformerEngine, the local
   spec, whose separate ``input_layernorm`` / ``pre_mlp_layernorm`` mbridge's weight names map onto.
6. Attention: Megatron's local ``DotProductAttention`` rejects packed sequences (verl's ``thd`` format,
   ``use_remove_padding=True``) and expects a ``[b, 1, s, s]`` masked-out mask where verl's padded batch
   passes a ``[b, s]`` keep-mask; the wrapper builds the causal per-sequence mask from the packed
   boundaries or the 2-D mask (O(tokens^2) memory per micro-batch; fine for tiny models).
7. Resuming: without TransformerEngine or Apex, Megatron's distributed optimizer wraps torch's Adam, and its
   ``DistributedOptimizer.state_dict`` (``distrib_optimizer.py``, "Extract 'step', for non-Apex/TE support")
   asserts that the per-parameter states hold exactly one ``step`` value; a freshly built optimizer has no
   state yet, which is exactly what loading a checkpoint builds its template from (verl's
   ``MegatronCheckpointManager.load_checkpoint`` -> ``sharded_state_dict(is_loading=True)``): AssertionError.
   For a fresh optimizer the step is 0 (the template's value; the checkpoint's replaces it). Then
   ``DistributedOptimizer.load_state_dict`` copies the saved shards into the main parameters with autograd on;
   in fp32 those are views of the model's leaf parameters ("a view of a leaf Variable that requires grad is
   being used in an in-place operation"): it runs under ``torch.no_grad()``, as torch's own
   ``Module.load_state_dict`` does. Afterwards each parameter gets its own ``step`` tensor holding the
   checkpoint's step (its ``param_groups``): upstream gives every parameter's state ONE shared ``step`` tensor,
   which torch's Adam then increments once per parameter on every step (the first parameter's bias correction is
   right, the others' run ahead), and it copies the fresh optimizer's unsaved step (a
   ``LocalNonpersistentObject``) over the loaded one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import types
from typing import Any, Optional

import torch

from verl_tokensel.import_hook import after_each_import, after_import

_INSTALLED = "_verl_tokensel_megatron_cpu"
_PREFIXES = ("megatron.", "mbridge.")
#: ``1`` (with ``VERL_PLATFORM=cpu``): install the shims in every process that imports Megatron; set by
#: ``trainer.device=cpu`` for ``model_engine=megatron`` and forwarded to the Ray workers
SHIMS_ENV = "VERL_TOKENSEL_CPU_MEGATRON"


class MegatronCpuError(RuntimeError):
    """The Megatron CPU test bed cannot run in this process (wrong platform, missing packages)."""


# ------------------------------------------------------------------------------------------------------
# 1. torch.cuda and tensor factories, as Megatron's modules see them
# ------------------------------------------------------------------------------------------------------


def _cpu_device(device: Any) -> Any:
    """``'cuda'``, ``'cuda:N'``, ``torch.device('cuda')`` and plain ints -> ``'cpu'``; anything else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaStandIn(types.ModuleType):
    """``torch.cuda`` for Megatron's modules on the CPU platform (shim 1)."""

    def __init__(self) -> None:
        super().__init__("verl_tokensel.megatron_cuda", "torch.cuda stand-in for Megatron on CPU")
        self.random = self  # megatron/core/tensor_parallel/random.py: torch.cuda.random.get_rng_state
        self.default_generators = (torch.default_generator,)
        self.Stream = torch.cpu.Stream
        self.Event = torch.cpu.Event

    def is_available(self) -> bool:
        return False

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any = None) -> None:
        return None

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def current_stream(self, device: Any = None):
        return torch.cpu.current_stream()

    def default_stream(self, device: Any = None):
        return torch.cpu.current_stream()

    def stream(self, stream: Any = None):
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        return None

    def nvtx_range_push(self, *args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        from verl_tokensel_cpu.platform import cpu_device_module

        return getattr(cpu_device_module, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "as_tensor",
              "zeros_like", "ones_like", "empty_like", "full_like", "linspace", "eye")


class _TorchForMegatron(types.ModuleType):
    """The global ``torch`` of a Megatron / mbridge module: ``torch`` itself but ``cuda`` and ``device=`` (shim 1)."""

    def __init__(self) -> None:
        super().__init__("torch", "torch as Megatron sees it on the CPU test bed")
        self.cuda = _CudaStandIn()
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_PROXY: Optional[_TorchForMegatron] = None


def _patch_module(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = _TORCH_PROXY


# ------------------------------------------------------------------------------------------------------
# 2. Megatron's CUDA RNG helpers
# ------------------------------------------------------------------------------------------------------


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """megatron/core/tensor_parallel/random.py ``_get_cuda_rng_state``: the CPU generator's state."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """megatron/core/tensor_parallel/random.py ``_set_cuda_rng_state``: set the CPU generator's state."""
    torch.set_rng_state(new_state)


class _OneGenerator(logging.Filter):
    """``CudaRNGStatesTracker.fork`` warns when the CPU generator moved inside a fork; here the "GPU" generator IS
    the CPU one, so it moves in every fork by design (the tracker's streams stay separate: it saves and restores
    them around each fork)."""

    MESSAGE = "CPU RNG state changed within GPU RNG context"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.MESSAGE


# ------------------------------------------------------------------------------------------------------
# 3. .cuda() and 4. CUDA type names
# ------------------------------------------------------------------------------------------------------

_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
               torch.float16: "torch.cuda.HalfTensor"}
_BASE_TYPE = torch.Tensor.type


@contextlib.contextmanager
def _cuda_type_names():
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _TYPE_NAMES:
            return _TYPE_NAMES[self.dtype]
        return _BASE_TYPE(self, dtype, non_blocking, **kwargs) if dtype is not None else _BASE_TYPE(self)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = _BASE_TYPE


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return call


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _module_cuda(self, device=None):
    return self


# ------------------------------------------------------------------------------------------------------
# 5. the local (non-TransformerEngine) layer spec in mbridge
# ------------------------------------------------------------------------------------------------------

#: local-spec parameter names (separate norms) -> the HF names mbridge maps the TE-fused ones to
_LOCAL_NORMS = {"input_layernorm.weight": "model.layers.{layer_number}.input_layernorm.weight",
                "pre_mlp_layernorm.weight": "model.layers.{layer_number}.post_attention_layernorm.weight"}


def install_local_layer_spec() -> None:
    """mbridge builds megatron-core's local (non-TransformerEngine) layers and maps their separate norms to HF
    names (shim 5). Device-independent: ``benchmarks/gpu_check.py`` also uses it on a GPU without
    TransformerEngine (whose torch extension PyPI ships as source only)."""
    from mbridge.core import bridge as mb_bridge, llm_bridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def _get_transformer_layer_spec(self, vp_stage=None):
        """mbridge/core/llm_bridge.py ``_get_transformer_layer_spec``: the same call with
        ``use_transformer_engine=False`` (upstream passes True unconditionally)."""
        assert self.config.normalization == "RMSNorm", "only RMSNorm is supported for now"
        extra = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters else {}
        self.has_vp_stage = bool(extra)
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, **extra)

    llm_bridge.LLMBridge._get_transformer_layer_spec = _get_transformer_layer_spec
    base_map = mb_bridge.Bridge._weight_name_mapping_mcore_to_hf

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        """mbridge/core/bridge.py ``_weight_name_mapping_mcore_to_hf`` plus the local spec's separate norms
        (upstream knows only TE's ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``)."""
        parts = mcore_weights_name.split(".")
        if parts[:2] == ["decoder", "layers"] and ".".join(parts[3:]) in _LOCAL_NORMS:
            return [_LOCAL_NORMS[".".join(parts[3:])].format(layer_number=parts[2])]
        return base_map(self, mcore_weights_name)

    mb_bridge.Bridge._weight_name_mapping_mcore_to_hf = _weight_name_mapping_mcore_to_hf


# ------------------------------------------------------------------------------------------------------
# 6. local attention with verl's packed (thd) and padded (bshd) batches
# ------------------------------------------------------------------------------------------------------


def _packed_mask(packed_seq_params, total: int, device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True = masked out: causal within each packed segment, nothing across."""
    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    bounds = bounds.to(device="cpu", dtype=torch.long)
    segment = torch.full((total,), -1, dtype=torch.long)
    for i in range(bounds.numel() - 1):
        segment[int(bounds[i]):int(bounds[i + 1])] = i
    pos = torch.arange(total)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed.to(device)[None, None]


def _padded_mask(keep: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """verl's ``[b, s]`` keep-mask -> Megatron's ``[b, 1, sq, sk]`` masked-out mask, causal."""
    keep = keep.to(torch.bool)
    causal = torch.ones(sq, sk, dtype=torch.bool, device=keep.device).tril()
    allowed = causal[None] & keep[:, None, :sk]
    allowed |= torch.eye(sq, sk, dtype=torch.bool, device=keep.device)[None]  # padded rows: not all-masked
    return ~allowed[:, None]


def _install_local_attention() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base_forward = DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """megatron/core/transformer/dot_product_attention.py ``DotProductAttention.forward`` with the
        mask it expects built from what verl passes (upstream asserts ``packed_seq_params is None``)."""
        if packed_seq_params is not None:
            if query.dim() == 3:  # thd: [t, heads, dim]; the local attention computes on [s, b, heads, dim]
                query, key, value = query[:, None], key[:, None], value[:, None]
            attention_mask = _packed_mask(packed_seq_params, query.size(0), query.device)
        elif attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = _padded_mask(attention_mask, query.size(0), key.size(0))
        return base_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=None)

    DotProductAttention.forward = forward


# ------------------------------------------------------------------------------------------------------
# 7. the distributed optimizer's state dict before its first step (loading a checkpoint)
# ------------------------------------------------------------------------------------------------------


def _install_fresh_optimizer_state_dict() -> None:
    from megatron.core.optimizer import distrib_optimizer

    DistOpt = distrib_optimizer.DistributedOptimizer
    base_state_dict = DistOpt.state_dict
    if getattr(base_state_dict, _INSTALLED, False):
        return

    @functools.wraps(base_state_dict)
    def state_dict(self):
        """megatron/core/optimizer/distrib_optimizer.py ``DistributedOptimizer.state_dict``, also for a torch Adam
        that has not stepped yet (upstream asserts one ``step`` among its per-parameter states, of which it has
        none): the step of a fresh optimizer is 0."""
        inner = self.optimizer
        if distrib_optimizer.HAVE_APEX_OR_TE or not isinstance(inner, torch.optim.Optimizer) or len(inner.state):
            return base_state_dict(self)
        first = next((p for group in inner.param_groups for p in group["params"]), None)
        if first is None:
            return base_state_dict(self)
        inner.state[first]["step"] = torch.tensor(0.0)
        try:
            return base_state_dict(self)
        finally:
            del inner.state[first]

    base_load_state_dict = DistOpt.load_state_dict

    @functools.wraps(base_load_state_dict)
    def load_state_dict(self, state_dict):
        """megatron/core/optimizer/distrib_optimizer.py ``DistributedOptimizer.load_state_dict`` under no_grad (it
        copies the checkpoint into the main parameters, which in fp32 are views of the model's leaf parameters),
        then one ``step`` tensor per parameter, holding the loaded ``param_groups``' step (upstream shares one
        tensor among all parameters, which torch's Adam increments once per parameter, and overwrites its value
        with the fresh optimizer's)."""
        with torch.no_grad():
            out = base_load_state_dict(self, state_dict)
        steps = {g.get("step") for g in state_dict.get("optimizer", {}).get("param_groups", [])}
        if not distrib_optimizer.HAVE_APEX_OR_TE and len(steps) == 1 and None not in steps:
            step = float(steps.pop())
            for param_state in self.optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = torch.tensor(step, dtype=param_state["step"].dtype)
        return out

    setattr(state_dict, _INSTALLED, True)
    DistOpt.state_dict = state_dict
    DistOpt.load_state_dict = load_state_dict


# ------------------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------------------

_ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def megatron_cpu_overrides(tensor_parallel: int = 1, pipeline_parallel: int = 1, dtype: str = "fp32") -> list[str]:
    """Hydra overrides of ``ppo_megatron_trainer`` for the CPU test bed (the actor's Megatron engine).

    ``dtype="bf16"`` is verl's default engine dtype; ``"fp32"`` is applied after validation by
    :func:`apply_engine_dtype` (verl's config accepts bf16/fp16 only), so the override here keeps bf16.
    """
    if dtype not in _ENGINE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: the Megatron test bed supports {', '.join(_ENGINE_DTYPES)}")
    g = "actor_rollout_ref.actor.megatron"
    t = f"{g}.override_transformer_config"
    return [
        "actor_rollout_ref.actor.strategy=megatron",
        f"{g}.tensor_model_parallel_size={tensor_parallel}",
        f"{g}.pipeline_model_parallel_size={pipeline_parallel}",
        f"{g}.sequence_parallel=False",
        f"{g}.vanilla_mbridge=True",
        f"{t}.attention_backend=local",
        f"+{t}.gradient_accumulation_fusion=False",
        f"+{t}.sequence_parallel=False",
        f"+{t}.use_cpu_initialization=True",
        f"+{t}.masked_softmax_fusion=False",
        f"+{t}.bias_activation_fusion=False",
        f"+{t}.bias_dropout_fusion=False",
        f"+{t}.apply_rope_fusion=False",
    ]


def megatron_gpu_overrides(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> list[str]:
    """The harness's Megatron overrides on a GPU (``VERL_TOKENSEL_HARNESS_DEVICE=cuda``): verl's own engine
    defaults (bf16, flash attention, megatron-bridge unless only mbridge imports), no shim, the given
    TP / PP sizes and no sequence parallelism at TP 1 (verl's default turns it on)."""
    import importlib

    g = "actor_rollout_ref.actor.megatron"
    try:  # importable, not just present: megatron-bridge imports TransformerEngine at import time
        importlib.import_module("megatron.bridge")
        bridge = True
    except ImportError:
        bridge = False
    return [
        "actor_rollout_ref.actor.strategy=megatron",
        f"{g}.tensor_model_parallel_size={tensor_parallel}",
        f"{g}.pipeline_model_parallel_size={pipeline_parallel}",
        f"{g}.sequence_parallel={tensor_parallel > 1}",
        f"{g}.vanilla_mbridge={not bridge}",
    ]


def apply_engine_dtype(actor_config, dtype: str) -> None:
    """Set the Megatron engine's ``dtype`` after verl's validation (which admits only bf16/fp16).

    ``fp32`` is the test bed's default: the Megatron-vs-FSDP comparison then measures the engines, not
    bf16 rounding (the FSDP harness runs in fp32 too). ``bf16`` leaves verl's value as it is.
    """
    dtype = {v: k for k, v in _ENGINE_DTYPES.items()}.get(dtype, dtype)  # "float32" -> "fp32"
    if dtype not in _ENGINE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: the Megatron test bed supports {', '.join(_ENGINE_DTYPES)}")
    object.__setattr__(actor_config.engine, "dtype", _ENGINE_DTYPES[dtype])


# ------------------------------------------------------------------------------------------------------
# install
# ------------------------------------------------------------------------------------------------------


def megatron_available() -> Optional[str]:
    """None when megatron-core and mbridge import, else the reason (with the install command)."""
    import importlib.util

    missing = [dist for mod, dist in (("megatron.core", "megatron-core"), ("mbridge", "mbridge"))
               if importlib.util.find_spec(mod.split(".")[0]) is None
               or (mod == "megatron.core" and importlib.util.find_spec(mod) is None)]
    if missing:
        return (f"{', '.join(missing)} not installed: the Megatron test bed needs them. "
                "Fix: python -m pip install 'verl_tokensel[megatron]' (or -e '.[test,megatron]' in a checkout)")
    return None


def install_megatron_cpu_shims() -> None:
    """Install shims 1-7 in this process (idempotent). Only under verl's CPU platform (``VERL_PLATFORM=cpu``)."""
    from verl_tokensel.switches import cpu_platform_requested

    global _TORCH_PROXY
    if getattr(torch, _INSTALLED, False):
        return
    if not cpu_platform_requested():
        raise MegatronCpuError(
            "verl_tokensel_cpu.megatron: the Megatron CPU shims are for verl's CPU platform only; this process has "
            f"VERL_PLATFORM={os.environ.get('VERL_PLATFORM', '')!r}. On a GPU host, verl's Megatron engine runs "
            "as it is. Fix: call verl_tokensel_cpu.platform.enable_cpu_mode() first (CPU test bed only)."
        )
    reason = megatron_available()
    if reason:
        raise MegatronCpuError(reason)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    _TORCH_PROXY = _TorchForMegatron()
    after_each_import("megatron_torch", lambda name: name.startswith(_PREFIXES), _patch_module)
    import megatron.core  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith(_PREFIXES) and module is not None:
            _patch_module(module)

    from megatron.core.tensor_parallel import random as mc_random

    mc_random._get_cuda_rng_state = _get_rng_state  # shim 2
    mc_random._set_cuda_rng_state = _set_rng_state
    logging.getLogger(mc_random.__name__).addFilter(_OneGenerator())
    torch.Tensor.cuda = _tensor_cuda  # shim 3
    torch.nn.Module.cuda = _module_cuda

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer  # shim 4

    DistOpt = distrib_optimizer.DistributedOptimizer
    DistOpt._build_model_and_main_param_groups = classmethod(
        _with_cuda_type_names(DistOpt.__dict__["_build_model_and_main_param_groups"].__func__))
    F16 = optimizer.Float16OptimizerWithFloat16Params
    F16.__init__ = _with_cuda_type_names(F16.__init__)
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    for mod in list(sys.modules.values()):  # modules that imported the function by name
        if mod is not None and getattr(mod, "__name__", "").startswith(_PREFIXES):
            if getattr(mod, "clip_grad_by_total_norm_fp32", None) is not None and mod is not clip_grads:
                mod.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    install_local_layer_spec()  # shim 5
    _install_local_attention()  # shim 6
    _install_fresh_optimizer_state_dict()  # shim 7
    setattr(torch, _INSTALLED, True)


def install_on_megatron_import() -> bool:
    """The CPU port's loading step for Megatron (:mod:`verl_tokensel_cpu.plugin`, at ``import verl`` under
    ``VERL_PLATFORM=cpu``): with :data:`SHIMS_ENV` ``=1``, install the shims right after this process first
    imports ``megatron.core`` (verl's engine package does, in each Ray worker), or now if it did already. Megatron's
    modules import on CPU as they are (verl's FSDP runs import them too); the shims then patch every loaded
    ``megatron.*`` / ``mbridge.*`` module and, through their own hook, those imported later. ``megatron`` itself is
    a namespace package (no loader to hook). Returns whether it is armed. A process that never imports Megatron
    (vLLM's) never pays for them; a failure is raised from that import, naming the cause (:class:`MegatronCpuError`)."""
    if os.environ.get(SHIMS_ENV, "").strip() != "1":
        return False
    after_import("megatron.core", lambda _megatron_core: _install_and_announce())
    return True


#: the line a process prints once the loading step installed the shims (tests find the actor worker's pid in it)
SHIMS_ANNOUNCEMENT = "verl-tokensel: Megatron CPU shims installed in pid {pid}"


def _install_and_announce() -> None:
    install_megatron_cpu_shims()
    print(SHIMS_ANNOUNCEMENT.format(pid=os.getpid()), file=sys.stderr, flush=True)


__all__ = ["MegatronCpuError", "SHIMS_ANNOUNCEMENT", "SHIMS_ENV", "apply_engine_dtype", "install_megatron_cpu_shims",
           "install_on_megatron_import", "megatron_available", "install_local_layer_spec", "megatron_cpu_overrides",
           "megatron_gpu_overrides"]
