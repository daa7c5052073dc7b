#!/usr/bin/env bash
# Everything a GPU session checks, in one call on the device machine:
#   bash scripts/gpu_suite.sh [tests|bench|pp|goals|compare|s7|s7b|all]      (default: all = tests + bench)
# tests:   the `cuda`-marked tests plus the Triton kernel tests compiled for the GPU;
# bench:   attention bandwidth, decode latency per graph mode vs HF and the memory floor, offline
#          throughput, address-check cost;
# pp:      the two-GPU pipeline tests;
# goals:   GPU tests, then the goal figures: decode per mode with HF, capture cold then warm with
#          serving at gpu_memory_utilization 0.95, throughput;
# compare: FULL decode of SmolLM2 / Llama-3.2-1B with PDL off, on, and (OLD_TREE=dir, a checkout of an
#          earlier commit) that code, in one run; FULL profiles.
# s7, s7b: session 7's runs (the PIECEWISE step graph: GPU tests; replay variants, decode, capture);
#          docs/PERFORMANCE.md §S7.
# The stages of earlier sessions (probe, s3*, s4*, s5*, s6*, ...) live in the commits docs/PERFORMANCE.md
# names for each run.
# Logs go to $OUT/suite.log, figures to $OUT/*.json and $OUT/*.png; a short table comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
STAGE=${1:-all}
if ! python3 -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/suite.log"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/suite.log"

SUMMARY=()
step() {  # step NAME SECONDS CMD...: run with a time limit, append its log, remember how it went
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "===== $name: $*" >> "$OUT/suite.log"
  timeout "$limit" "$@" > "$OUT/$name.tmp" 2>&1
  local rc=$?
  cat "$OUT/$name.tmp" >> "$OUT/suite.log"
  tail -n 30 "$OUT/$name.tmp"
  rm -f "$OUT/$name.tmp"
  SUMMARY+=("$(printf '| %-12s | rc=%-3s | %4ss |' "$name" "$rc" "$((SECONDS - start))")")
}
decode_against_old_tree() {  # decode_against_old_tree ARGS...: bench_decode twice, each time also OLD_TREE's
  for round in 1 2; do
    step decode$round 90 python3 -m runner.cli bench decode "$@" --json "$OUT/decode$round.json"
    if [[ -n ${OLD_TREE:-} ]]; then
      step decode-old$round 90 env PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 "$OLD_TREE/scripts/bench_decode.py" \
        "$@" --json "$OUT/decode_old$round.json"
    fi
  done
}

if [[ $STAGE == tests || $STAGE == all ]]; then
  step cuda-tests 300 python3 -m pytest -q -p no:cacheprovider -m cuda -rA -s tests \
    --deselect tests/test_pipeline.py
  step triton-gpu 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
fi
if [[ $STAGE == bench || $STAGE == all ]]; then
  step attention 90 python3 -m runner.cli bench attention --out "$OUT/attention"
  step decode 330 python3 -m runner.cli bench decode --warmup 3 --steps 15 --hf-max-batch 32 --out "$OUT/decode"
  step throughput 150 python3 -m runner.cli bench throughput --out "$OUT/throughput"
  step addresses 30 python3 -m runner.cli bench addresses
fi
if [[ $STAGE == pp ]]; then
  step pp-tests 240 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests/test_pipeline.py
fi
if [[ $STAGE == goals ]]; then  # session 5's s5final: tests and goal figures, one call (~5 min)
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step decode 150 python3 -m runner.cli bench decode --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --out "$OUT/decode"
  step capture 120 python3 -m runner.cli bench capture --cold --modes FULL_AND_PIECEWISE FULL_AND_PIECEWISE PIECEWISE FULL \
    --gpu-memory-utilization 0.95 --serve 256 --out "$OUT/capture"
  step throughput 80 python3 -m runner.cli bench throughput --out "$OUT/throughput"
fi
if [[ $STAGE == compare ]]; then  # session 5's s5check without its tests: a change measured against its own absence
  small=(--shapes smollm2-135m llama-3.2-1b --modes FULL --batch-sizes 1 32 --warmup 3 --steps 15 --no-hf --no-plot)
  step decode-pdl0 90 env GRAPHRUNNER_PDL=0 python3 -m runner.cli bench decode "${small[@]}" --out "$OUT/decode_pdl0"
  step decode 90 python3 -m runner.cli bench decode "${small[@]}" --out "$OUT/decode"
  if [[ -n ${OLD_TREE:-} ]]; then
    step decode-old 90 env PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 "$OLD_TREE/scripts/bench_decode.py" "${small[@]}" \
      --out "$OUT/decode_old"
  fi
  step profile-full 60 python3 -m runner.cli bench profile_step --mode FULL --batch-size 1 --host-profile
  step profile-1b 60 python3 -m runner.cli bench profile_step --shape llama-3.2-1b --mode FULL --batch-size 1
fi
if [[ $STAGE == s7 ]]; then  # session 7: every GPU test with the PIECEWISE step graph (~5 min)
  step cuda-tests 330 python3 -m pytest -q -p no:cacheprovider -m cuda -rA -s tests --deselect tests/test_pipeline.py
  step triton-gpu 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
fi
if [[ $STAGE == s7b ]]; then  # session 7: the replay variants in one process at bs 1 and 32; PIECEWISE vs FULL at
  # bs 1-128 twice (with OLD_TREE's code when given); cold capture of the default sizes (the goal < 10 s), serving at 0.95
  step break-replay 100 python3 -m runner.cli bench break_replay --blocks 4 --steps 40
  step break-replay-bs32 100 python3 -m runner.cli bench break_replay --batch-size 32 --blocks 4 --steps 40
  small=(--shapes smollm2-135m --modes FULL PIECEWISE --batch-sizes 1 8 32 128 --warmup 3 --steps 20 --no-hf --no-plot)
  decode_against_old_tree "${small[@]}"
  step capture 150 python3 -m runner.cli bench capture --cold --modes FULL_AND_PIECEWISE FULL_AND_PIECEWISE PIECEWISE \
    --gpu-memory-utilization 0.95 --serve 256 --out "$OUT/capture"
fi
echo
echo "| step         | result | time  |"
echo "|--------------|--------|-------|"
printf '%s\n' "${SUMMARY[@]}"
