#!/usr/bin/env bash
# Launch one recipe with one token-selection preset:
#   recipes/run.sh <recipe-name> <preset> [extra hydra overrides...]
# e.g. recipes/run.sh dapo_qwen3_14b forking trainer.nnodes=16
# The recipes are package data of verl-tokensel (pkg://verl_tokensel.recipes), so this script works with the
# package installed from a wheel or from a checkout alike; it needs nothing else from the repository.
# Needs TOKENSEL_MODEL_PATH, TOKENSEL_TRAIN_FILES, TOKENSEL_VAL_FILES. Optional: TOKENSEL_TIMEOUT
# (a `timeout` duration, default 7d), TOKENSEL_PYTHON (default python3). No secrets here: log in to
# wandb etc. through the environment of the job, not this script.
set -euo pipefail

PYTHON="${TOKENSEL_PYTHON:-python3}"
TIMEOUT="${TOKENSEL_TIMEOUT:-7d}"

# the installed package's recipes (an import of verl_tokensel only, no verl) and presets
recipe_list() {
    "$PYTHON" -c 'import importlib.resources as r; print(" ".join(sorted(p.name[:-5] for p in r.files("verl_tokensel.recipes").iterdir() if p.name.endswith(".yaml"))))'
}
preset_list() {  # the selector core: torch, no verl
    "$PYTHON" -c 'from verl_tokensel.core.config import PRESETS; print(" ".join(PRESETS))'
}
usage() {
    echo "usage: $0 <recipe-name> <preset> [extra hydra overrides...]" >&2
    echo "  recipes: $(recipe_list 2>/dev/null)" >&2
    echo "  presets: $(preset_list 2>/dev/null)" >&2
}

if [ "$#" -lt 2 ]; then
    usage
    exit 2
fi
recipe="${1%.yaml}"
preset="$2"
shift 2

recipes="$(recipe_list 2>/dev/null)" || recipes=""  # empty: $PYTHON cannot import verl_tokensel (said below)
if [ -n "$recipes" ] && [[ " $recipes " != *" $recipe "* ]]; then
    echo "error: no recipe '$recipe' in the installed verl_tokensel.recipes; the recipes: $recipes" >&2
    exit 2
fi

missing=0
check_var() {
    if [ -z "${!1:-}" ]; then
        echo "error: environment variable $1 is not set; it must point to $2" >&2
        missing=1
    fi
}
check_var TOKENSEL_MODEL_PATH "the HF model directory (e.g. a local copy of Qwen/Qwen3-14B-Base)"
check_var TOKENSEL_TRAIN_FILES "the training parquet file(s), e.g. /data/dapo-math-17k.parquet"
check_var TOKENSEL_VAL_FILES "the validation parquet file(s), e.g. /data/aime-2024.parquet"
if [ "$missing" -ne 0 ]; then
    exit 2
fi
if [ -z "$recipes" ]; then
    echo "error: $PYTHON cannot import verl_tokensel; install it first (the wheel: python -m build --wheel; pip install dist/verl_tokensel-*.whl)," \
         "or set TOKENSEL_PYTHON to the interpreter that has it" >&2
    exit 2
fi

# Run in its own process group so that everything it starts is killed on exit or signal.
set -m
timeout --kill-after=60 "$TIMEOUT" "$PYTHON" -m verl_tokensel.main_ppo \
    --config-path=pkg://verl_tokensel.recipes --config-name="$recipe" \
    "actor_rollout_ref.actor.token_selector=$preset" "$@" &
child=$!
cleanup() {
    kill -TERM -- "-$child" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 143' TERM INT HUP
rc=0
wait "$child" || rc=$?
exit "$rc"
