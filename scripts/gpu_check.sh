#!/usr/bin/env bash
# The GPU check on one GPU machine with NO network, from the repository root (under 9 minutes; about 5
# when the Megatron phase is skipped, as it is without MEGATRON_WHEELS):
#
#   bash scripts/gpu_check.sh                # wheels from wheels/, results in $OUT/gpu_check.json
#   bash scripts/gpu_check.sh /tmp/wheels    # another wheel folder (or a folder of chunkN/ folders)
#   bash scripts/gpu_check.sh gpu_site.tar.xz # one-transfer bundle from scripts/pack_gpu_site.sh (27 MiB):
#                                             # unpacked to a temp dir on PYTHONPATH, nothing installed
#   GPU_CHECK_ARGS="--steps 3 --no-megatron" bash scripts/gpu_check.sh
#
# The Megatron phase alone, on the carried Megatron stack (scripts/pack_megatron_wheels.sh: megatron-core
# 0.16.1 + mbridge 0.15.1, 2.6 MiB; with the site bundle one transfer of ~30 MiB; about 6 minutes):
#
#   MEGATRON_WHEELS=wheels/megatron GPU_CHECK_TIMEOUT=450 \
#   GPU_CHECK_ARGS="--no-fsdp --variants none forking gmts --warmup 0 --steps 3 --budget-megatron 330 --deadline 420" \
#   bash scripts/gpu_check.sh gpu_site.tar.xz
#
# Without TransformerEngine (its torch extension is a source archive only on PyPI, see
# pack_megatron_wheels.sh) that phase runs megatron-core's local layers with torch SDPA attention, not the
# production TE layers, and records so in gpu_check.json (megatron.stack). Neither this Megatron path nor
# the optional TransformerEngine build below has run on a GPU machine yet.
#
# 1. checks the assumption this relies on: the machine's python3 (or $PYTHON) has a CUDA build of
#    torch >= 2.6 that sees a GPU (and, optionally, flash-attn). torch is NOT in the wheel folder
#    (2+ GiB with its CUDA libraries); neither is flash-attn (without it the check uses sdpa).
# 2. installs verl 0.9.1, transformers 5.9.0, tensordict and the rest offline from the wheel folder
#    made by scripts/pack_wheels.sh on a networked machine: pip install --no-index --find-links,
#    with torch pinned to the installed build so nothing tries to replace it; packages the image
#    already has in a fitting version are kept. Wheels split into NAME.whl.part-aa, -ab, ... (by
#    CHUNK_MIB) are joined first, from any chunkN/ subfolders. It installs into $PYTHON's own
#    environment (it replaces the image's transformers 5.17 with 5.9.0): meant for a throwaway
#    machine; elsewhere make a venv with --system-site-packages (to keep the system torch) and pass
#    PYTHON=that-venv/bin/python.
#    Then `verl-tokensel env` from outside the repository: the installed wheel's plugin loads in verl and
#    registers its trainer modes on this stack, and no known-broken package is present (exit 5 if not).
# 2c. MEGATRON_WHEELS (default wheels/megatron if it exists): megatron-core and mbridge from that folder
#    (chunkN/ and split files joined as above) go into a temp dir on PYTHONPATH (pip --target --no-deps;
#    torch, numpy, packaging, transformers, safetensors, einops come from the image / the bundle); nothing
#    is installed into $PYTHON's environment. TE_BUILD=1 with the WITH_TE=1 files: TransformerEngine's core
#    and Python wheels go there too and its torch extension is compiled from the source archive (MAX_JOBS =
#    the machine's cores, at most TE_BUILD_TIMEOUT s, default 300); if that fails or does not import, the
#    TransformerEngine files are removed again and the check runs the local layers (exit code unaffected).
# 3. runs benchmarks/gpu_check.py with the repository's own verl_tokensel and its worker harness
#    (verl_tokensel_cpu, the CPU distribution's; PYTHONPATH=repo root and verl-tokensel-cpu/, nothing installed)
#    under `timeout` (GPU_CHECK_TIMEOUT s, default 510; the check's own deadline is 480 s).
#
# Through a transfer that carries at most 64 MiB at a time (ray's wheel alone is 75.6 MiB): pack with
# SKIP_PRESENT=scripts/gpu_image_packages.txt CHUNK_MIB=56 bash scripts/pack_wheels.sh, then, on one
# machine that stays up between the calls, call k copies wheels/chunkK/* into /tmp/wheels/ and the
# last one also runs `bash scripts/gpu_check.sh /tmp/wheels`.
#
# Exit codes: gpu_check.py's (0 ok, 1 a sanity check failed, 2 environment, 3 its deadline), 4 the
# torch assumption does not hold, 5 the offline install failed, 124 `timeout` stopped it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${1:-$ROOT/wheels}"
PY="${PYTHON:-python3}"
TIMEOUT_S="${GPU_CHECK_TIMEOUT:-510}"
OUT_DIR="${OUT:-$ROOT/outputs}"
T0=$(date +%s)
say() { echo "[gpu_check.sh +$(( $(date +%s) - T0 ))s] $*" >&2; }
CLEANUP=()  # temp dirs removed on exit
trap 'rm -rf ${CLEANUP[@]+"${CLEANUP[@]}"}' EXIT
# copy the .whl / .tar.gz files of folder $1 (and of its chunkN/ folders) into $2, joining split ones
# (NAME.part-aa, -ab, ... sort in order)
stage_files() {
    find "$1" \( -name '*.whl' -o -name '*.tar.gz' \) -exec cp -t "$2" {} +
    while IFS= read -r f; do
        [ -e "$2/$f" ] && continue
        find "$1" -name "$f.part-*" -print0 | sort -z | xargs -0 cat >"$2/$f"
    done < <(find "$1" -name '*.part-*' -printf '%f\n' | sed 's/\.part-[a-z]*$//' | sort -u)
}

