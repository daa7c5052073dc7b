#!/usr/bin/env bash
# Set up (idempotent) and run the CPU test suite in the environment scripts/setup.sh installed into.
# Triton kernels run in the interpreter here; tests marked `cuda` are skipped without a GPU
# (scripts/gpu_suite.sh runs them on one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="$(bash scripts/python_env.sh)"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# Two pytest workers, one test file each at a time (--dist loadfile keeps a file's module fixtures in
# one process), one torch thread each: much of the suite is single-threaded (Triton's interpreter,
# process start-up, servers answering), so two workers halve its time on a 2-core machine.
# TEST_WORKERS=0 runs it in one process.
WORKERS=${TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    exec "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile "$@"
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
