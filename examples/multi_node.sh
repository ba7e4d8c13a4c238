#!/usr/bin/env bash
# The 80/20 paper's DAPO recipe with token selection, submitted as a job to a running Ray cluster.
#
#   python -m build --wheel                        # dist/verl_tokensel-<version>-py3-none-any.whl
#   RAY_ADDRESS=http://<head>:8265 TOKENSEL_WHEEL=dist/verl_tokensel-0.1.0-py3-none-any.whl \
#   TOKENSEL_MODEL_PATH=/shared/models/Qwen3-14B-Base TOKENSEL_TRAIN_FILES=/shared/data/dapo-math-17k.parquet \
#   TOKENSEL_VAL_FILES=/shared/data/aime-2024.parquet bash examples/multi_node.sh [hydra overrides]
#
# TOKENSEL_RECIPE: a recipe of the package (default dapo_qwen3_14b: the paper's 16 nodes x 8 GPUs, Ulysses SP
# 8, vLLM TP 4; recipes/README.md lists the others). TOKENSEL_SELECTOR: the preset (default forking; none
# for the baseline run). Paths must be readable on every node (shared filesystem).
# How the plugin reaches every node (verl imports it in the job's driver, the TaskRunner and every worker):
# - TOKENSEL_WHEEL set: the wheel travels with the job and Ray's runtime env pip-installs it on each node, on
#   top of the node's own verl and torch;
# - unset: the nodes' image already has verl 0.9.x and verl-tokensel (nothing is installed at job start).
# The job runs recipes/run.sh on the cluster (recipes/submit_ray_job.sh builds the `ray job submit` line;
# TOKENSEL_DRY_RUN=1 prints it). With Ray's token authentication on (Ray >= 2.60 default), also export
# RAY_AUTH_MODE=token. On CPU (a tiny model, for debugging): add trainer.device=cpu and the sizes the
# CPU run needs (tests/test_multi_node_on_cpu.py runs this script that way on two Ray nodes).
set -euo pipefail

if [ -z "${RAY_ADDRESS:-}" ]; then
    echo "error: environment variable RAY_ADDRESS is not set; it must be the Ray dashboard of the cluster's" \
         "head node, e.g. http://head:8265 (started with: ray start --head --dashboard-host 0.0.0.0)" >&2
    exit 2
fi

# image route unless a wheel is given (submit_ray_job.sh would otherwise ask a package index)
export TOKENSEL_PIP="${TOKENSEL_PIP-}"

exec bash "$(dirname "${BASH_SOURCE[0]}")/../recipes/submit_ray_job.sh" \
    "${TOKENSEL_RECIPE:-dapo_qwen3_14b}" "${TOKENSEL_SELECTOR:-forking}" "$@"