# ---- 1. the image's torch ------------------------------------------------------------------------
say "checking the image's torch ($PY)"
if ! "$PY" - <<'EOF'
import sys
try:
    import torch
except ImportError as e:
    sys.exit(f"ERROR: torch is not importable ({e}). This script assumes the GPU image ships a CUDA "
             "build of torch (>= 2.6); the wheel folder deliberately has none. Fix: run on the CUDA "
             "image, or set PYTHON to the interpreter that has torch.")
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if v < (2, 6):
    sys.exit(f"ERROR: torch {torch.__version__} is older than 2.6 (verl 0.9 needs >= 2.6). Fix: use a newer image.")
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(f"ERROR: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no GPU. This script "
             "needs a CUDA GPU; on a CPU machine run: python benchmarks/gpu_check.py --tiny --device cpu")
try:
    import flash_attn  # noqa: F401
    fa = f"flash-attn {flash_attn.__version__}"
except Exception:
    fa = "no flash-attn (sdpa will be used)"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, {fa}")
EOF
then
    exit 4
fi

# ---- 2. offline install from the wheel folder (or the site bundle) --------------------------------
SITE=""
if [ -f "$WHEELS" ] && [[ "$WHEELS" == *.tar.xz ]]; then
    SITE="$(mktemp -d)"
    CLEANUP+=("$SITE")
    say "unpacking the site bundle $WHEELS"
    if ! tar -xJf "$WHEELS" -C "$SITE" || [ ! -d "$SITE/site" ]; then
        echo "ERROR: $WHEELS is not a bundle made by scripts/pack_gpu_site.sh (no site/ inside)." >&2
        exit 5
    fi
    export PYTHONPATH="$SITE/site${PYTHONPATH:+:$PYTHONPATH}"
elif [ ! -d "$WHEELS" ]; then
    echo "ERROR: no wheel folder at $WHEELS. Fix: on a machine with network run 'bash scripts/pack_wheels.sh'" \
         "and bring its wheels/ folder here (or pass its path)." >&2
    exit 5
