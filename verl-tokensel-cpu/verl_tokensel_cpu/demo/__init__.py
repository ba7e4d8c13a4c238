"""The demo job (``verl-tokensel demo``): real verl GRPO on a tiny local model, one run per preset.

* :mod:`.task` and :mod:`.warmup`: the two-route reasoning template and the supervised warm start;
* :mod:`.dataset`: synthetic verifiable arithmetic in verl's RL parquet format;
* :mod:`.reward`: the custom reward function (exact match, then math-verify);
* :mod:`.rollouts`: entropy statistics and the preset's selection on the last step's rollouts;
* :mod:`.report`: comparison table and plot from verl's per-step metrics.

The command itself is :mod:`verl_tokensel_cpu.cli.demo`.
"""
