"""Run verl's real actor update on CPU with a tiny locally built model (no downloads).

- :mod:`verl_tokensel.testing.tiny_assets`: byte-level BPE tokenizer + random-init Qwen2 folder.
- :mod:`verl_tokensel.testing.cpu_worker`: verl's ``TrainingWorker`` (FSDP2) in-process on the
  CPU platform, driver-shaped update batches, one-step runner. Importing it selects verl's CPU
  platform for the process.
- :mod:`verl_tokensel.testing.pipeline`: inputs for a tiny run of verl's whole ``main_ppo`` pipeline
  on CPU (RL parquet, reward file, overrides), used with :func:`verl_tokensel.launch.run_main_ppo`.

Used by the test suite, ``verl-tokensel cpu-step`` and the benchmarks; handy for debugging a loss
or selector on a laptop.
"""
