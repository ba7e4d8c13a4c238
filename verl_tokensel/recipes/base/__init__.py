"""The recipes' shared parts: an engine overlay (``fsdp``, ``megatron``) and the setups' hyperparameters
(``grpo``, ``dapo``, ``dapo_8020``, ``gmts``, ``gmts_dapo``); package data (a package so that setuptools ships
it as one)."""
