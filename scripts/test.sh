#!/usr/bin/env bash
# Set up (idempotent) and run the CPU test suite in the environment scripts/setup.sh installed into.
# Triton kernels run in the interpreter here; tests marked `cuda` are skipped without a GPU
# (scripts/gpu_suite.sh runs them on one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="$(bash scripts/python_env.sh)"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
