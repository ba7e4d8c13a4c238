#!/usr/bin/env bash
# Bundle what benchmarks/gpu_check.py needs beyond a CUDA image into ONE xz tarball (about 27 MiB)
# that fits a 64 MiB transfer, on a machine with network (any OS/CPU: wheels are picked by platform):
#
#   bash scripts/pack_gpu_site.sh                       # writes gpu_site.tar.xz (Python 3.12, x86_64)
#   PYVER=3.11 OUT_TAR=/tmp/site.tar.xz bash scripts/pack_gpu_site.sh
#
# then on the GPU machine: bash scripts/gpu_check.sh gpu_site.tar.xz
#
# What it does: builds verl-tokensel's wheel (python -m build), downloads the cp$PYVER manylinux wheels pinned in scripts/gpu_site_packages.txt (no
# dependency resolution: the list is the import closure of the check minus what the image ships;
# torch, numpy, pandas, pyarrow, huggingface-hub, accelerate, peft, ... come from the image), installs
# them with `pip install --target` into site/, drops ray's cluster binaries (gcs_server, raylet, the
# Java jar, the dashboard's web build: the check builds verl's TrainingWorker in-process and never
# starts Ray, but verl imports ray), and packs site/ with xz. Measured: 41 wheels, 100 MiB
# downloaded, 27 MiB packed; ran on one H200 with torch 2.11.0+cu130 (Python 3.12).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
PYVER="${PYVER:-3.12}"
OUT_TAR="${OUT_TAR:-$ROOT/gpu_site.tar.xz}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PLAT=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform any)
grep -v '^#' "$ROOT/scripts/gpu_site_packages.txt" | grep -v '^antlr4' >"$WORK/binary.txt"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLAT[@]}" -d "$WORK/wheels" -r "$WORK/binary.txt"
# antlr4-python3-runtime (hydra/omegaconf) is published as a source archive only: build its wheel
"$PY" -m pip wheel -q --no-deps -w "$WORK/wheels" "$(grep '^antlr4' "$ROOT/scripts/gpu_site_packages.txt")"
# verl-tokensel itself, as the release wheel (gpu_check.sh checks that this installed copy loads and registers)
"$PY" -m build -q --wheel --outdir "$WORK/wheels" "$ROOT" >/dev/null
"$PY" -m pip install -q --no-deps --no-compile --target "$WORK/site" --python-version "$PYVER" \
    --implementation cp --only-binary=:all: "${PLAT[@]}" "$WORK"/wheels/*.whl
rm -rf "$WORK/site/ray/core/src/ray/gcs/gcs_server" "$WORK/site/ray/core/src/ray/raylet/raylet" \
       "$WORK/site/ray/jars" "$WORK/site/ray/dashboard/client/build" "$WORK/site/bin"
find "$WORK/site" -name '*.map' -delete
find "$WORK/site" -name '__pycache__' -prune -exec rm -rf {} +
tar -cJf "$OUT_TAR" -C "$WORK" site
echo "wrote $OUT_TAR ($(du -h "$OUT_TAR" | cut -f1)) from $(ls "$WORK/wheels" | wc -l) wheels"
