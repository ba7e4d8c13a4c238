#!/usr/bin/env bash
# Download, on a machine WITH network, the Megatron stack that the Megatron phase of benchmarks/gpu_check.py
# needs on the GPU machine (CPython 3.12, x86_64 Linux, NO network); scripts/gpu_check.sh installs it:
#
#   bash scripts/pack_megatron_wheels.sh                  # -> wheels/megatron/ (git-ignored), 2 wheels, 2.6 MiB
#   bash scripts/pack_megatron_wheels.sh /tmp/megatron    # another folder
#   WITH_TE=1 CHUNK_MIB=56 bash scripts/pack_megatron_wheels.sh   # + TransformerEngine (see below), in chunks
#
# then, on the GPU machine (one transfer: the 27 MiB site bundle of scripts/pack_gpu_site.sh + this folder):
#
#   MEGATRON_WHEELS=wheels/megatron GPU_CHECK_TIMEOUT=450 \
#   GPU_CHECK_ARGS="--no-fsdp --variants none forking gmts --warmup 0 --steps 3 --budget-megatron 330 --deadline 420" \
#   bash scripts/gpu_check.sh gpu_site.tar.xz
#
# What PyPI has for CPython 3.12 manylinux x86_64 (checked 2026-12-02 with `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64` and the
# packages' PyPI metadata), and what is packed:
#
# * megatron-core 0.16.1: cp312 manylinux wheel, 2.5 MiB; requires torch>=2.6, numpy, packaging>=24.2 (the
#   GPU image has them). PACKED. The newest, 0.19.2 (cp312 wheel, 2.3 MiB, Python >= 3.12 from 0.17 on), does
#   not work with mbridge 0.15.1: mbridge's get_model (mbridge/core/util.py) reads
#   ModelType.encoder_and_decoder, which megatron-core 0.17 removed (AttributeError when the worker is built;
#   seen on the CPU test bed with 0.19.2). 0.16.1 is the version the CPU test bed runs with verl 0.9.1.
# * mbridge 0.15.1: py3-none-any wheel, 0.1 MiB, no required dependencies (its "megatron" extra is
#   megatron-core, transformers, safetensors, einops: image or site bundle). PACKED. gpu_check.py runs
#   verl's Megatron engine with vanilla_mbridge=True on it.
# * megatron-bridge (verl's default bridge) 0.6.2: py3-none-any wheel, 2.1 MiB, Python 3.12 only. NOT
#   PACKED: importing it imports transformer_engine.pytorch (megatron/bridge/peft/lora_layers.py), it
#   needs a megatron-core newer than 0.16 (megatron.core._rank_utils.safe_get_world_size), and its declared
#   dependencies (megatron-core[dev,mlm], flashinfer-python/-cubin, flash-linear-attention, nvidia-modelopt,
#   nvidia-resiliency-ext, open-clip-torch, timm, mlflow, comet-ml, diffusers, mistral-common, ...) are far
#   beyond a 64 MiB transfer. Where it is installed but does not import, gpu_check.py uses mbridge.
# * TransformerEngine: transformer_engine (metapackage with the Python code; 2.12.0: 0.7 MiB) and
#   transformer_engine_cu13 (the prebuilt CUDA core library, py3-none manylinux_2_28; 2.12.0: 181.0 MiB,
#   2.20.2: 263.7 MiB; _cu12 2.20.2: 695.3 MiB) are wheels, but its PyTorch extension,
#   transformer_engine_torch, is a SOURCE ARCHIVE ONLY on PyPI, in every one of its 30 releases (2.20.2:
#   0.5 MiB .tar.gz): it compiles 28 C++ files against the installed torch (2.11.0+cu130 on the GPU machine)
#   with the CUDA, cuDNN and cuDNN-frontend headers, on the machine that installs it; its setup.py first
#   tries a prebuilt wheel from GitHub releases, which neither this machine nor the GPU machine can reach.
#   So NO prebuilt TransformerEngine for torch 2.11 + CUDA 13 can be carried, and by default none is packed:
#   the Megatron phase then runs megatron-core's local layers with torch SDPA attention and no fused
#   kernels, and records that (megatron.stack.layers = "local", with the reason) instead of the production
#   stack. WITH_TE=1 also packs TransformerEngine $TE_VERSION (default 2.12.0, the release of megatron-core
#   0.16's time): transformer_engine + transformer_engine_cu13 wheels, the transformer_engine_torch source
#   archive (0.3 MiB), nvdlfw-inspect 0.2.2 (0.03 MiB) and nvidia-cudnn-frontend 1.32.0 (11.1 MiB, for its
#   headers): 196 MiB with the two Megatron wheels, 4 chunks at CHUNK_MIB=56 (56, 56, 56, 27.7 MiB).
#   gpu_check.sh then builds the extension on the GPU machine when TE_BUILD=1 (it needs a C++ compiler and
#   the CUDA/cuDNN headers there; never tried: no GPU machine has run it).
#
# CHUNK_MIB: as in scripts/pack_wheels.sh, the folder is also laid out as chunkN/ subfolders of at most
# CHUNK_MIB each, bigger files split into NAME.part-aa, -ab, ...; gpu_check.sh joins them. Through a
# 64 MiB transfer, on one machine that stays up between the calls: call k brings wheels/megatron/chunkK,
# the last one (with gpu_site.tar.xz) runs the command above with TE_BUILD=1 added.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/wheels/megatron}"
PY="${PYTHON:-python3}"
PY_VERSION="${PY_VERSION:-3.12}"
MCORE_VERSION="${MCORE_VERSION:-0.16.1}"
MBRIDGE_VERSION="${MBRIDGE_VERSION:-0.15.1}"
TE_VERSION="${TE_VERSION:-2.12.0}"
PLAT=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

