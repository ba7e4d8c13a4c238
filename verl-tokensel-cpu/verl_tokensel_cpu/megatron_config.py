"""verl's Megatron engine config for the CPU pipeline: the same dataclass, admitting fp32 as well.

``trainer.device=cpu`` with ``model_engine=megatron`` points ``actor_rollout_ref.{actor,ref}.megatron._target_``
here (:mod:`verl_tokensel_cpu.pipeline`). verl's ``McoreEngineConfig.__post_init__`` asserts
``dtype in ["bfloat16", "float16"]``; the engine itself runs in fp32 when asked (``PrecisionType.to_dtype``,
``fp16 = bf16 = False``: Megatron's fp32 optimizer), which is what the CPU pipeline wants: its rollout is
fp32, so the weights synced into vLLM-CPU are the actor's exactly. Every other check is verl's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import McoreEngineConfig

#: spellings of fp32 accepted here (verl's ``PrecisionType`` maps both to torch.float32)
FP32 = ("float32", "fp32")


@dataclass
class CpuMcoreEngineConfig(McoreEngineConfig):
    """``McoreEngineConfig`` that also admits ``dtype`` float32 (stored as ``"float32"``)."""

    def __post_init__(self) -> None:
        if self.dtype not in FP32:
            super().__post_init__()
            return
        # verl's validation with a dtype it admits, then the fp32 the engine runs in (the field is frozen after
        # __init__, hence object.__setattr__, as verl's BaseConfig allows for its own mutable fields)
        object.__setattr__(self, "dtype", "bfloat16")
        super().__post_init__()
        object.__setattr__(self, "dtype", "float32")


__all__ = ["CpuMcoreEngineConfig", "FP32"]
