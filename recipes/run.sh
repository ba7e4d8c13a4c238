#!/usr/bin/env bash
# Launch one recipe with one token-selection preset:
#   recipes/run.sh <recipe-name> <preset> [extra hydra overrides...]
# e.g. recipes/run.sh dapo_qwen3_14b forking trainer.nnodes=16
# Needs TOKENSEL_MODEL_PATH, TOKENSEL_TRAIN_FILES, TOKENSEL_VAL_FILES. Optional: TOKENSEL_TIMEOUT
# (a `timeout` duration, default 7d), TOKENSEL_PYTHON (default python3). No secrets here: log in to
# wandb etc. through the environment of the job, not this script.
set -euo pipefail

RECIPES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    echo "usage: $0 <recipe-name> <preset> [extra hydra overrides...]" >&2
    echo "  recipes: $(cd "$RECIPES_DIR" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
    echo "  presets: none forking forking_bottom random gmts grad_norm" >&2
}

if [ "$#" -lt 2 ]; then
    usage
    exit 2
fi
recipe="${1%.yaml}"
preset="$2"
shift 2

if [ ! -f "$RECIPES_DIR/$recipe.yaml" ]; then
    echo "error: no recipe '$recipe' in $RECIPES_DIR" >&2
    usage
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

PYTHON="${TOKENSEL_PYTHON:-python3}"
TIMEOUT="${TOKENSEL_TIMEOUT:-7d}"

# Run in its own process group so that everything it starts is killed on exit or signal.
set -m
timeout --kill-after=60 "$TIMEOUT" "$PYTHON" -m verl_tokensel.main_ppo \
    --config-path="$RECIPES_DIR" --config-name="$recipe" \
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