fi
if [ -z "$SITE" ]; then
    STAGE="$(mktemp -d)"
    CLEANUP+=("$STAGE")
    # flatten chunkN/ folders and join split wheels (a megatron/ subfolder is step 2c's)
    find "$WHEELS" -path "$WHEELS/megatron" -prune -o -name '*.whl' -exec cp -t "$STAGE" {} +
    while IFS= read -r whl; do
        [ -e "$STAGE/$whl" ] && continue
        find "$WHEELS" -path "$WHEELS/megatron" -prune -o -name "$whl.part-*" -print0 | sort -z |
            xargs -0 cat >"$STAGE/$whl"
    done < <(find "$WHEELS" -path "$WHEELS/megatron" -prune -o -name '*.whl.part-*' -printf '%f\n' |
             sed 's/\.part-[a-z]*$//' | sort -u)
    OWN="$(ls "$STAGE"/verl_tokensel-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$OWN" ]; then
        echo "ERROR: $WHEELS has no verl_tokensel-*.whl (are all chunks there?). Fix: run scripts/pack_wheels.sh." >&2
        exit 5
    fi
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' >"$STAGE/constraints.txt"
    say "installing offline from $WHEELS ($(ls "$STAGE"/*.whl | wc -l) wheels; torch pinned: $(cat "$STAGE/constraints.txt"))"
    if ! "$PY" -m pip install -q --no-index --find-links "$STAGE" --no-compile --disable-pip-version-check \
            -c "$STAGE/constraints.txt" "$OWN"; then
        echo "ERROR: the offline install failed (pip's message above names the missing or conflicting package)." \
             "Fix: re-run scripts/pack_wheels.sh for this image's Python ($("$PY" -c 'import sys; print(sys.version.split()[0])'))" \
             "without SKIP_PRESENT, and bring the whole folder." >&2
        exit 5
    fi
fi
"$PY" -c 'import verl, transformers, tensordict; print("verl", verl.__version__, "| transformers", transformers.__version__, "| tensordict", tensordict.__version__)'

# ---- 2b. the installed plugin (the wheel, not this checkout) imports and registers on this stack ---------
say "checking the installed verl-tokensel: verl-tokensel env, from outside the repository"
if ! (cd "$(mktemp -d)" && "$PY" -m verl_tokensel.cli.main env); then
    echo "ERROR: the installed verl-tokensel does not load or register on this stack (see the lines above:" \
         "'verl plugin', 'trainer modes' and any 'broken environment' line with its fix)." >&2
    exit 5
fi

