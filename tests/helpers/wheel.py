"""The release wheel and venvs that use it, shared by the wheel and multi-node tests (helper, not a test).

* :func:`build_wheel`: ``python -m build`` of the product (sdist, then the wheel from it) into a folder;
  :func:`build_cpu_wheel`: the CPU distribution's wheel (``verl-tokensel-cpu/``).
* :func:`make_venv`: a venv with no pip and no packages of its own, whose third-party dependencies are
  this test run's pinned stack through a plain path entry (not a site dir, so the checkout's editable
  installs are invisible there), without either distribution of this repository (their metadata and entry
  points are left out too: ``import verl_tokensel`` fails unless the product wheel is installed into it), with
  a ``ray`` command run by the venv's python; ``deps_of=("verl", ...)`` shares only those distributions and
  their requirements, recursively (:func:`requirement_closure`): the packages ``pip install verl`` brings, no more.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import verl_tokensel

ROOT = Path(__file__).resolve().parents[2]
CPU_ROOT = ROOT / "verl-tokensel-cpu"
WHEEL_NAME = f"verl_tokensel-{verl_tokensel.__version__}-py3-none-any.whl"
CPU_WHEEL_NAME = f"verl_tokensel_cpu-{verl_tokensel.__version__}-py3-none-any.whl"
#: what the shared dependencies leave out: the two distributions of this repository (and their editable hooks)
OUR_DISTRIBUTIONS = ("verl_tokensel", "__editable__.verl_tokensel", "__editable___verl_tokensel")
#: verl's env vars that a venv's processes do not inherit from the test process
CHECKOUT_VERL_ENV = ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM", "VERL_ENGINE_DEVICE")


def build_wheel(out: Path) -> tuple[Path, Path]:
    """Build the sdist and the wheel into ``out``; returns (wheel, sdist)."""
    res = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wheel = out / WHEEL_NAME
    sdists = list(out.glob("verl_tokensel-*.tar.gz"))
    assert wheel.is_file() and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return wheel, sdists[0]


def build_cpu_wheel(out: Path) -> Path:
    """Build the CPU distribution's wheel into ``out`` (from its sdist, as the product's: no stale ``build/``)."""
    res = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(CPU_ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wheel = out / CPU_WHEEL_NAME
    assert wheel.is_file(), sorted(p.name for p in out.iterdir())
    return wheel


def requirement_closure(roots) -> dict[str, frozenset]:
    """``{distribution: extras}`` of the installed ``roots`` and everything their metadata requires, recursively
    (markers evaluated here, extras followed): what ``pip install <roots>`` installs, read from this run's
    environment. Raises if a required distribution is not installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, frozenset] = {}
    todo = [(name, frozenset()) for name in roots]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        dist = metadata.distribution(name)
        seen[key] = seen.get(key, frozenset()) | extras
        envs = [{"extra": e} for e in seen[key] or {""}]
        for req in map(Requirement, dist.requires or ()):
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def shared_deps(base: Path, deps_of=None) -> Path:
    """A folder of links to every entry of this run's site-packages but this repository's distributions; with
    ``deps_of``, to the entries (packages, modules, dist-info) of :func:`requirement_closure` ``(deps_of)`` only."""
    from importlib import metadata

    purelib = Path(sysconfig.get_paths()["purelib"])
    deps = base / "shared_deps"
    deps.mkdir()
    if deps_of is None:
        names = {e.name for e in purelib.iterdir() if not e.name.startswith(OUR_DISTRIBUTIONS)}
    else:
        names = set()
        for dist_name in requirement_closure(deps_of):
            dist = metadata.distribution(dist_name)
            names.add(Path(str(dist._path)).name)
            names.update(f.parts[0] for f in dist.files or () if f.parts and f.parts[0] not in ("..", "__pycache__"))
    for name in sorted(names):
        if (purelib / name).exists():
            (deps / name).symlink_to(purelib / name)
    return deps


def make_venv(base: Path, wheel: Path | None = None, *more_wheels: Path, deps_of=None) -> tuple[Path, dict, Path, Path]:
    """A venv under ``base`` (see module doc), with ``wheel`` (and ``more_wheels``) installed non-editable if
    given; returns (python, env vars for processes using it, a work dir outside the checkout, the venv's
    site-packages). ``deps_of``: share only these distributions' requirement closure (:func:`shared_deps`)."""
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the pinned dependencies of this run, as a plain path entry after the venv's own site-packages
    (site / "_tokensel_shared_deps.pth").write_text(f"{shared_deps(base, deps_of)}\n")
    if wheel is not None:
        # PYTHONPATH would reach the venv's pip too: a checkout on it (its egg-info) reads as installed already
        res = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                              str(wheel), *map(str, more_wheels)], capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert res.returncode == 0, res.stderr[-3000:]
    # the `ray` command of the shared dependencies, run by this venv's python (console scripts are not shared)
    ray_cli = venv / "bin" / "ray"
    ray_cli.write_text(f"#!{py}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    ray_cli.chmod(0o755)
    # nothing of this test process's set-up: the CPU harness, once imported, puts its platform module (the
    # checkout's) into VERL_USE_EXTERNAL_MODULES, which a venv without it cannot import. Emptied, not removed:
    # a Ray head started with this env lays it over the test process's (verl reads "" as unset)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(dict.fromkeys(CHECKOUT_VERL_ENV, ""))
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", PYTHONNOUSERSITE="1")
    cwd = base / "work"
    cwd.mkdir()
    return py, env, cwd, site
