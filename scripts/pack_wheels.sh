#!/usr/bin/env bash
# Download, on a machine WITH network, every wheel that scripts/gpu_check.sh installs offline.
#
#   bash scripts/pack_wheels.sh                  # -> wheels/ (git-ignored), for CPython 3.12 x86_64 Linux
#   bash scripts/pack_wheels.sh /path/to/dir     # another folder
#   PY_VERSION=3.11 bash scripts/pack_wheels.sh  # another target Python (the GPU image's, not this machine's)
#   SKIP_PRESENT=names.txt bash scripts/pack_wheels.sh   # leave out packages the GPU image already has
#   CHUNK_MIB=50 bash scripts/pack_wheels.sh     # also lay the folder out as chunk1/, chunk2/, ... <= 50 MiB
#
# What it packs: this package built as a wheel, verl==0.9.1, transformers==5.9.0, tensordict==0.10.0 and
# the whole dependency closure pip resolves for them on the target platform, EXCEPT torch and what
# comes with it (triton, nvidia-*, cuda-*) and flash-attn: the GPU image is assumed to ship a CUDA
# build of torch (and flash-attn if it has it); gpu_check.sh checks torch before installing anything.
# The Megatron phase's stack (megatron-core, mbridge, optionally TransformerEngine) is packed apart by
# scripts/pack_megatron_wheels.sh into wheels/megatron/, which gpu_check.sh leaves out of this folder's
# install and puts on PYTHONPATH on its own (step 2c there).
#
# How: `pip install --dry-run --report` resolves the closure for the target (--python-version,
# --platform, binary wheels only) without installing; the report's list minus the excluded names is
# then fetched with `pip download --no-deps`, one pinned name==version each (PINS.txt), so the folder
# holds exactly one version of every package. Dependencies published only as source (antlr4 4.9.3,
# which omegaconf 2.3 pins) are built here into pure-Python wheels first; without them pip would
# quietly backtrack to hydra-core 0.11.
#
# SKIP_PRESENT: a file listing what the GPU image already has, one package a line: `name==version`
# (`pip list --format=freeze` run there) or a bare name. A listed package is not downloaded when the
# image's version satisfies every requirement on it in the closure; for a bare name, when nothing
# caps or pins it (transformers 5.9 needs tokenizers <= 0.23.0, the image has 0.23.2: kept). The
# pinned packages above are always packed. A bare name can still be too OLD for a lower bound:
# `pip install --no-index` on the GPU machine then fails loudly, naming it; re-pack without it.
#
# CHUNK_MIB: for a transfer that carries at most 64 MiB at a time (ray's wheel alone is 75.6 MiB),
# the folder is also copied into chunkN/ subfolders of at most CHUNK_MIB each, splitting bigger wheels
# into NAME.whl.part-aa, -ab, ...; gpu_check.sh puts them back together (see its header for the
# one-call-per-chunk recipe).
#
# Measured 2026-11-29 (CPython 3.12, manylinux x86_64): full closure 124 wheels, 257 MiB (ray 75.6,
# pyarrow 52.5, wandb 19.4, numpy 15.0, pandas 11.5 MiB); with SKIP_PRESENT=scripts/gpu_image_packages.txt
# 85 wheels, 150 MiB (ray, wandb, transformers, grpcio, ...), as CHUNK_MIB=56: 3 chunks (56, 56, 36 MiB).
# Resolving takes ~5 min (pip backtracks over old omegaconf releases); installing the full folder into a
# bare Python 3.12 venv took 2 min on 2 busy cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/wheels}"
PY_VERSION="${PY_VERSION:-3.12}"
PY="${PYTHON:-python3}"
# hydra/omegaconf floors: with an unbuildable antlr4 pip backtracks to 2019's hydra-core 0.11
REQS=(verl==0.9.1 transformers==5.9.0 tensordict==0.10.0 "hydra-core>=1.3" "omegaconf>=2.3")
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)
PINNED_RE='^(verl|transformers|tensordict|verl-tokensel)$'
# torch's own stack and flash-attn are the GPU image's (see gpu_check.sh's check)
EXCLUDE_RE='^(torch|torchvision|torchaudio|triton|flash-attn|nvidia-.*|cuda-.*)$'
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64)
PLAT_ARGS=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp)
for p in "${PLATFORMS[@]}"; do PLAT_ARGS+=(--platform "$p"); done