# ---- 2c. the Megatron stack (optional) ------------------------------------------------------------
MEGA="${MEGATRON_WHEELS:-}"
if [ -z "$MEGA" ] && [ -d "$ROOT/wheels/megatron" ]; then MEGA="$ROOT/wheels/megatron"; fi
if [ -n "$MEGA" ]; then
    if [ ! -d "$MEGA" ]; then
        echo "ERROR: MEGATRON_WHEELS=$MEGA is not a folder. Fix: bash scripts/pack_megatron_wheels.sh on a" \
             "machine with network and bring its folder (or unset MEGATRON_WHEELS to skip the Megatron stack)." >&2
        exit 5
    fi
    MSTAGE="$(mktemp -d)"
    MSITE="$(mktemp -d)"
    CLEANUP+=("$MSTAGE" "$MSITE")
    stage_files "$MEGA" "$MSTAGE"
    MWHEELS=("$MSTAGE"/megatron_core-*.whl "$MSTAGE"/mbridge-*.whl)
    if [ ! -e "${MWHEELS[0]}" ] || [ ! -e "${MWHEELS[1]}" ]; then
        echo "ERROR: $MEGA lacks megatron_core-*.whl or mbridge-*.whl (are all chunks there?)." \
             "Fix: bash scripts/pack_megatron_wheels.sh and bring the whole folder." >&2
        exit 5
    fi
    TE_FILES=()
    if [ "${TE_BUILD:-0}" = 1 ]; then
        for f in "$MSTAGE"/transformer_engine-*.whl "$MSTAGE"/transformer_engine_cu*.whl \
                 "$MSTAGE"/nvdlfw_inspect-*.whl "$MSTAGE"/nvidia_cudnn_frontend-*.whl; do
            [ -e "$f" ] && TE_FILES+=("$f")
        done
        [ ${#TE_FILES[@]} -gt 0 ] || say "TE_BUILD=1 but $MEGA has no TransformerEngine files (pack with WITH_TE=1)"
    fi
    say "installing the Megatron stack into $MSITE (on PYTHONPATH):" "${MWHEELS[@]##*/}" \
        ${TE_FILES[@]+"${TE_FILES[@]##*/}"}
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
            --target "$MSITE" "${MWHEELS[@]}" ${TE_FILES[@]+"${TE_FILES[@]}"}; then
        echo "ERROR: installing the Megatron wheels failed (pip's message above). Fix: re-pack with" \
             "PY_VERSION=<this Python's major.minor> bash scripts/pack_megatron_wheels.sh." >&2
        exit 5
    fi
    export PYTHONPATH="$MSITE${PYTHONPATH:+:$PYTHONPATH}"
    TE_SRC="$(ls "$MSTAGE"/transformer_engine_torch-*.tar.gz 2>/dev/null | head -n1 || true)"
    if [ ${#TE_FILES[@]} -gt 0 ] && [ -n "$TE_SRC" ]; then
        # UNTESTED: PyPI has no prebuilt transformer_engine_torch; compile it here against the image's torch,
        # with the CUDA headers of the toolkit or of the nvidia-* packages and cuDNN frontend's (in $MSITE)
        say "building TransformerEngine's torch extension from ${TE_SRC##*/} (at most ${TE_BUILD_TIMEOUT:-300}s)"
        if ! CPATH="$MSITE/include${CPATH:+:$CPATH}" NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="$(nproc)" \
                timeout "${TE_BUILD_TIMEOUT:-300}" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
                --disable-pip-version-check --target "$MSITE" "$TE_SRC" ||
           ! "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
            say "TransformerEngine's torch extension did not build or import: removing TransformerEngine again;" \
                "the Megatron phase runs megatron-core's local layers (recorded in megatron.stack)"
            rm -rf "$MSITE"/transformer_engine* "$MSITE"/nvdlfw_inspect* "$MSITE"/nvidia_cudnn_frontend* \
                  "$MSITE"/cudnn* "$MSITE"/include
        fi
    elif [ ${#TE_FILES[@]} -gt 0 ]; then
        say "no transformer_engine_torch-*.tar.gz in $MEGA: removing TransformerEngine again"
        rm -rf "$MSITE"/transformer_engine* "$MSITE"/nvdlfw_inspect* "$MSITE"/nvidia_cudnn_frontend* \
                  "$MSITE"/cudnn* "$MSITE"/include
    fi
    if ! "$PY" - <<'EOF'
import importlib.metadata as md
import megatron.core, mbridge  # noqa: F401,E401
try:
    import transformer_engine.pytorch  # noqa: F401
    te = "TransformerEngine " + md.version("transformer-engine")
except Exception as e:
    te = f"no TransformerEngine ({type(e).__name__}): local layers"
print(f"megatron-core {md.version('megatron-core')} | mbridge {md.version('mbridge')} | {te}")
EOF
    then
        echo "ERROR: megatron.core or mbridge does not import from $MSITE (the traceback above names the" \
             "missing module). Fix: unset MEGATRON_WHEELS to run without the Megatron phase." >&2
        exit 5
    fi
else
    say "no Megatron wheels (MEGATRON_WHEELS unset, no wheels/megatron): the Megatron phase reports itself skipped"
fi

# ---- 3. the check ---------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
say "running benchmarks/gpu_check.py (timeout ${TIMEOUT_S}s)"
set +e
PYTHONPATH="$ROOT:$ROOT/verl-tokensel-cpu${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout --kill-after=15 "$TIMEOUT_S" \
    "$PY" benchmarks/gpu_check.py --out "$OUT_DIR/gpu_check.json" ${GPU_CHECK_ARGS:-}
rc=$?
set -e
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "ERROR: gpu_check.py did not finish within ${TIMEOUT_S}s and was killed (its own deadline should" \
         "have stopped it first: a hang in CUDA, NCCL or the file system?). Partial results, if any:" \
         "$OUT_DIR/gpu_check.json" >&2
fi
say "done, exit code $rc"
exit "$rc"
