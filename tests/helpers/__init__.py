"""Test helpers (never shipped): importable as ``helpers`` from any test module (pytest puts ``tests/`` on
``sys.path`` because ``tests/`` has no ``__init__.py``).

- :mod:`.loss_inputs`: a micro-batch exactly as verl's engines hand it to the actor loss (no engine).
- :mod:`.grad_probe`: per-token gradient probes through the in-process worker.
- :mod:`.distributed`: data-parallel (gloo, spawned ranks) runs of the in-process worker.
- :mod:`.ray_actor`: verl's real actor worker group on a local Ray cluster (selects the CPU platform).
- :mod:`.pipeline`: inputs for a tiny run of verl's whole ``main_ppo`` pipeline on CPU.
"""