mkdir -p "$DEST"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "[pack_wheels] 1/4 building verl-tokensel and the source-only dependencies as wheels"
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$ROOT"
"$PY" -m pip wheel -q --no-deps -w "$DEST" "${SDIST_ONLY[@]}"
OWN_WHEEL="$(ls -t "$DEST"/verl_tokensel-*.whl | head -n1)"

echo "[pack_wheels] 2/4 resolving the closure for CPython $PY_VERSION x86_64 (nothing is installed)"
"$PY" -m pip install -q --dry-run --ignore-installed --report "$WORK/report.json" --target "$WORK/target" \
    "${PLAT_ARGS[@]}" --find-links "$DEST" "$OWN_WHEEL" "${REQS[@]}"

"$PY" - "$WORK/report.json" "$EXCLUDE_RE" "$PINNED_RE" "${SKIP_PRESENT:-}" "${SDIST_ONLY[*]}" "$PY_VERSION" \
    >"$WORK/pins.txt" <<'PYEOF'
import json, re, sys
try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version
report, exclude, pinned, skip_file, built, py_version = sys.argv[1:7]
norm = lambda s: re.sub(r"[-_.]+", "-", s.strip().lower())
items = json.load(open(report))["install"]
# what the closure asks of each package (markers evaluated for the target, no extras)
env = {"python_version": py_version, "python_full_version": py_version + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
wanted = {}
for item in items:
    for text in item["metadata"].get("requires_dist", []):
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            wanted.setdefault(norm(req.name), []).append(req.specifier)
# SKIP_PRESENT lines: "name==version" (pip freeze) or "name"
skip = {}
if skip_file:
    for line in open(skip_file):
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            skip[norm(re.split(r"[<>~!= ]", name)[0])] = version.strip() or None
built = {norm(b.split("==")[0]) for b in built.split()}
for item in items:
    name = norm(item["metadata"]["name"])
    if name == "verl-tokensel" or name in built or re.match(exclude, name):
        continue
    if name in skip and not re.match(pinned, name):
        specs = wanted.get(name, [])
        have = skip[name]
        if have is not None:  # the image's version is known: skip it when every requirement accepts it
            fits = all(Version(have) in s for s in specs)
        else:  # name only: skip unless something caps or pins it (transformers 5.9: tokenizers <= 0.23.0)
            fits = not any(sp.operator in ("<", "<=", "==", "~=", "===") for s in specs for sp in s)
        if fits:
            continue
    print(f"{name}=={item['metadata']['version']}")
PYEOF

echo "[pack_wheels] 3/4 downloading $(wc -l <"$WORK/pins.txt") wheels into $DEST"
"$PY" -m pip download -q --no-deps "${PLAT_ARGS[@]}" -d "$DEST" -r "$WORK/pins.txt"
cp "$WORK/pins.txt" "$DEST/PINS.txt"
cp "$WORK/report.json" "$DEST/RESOLVE_REPORT.json"  # what pip resolved, for the record
if [ -n "${SKIP_PRESENT:-}" ]; then  # built source-only wheels the image already has are not needed
    for b in "${SDIST_ONLY[@]}"; do
        n="${b%%==*}"
        if grep -qix "$n" <(sed 's/[=<>~! ].*//' "$SKIP_PRESENT"); then rm -f "$DEST/${n//-/_}"-*.whl; fi
    done
fi

if [ -n "${CHUNK_MIB:-}" ]; then
    echo "[pack_wheels] 4/4 laying out chunks of <= $CHUNK_MIB MiB"
    rm -rf "$DEST"/chunk*
    "$PY" "$ROOT/scripts/chunk_files.py" "$DEST" "$CHUNK_MIB" PINS.txt
else
    echo "[pack_wheels] 4/4 no CHUNK_MIB: one flat folder"
fi

echo "[pack_wheels] done: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh --exclude='chunk*' "$DEST" | cut -f1) in $DEST"
du -k "$DEST"/*.whl | sort -rn | head -n 5 | awk '{printf "  %6.1f MiB  %s\n", $1/1024, $2}'
