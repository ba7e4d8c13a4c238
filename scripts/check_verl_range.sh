#!/usr/bin/env bash
# The plugin's seam tests under another verl release (not part of CI): what setup.cfg's supported range rests on.
#   bash scripts/check_verl_range.sh [VERL_VERSION] [VENV_DIR]      # default 0.9.0, /tmp/tokensel-verl-<version>
# 1. a fresh venv with the pinned CPU stack of requirements/cpu-test.txt, verl replaced by VERL_VERSION (pip's
#    global constraint file, if any, is used without its verl line);
# 2. a copy of this checkout's committed tree (git archive HEAD) in $VENV_DIR/src with the supported range widened
#    to VERL_VERSION (setup.cfg and verl_tokensel.SUPPORTED_VERL: the question is whether the seams hold, not
#    whether the range check refuses), its two distributions installed editable, --no-deps;
# 3. torchvision / torchaudio / torchcodec removed (their CUDA builds break transformers against a CPU torch);
# 4. every test file the seams table of ARCHITECTURE.md names (its last column), default suite only
#    (-m "not gpu and not slow"), one pytest run per file, then one line per file and a summary line:
#    "verl <version>: <k> of <n> seam test files pass". Exit status 0 when all pass.
#    SEAM_TESTS="test_loss test_plugin" runs only those files.
# About 20-40 minutes on 2 cores (the install ~2-4 min, the tests the rest). Logs: $VENV_DIR/logs/<file>.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION="${1:-0.9.0}"
VENV="${2:-/tmp/tokensel-verl-$VERSION}"
PY="${PYTHON:-python3}"

"$PY" -m venv "$VENV"
SRC="$VENV/src"
rm -rf "$SRC" && mkdir -p "$SRC"
git archive --format=tar HEAD | tar -x -C "$SRC"
sed -i "s/verl>=[0-9.]*,<0.10/verl>=$VERSION,<0.10/" "$SRC/setup.cfg"
sed -i "s/^SUPPORTED_VERL = \">=[0-9.]*,<0.10\"/SUPPORTED_VERL = \">=$VERSION,<0.10\"/" "$SRC/verl_tokensel/__init__.py"
cd "$SRC"
ROOT="$PWD"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -U pip
REQS="$VENV/requirements.txt"
sed "s/^verl==.*/verl==$VERSION/" requirements/cpu-test.txt >"$REQS"
CONSTRAINT="$(python -m pip config get global.constraint 2>/dev/null || true)"
if [ -n "$CONSTRAINT" ] && [ -f "$CONSTRAINT" ]; then  # a site-wide pin of verl would win over ours
    grep -v '^verl[=<>~! ]' "$CONSTRAINT" >"$VENV/constraints.txt" || true
    export PIP_CONSTRAINT="$VENV/constraints.txt"
fi
python -m pip install -q -r "$REQS"
python -m pip install -q --no-deps -e . -e ./verl-tokensel-cpu
python -m pip uninstall -q -y torchvision torchaudio torchcodec
got="$(python -c 'import verl; print(verl.__version__)')"
if [ "$got" != "$VERSION" ]; then
    echo "error: the venv has verl $got, not $VERSION" >&2
    exit 2
fi
verl-tokensel env || true  # reports a plugin that does not load; the tests below say where

mapfile -t FILES < <(python - "$ROOT/ARCHITECTURE.md" "${SEAM_TESTS:-}" <<'PY'
import re, sys
from pathlib import Path
text = Path(sys.argv[1]).read_text()
table = text.split("## Seams", 1)[1]
names = []
for line in table.splitlines():
    if line.startswith("| ") and not line.startswith("| verl symbol") and not line.startswith("|---"):
        for name in re.findall(r"`(test_[a-z0-9_]+)(?:::[a-z0-9_]+)?`", line.rsplit("|", 2)[-2]):
            if name not in names:
                names.append(name)
only = sys.argv[2].split()
for name in names:
    path = Path("tests") / f"{name}_on_cpu.py"
    if only and name not in only:
        continue
    if path.exists():
        print(path.name)
PY
)
mkdir -p "$VENV/logs"
pass=0
results=()
for file in "${FILES[@]}"; do
    log="$VENV/logs/${file%.py}.log"
    if (cd tests && python -m pytest -q -p no:cacheprovider -m "not gpu and not slow" --timeout=900 "$file") \
            >"$log" 2>&1; then
        pass=$((pass + 1))
        results+=("pass  $file  $(tail -n1 "$log")")
    else
        results+=("FAIL  $file  $(grep -E '^(FAILED|ERROR)' "$log" | head -n3 | tr '\n' ' ')$(tail -n1 "$log")")
    fi
done
printf '%s\n' "${results[@]}"
echo "verl $VERSION: $pass of ${#FILES[@]} seam test files pass (logs: $VENV/logs)"
[ "$pass" -eq "${#FILES[@]}" ]
