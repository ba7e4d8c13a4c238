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
#
# How: `pip install --dry-run --report` resolves the closure for the target (--python-version,
# --platform, binary wheels only) without installing; the report's list minus the excluded names is
# then fetched with `pip download --no-deps`, one pinned name==version each (PINS.txt), so the folder
# holds exactly one version of every package. Dependencies published only as source (antlr4 4.9.3,
# which omegaconf 2.3 pins) are built here into pure-Python wheels first; without them pip would
# quietly backtrack to hydra-core 0.11.
#
# SKIP_PRESENT: a file with one package name per line (e.g. `pip list --format=freeze` run on the GPU
# image); those names are not downloaded, except the pinned ones above, whose image versions may not
# fit verl (the H200 image has transformers 5.17; verl 0.9.1 needs < 5.11). Use it only when the
# image's versions satisfy verl's requirements: `pip install --no-index` on the GPU machine fails
# loudly, naming the package, when one does not.
#
# CHUNK_MIB: the device tool carries at most 64 MiB per call and ray's wheel alone is 75.6 MiB, so
# the folder is also copied into chunkN/ subfolders of at most CHUNK_MIB each, splitting bigger wheels
# into NAME.whl.part-aa, -ab, ...; gpu_check.sh puts them back together (see its header for the
# two-call recipe).
#
# Measured 2026-11-29 (CPython 3.12, manylinux x86_64): full closure 123 wheels, 257 MiB (ray 75.6,
# pyarrow 52.5, wandb 19.4, numpy 15.0, pandas 11.5 MiB); with SKIP_PRESENT = the H200 image's
# package list (scripts/gpu_image_packages.txt): see CHANGELOG.md / the summary this prints.
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

"$PY" - "$WORK/report.json" "$EXCLUDE_RE" "$PINNED_RE" "${SKIP_PRESENT:-}" "${SDIST_ONLY[*]}" \
    >"$WORK/pins.txt" <<'PYEOF'
import json, re, sys
report, exclude, pinned, skip_file, built = sys.argv[1:6]
norm = lambda s: re.sub(r"[-_.]+", "-", s.strip().lower())
skip = set()
if skip_file:
    skip = {norm(re.split(r"[=<>~! ]", l.strip())[0]) for l in open(skip_file) if l.strip() and not l.startswith("#")}
built = {norm(b.split("==")[0]) for b in built.split()}
for item in json.load(open(report))["install"]:
    name = norm(item["metadata"]["name"])
    if name == "verl-tokensel" or name in built or re.match(exclude, name):
        continue
    if name in skip and not re.match(pinned, name):
        continue
    print(f"{name}=={item['metadata']['version']}")
PYEOF

echo "[pack_wheels] 3/4 downloading $(wc -l <"$WORK/pins.txt") wheels into $DEST"
"$PY" -m pip download -q --no-deps "${PLAT_ARGS[@]}" -d "$DEST" -r "$WORK/pins.txt"
cp "$WORK/pins.txt" "$DEST/PINS.txt"
if [ -n "${SKIP_PRESENT:-}" ]; then  # built source-only wheels the image already has are not needed
    for b in "${SDIST_ONLY[@]}"; do
        n="${b%%==*}"
        if grep -qix "$n" <(sed 's/[=<>~! ].*//' "$SKIP_PRESENT"); then rm -f "$DEST/${n//-/_}"-*.whl; fi
    done
fi

if [ -n "${CHUNK_MIB:-}" ]; then
    echo "[pack_wheels] 4/4 laying out chunks of <= $CHUNK_MIB MiB"
    rm -rf "$DEST"/chunk*
    "$PY" - "$DEST" "$CHUNK_MIB" <<'PYEOF'
import os, sys
dest, limit = sys.argv[1], int(float(sys.argv[2]) * 2**20)
pieces = []  # (name, bytes) in the order they are filled into chunks
for f in sorted(os.listdir(dest), key=lambda f: -os.path.getsize(os.path.join(dest, f))):
    path = os.path.join(dest, f)
    if not (f.endswith(".whl") or f == "PINS.txt"):
        continue
    data = open(path, "rb").read()
    if len(data) <= limit:
        pieces.append((f, data))
    else:
        for i in range(0, len(data), limit):
            suffix = chr(ord("a") + i // limit // 26) + chr(ord("a") + i // limit % 26)
            pieces.append((f"{f}.part-{suffix}", data[i : i + limit]))
chunks = []  # first fit, biggest first
for name, data in pieces:
    for c in chunks:
        if c[0] + len(data) <= limit:
            c[0] += len(data); c[1].append((name, data)); break
    else:
        chunks.append([len(data), [(name, data)]])
for k, (size, files) in enumerate(chunks, 1):
    os.makedirs(os.path.join(dest, f"chunk{k}"))
    for name, data in files:
        open(os.path.join(dest, f"chunk{k}", name), "wb").write(data)
    print(f"  chunk{k}: {len(files)} files, {size / 2**20:.1f} MiB")
PYEOF
else
    echo "[pack_wheels] 4/4 no CHUNK_MIB: one flat folder"
fi

echo "[pack_wheels] done: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh --exclude='chunk*' "$DEST" | cut -f1) in $DEST"
du -k "$DEST"/*.whl | sort -rn | head -n 5 | awk '{printf "  %6.1f MiB  %s\n", $1/1024, $2}'