mkdir -p "$DEST"
echo "[pack_megatron_wheels] megatron-core $MCORE_VERSION, mbridge $MBRIDGE_VERSION -> $DEST"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" \
    "megatron-core==$MCORE_VERSION" "mbridge==$MBRIDGE_VERSION"
if [ -n "${WITH_TE:-}" ]; then
    echo "[pack_megatron_wheels] TransformerEngine $TE_VERSION (core wheel, metapackage, torch extension source)"
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" \
        "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION" \
        "nvdlfw-inspect==0.2.2" "nvidia-cudnn-frontend==1.32.0"
    # source only: fetched as the archive, not built here (it needs the GPU machine's torch and CUDA headers).
    # Not with pip download: pip prepares an sdist's metadata, and this one's setup.py needs a CUDA torch.
    "$PY" - "$DEST" "$TE_VERSION" <<'PYEOF'
import json, os, sys, urllib.parse, urllib.request
dest, version = sys.argv[1:3]
index = "https://pypi.org/pypi/transformer-engine-torch/json"
files = json.load(urllib.request.urlopen(index, timeout=60))["releases"][version]
sdist = next(f for f in files if f["packagetype"] == "sdist")
url = urllib.parse.urljoin(index, sdist["url"])
urllib.request.urlretrieve(url, os.path.join(dest, sdist["filename"]))
print(f"  {sdist['filename']} ({sdist['size'] / 2**20:.1f} MiB)")
PYEOF
fi
ls "$DEST" | grep -v '^chunk' >"$DEST/FILES.txt"

if [ -n "${CHUNK_MIB:-}" ]; then
    rm -rf "$DEST"/chunk*
    "$PY" "$ROOT/scripts/chunk_files.py" "$DEST" "$CHUNK_MIB" FILES.txt
fi
echo "[pack_megatron_wheels] done: $(du -sh --exclude='chunk*' "$DEST" | cut -f1) in $DEST"
du -k "$DEST"/*.whl "$DEST"/*.tar.gz 2>/dev/null | sort -rn | awk '{printf "  %7.1f MiB  %s\n", $1/1024, $2}'
