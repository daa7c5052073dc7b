#!/usr/bin/env bash
# Set up (idempotent) and generate with the embedded SmolLM2-135M-Instruct on this machine, with the
# graphrunner CLI of the environment scripts/setup.sh installed into.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="$(bash scripts/python_env.sh)"
exec "$PY" -m runner.cli generate --model default --chat --max-tokens 48 \
  --prompt "What is the capital of France?" \
  --prompt "Write a haiku about GPUs." \
  --prompt "Name three primary colors." "$@"
