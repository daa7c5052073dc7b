#!/usr/bin/env bash
# Everything a GPU session checks, in one call on the device machine:
#   bash scripts/gpu_suite.sh [tests|bench|pp|final|recheck|probe|goals|all]
# tests: the `cuda`-marked tests plus the Triton kernel tests compiled for the GPU;
# bench: attention bandwidth, decode latency per graph mode vs HF and the memory floor,
#        offline throughput, address-check cost; pp: the two-GPU pipeline tests;
#        final: pp + tests + fused-kernel before/after decode latency + default-size capture;
#        recheck: decode (with HF), default-size capture and throughput only;
#        probe: GPU tests, cold capture + graph memory + serving at gpu_memory_utilization 0.95,
#               kernel profiles of the SmolLM2 step, decode FULL/PIECEWISE, throughput;
#        goals: the goal figures (decode per mode with HF, capture, throughput, profiles);
#        s3probe: GPU tests, host cost of an eager launch, fused small-batch linears vs cuBLAS,
#                 profiles, decode FULL/PIECEWISE with everything on, then with the small-batch
#                 kernels and the fast eager launch off (before/after in one run);
#        s3check: GPU tests, linear micro-benchmarks, FULL profile, decode FULL/PIECEWISE with this
#                 session's changes off, then on with async scheduling off and on, in one run; s3goals: the goal figures (decode per mode with HF, cold
#                 capture + serving at 0.95, throughput, FULL host profile); s3tests: the GPU tests.
#        s4probe: one-row GEMV tile sweep (bench_gemv_configs), PIECEWISE host profile, 1B FULL profile;
#        s4check: GPU tests, kernel tests, one-row bench_linear, FULL profiles, decode FULL/PIECEWISE bs 1/32;
#        s4split: FULL bs1 decode with the split-KV merge in-kernel or not, and MIN_SPLIT_TILES 1/2/4;
#        s4goals: decode per mode with HF, cold capture + serving at 0.95, throughput (s3tests: the GPU tests).
#        s5check: GPU tests, one-row bench_linear, FULL decode of SmolLM2 / Llama-3.2-1B with PDL off, on, and
#                 (OLD_TREE=dir: a checkout of an earlier commit) the earlier code, FULL profiles;
#        s5verify: GPU tests, decode FULL/PIECEWISE of SmolLM2 / Llama-3.2-1B, PIECEWISE host profile;
#        s5goals: the goal figures (decode per mode with HF, cold capture + serving at 0.95, throughput);
#        s5host: FULL bs1 host profile, capture cold then warm, SmolLM2 decode FULL/PIECEWISE;
#        s5head: GPU tests, decode FULL/PIECEWISE of the small shapes, capture + serving at 0.95, FULL host profile;
#        s5final: GPU tests, then the goal figures (decode per mode with HF, cold and warm capture + serving
#                 at 0.95, throughput).
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

if [[ $STAGE == tests || $STAGE == all ]]; then
  step cuda-tests 300 python3 -m pytest -q -p no:cacheprovider -m cuda -rA -s tests \
    --deselect tests/test_pipeline.py
  step triton-gpu 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
fi
if [[ $STAGE == bench || $STAGE == all ]]; then
  step attention 90 python3 scripts/bench_attention.py --json "$OUT/attention.json"
  step decode 330 python3 scripts/bench_decode.py --warmup 3 --steps 15 --hf-max-batch 32 --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step throughput 150 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
  step addresses 30 python3 scripts/bench_addresses.py
fi
if [[ $STAGE == pp ]]; then
  step pp-tests 240 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests/test_pipeline.py
fi
if [[ $STAGE == final ]]; then  # one call: GPU tests, PP on two GPUs, fusion before/after, default-size capture
  step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rA -s tests --deselect tests/test_pipeline.py
  step pp-tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests/test_pipeline.py
  step unfused 100 env GRAPHRUNNER_FUSED_OPS=0 python3 scripts/bench_decode.py --modes FULL PIECEWISE \
    --batch-sizes 1 32 --warmup 3 --steps 15 --no-hf --no-plot --json "$OUT/decode_unfused.json"
  step fused 100 python3 scripts/bench_decode.py --modes FULL PIECEWISE --batch-sizes 1 32 \
    --warmup 3 --steps 15 --no-hf --no-plot --json "$OUT/decode_fused.json"
  step capture 90 python3 scripts/bench_capture.py --json "$OUT/capture.json"
  step fused-gpu 40 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py
fi
if [[ $STAGE == recheck ]]; then  # the goal figures again after a change, on the GPU the goals name
  step decode 95 python3 scripts/bench_decode.py --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step capture 50 python3 scripts/bench_capture.py --json "$OUT/capture.json"
  step throughput 60 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
fi
if [[ $STAGE == probe ]]; then
  step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rA -s tests --deselect tests/test_pipeline.py
  step kernel-tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fused_kernels.py
  step capture 150 python3 scripts/bench_capture.py --cold --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
  step profile-pw 60 python3 scripts/profile_step.py --mode PIECEWISE --batch-size 1
  step decode 120 python3 scripts/bench_decode.py --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 \
    --no-hf --no-plot --json "$OUT/decode.json"
  step throughput 90 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
fi
if [[ $STAGE == s3probe ]]; then
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA -s tests --deselect tests/test_pipeline.py
  step kernel-tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fused_kernels.py \
    tests/test_small_batch_kernels.py tests/test_fast_launch.py
  step launch 40 python3 scripts/bench_launch.py --json "$OUT/launch.json"
  step linear 120 python3 scripts/bench_linear.py --json "$OUT/linear.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
  step profile-pw 60 python3 scripts/profile_step.py --mode PIECEWISE --batch-size 1 --host-profile
  step decode 150 python3 scripts/bench_decode.py --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 \
    --no-hf --no-plot --json "$OUT/decode.json"
  step decode-before 150 env GRAPHRUNNER_SMALL_BATCH_KERNELS=0 GRAPHRUNNER_FAST_LAUNCH=0 python3 scripts/bench_decode.py \
    --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 --no-hf --no-plot --json "$OUT/decode_before.json"
fi
if [[ $STAGE == s3check ]]; then
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step kernel-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fused_kernels.py \
    tests/test_small_batch_kernels.py tests/test_fast_launch.py
  step linear 60 python3 scripts/bench_linear.py --shapes smollm2-135m llama-3.2-1b --json "$OUT/linear.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
  step decode-before 100 env GRAPHRUNNER_SMALL_BATCH_KERNELS=0 GRAPHRUNNER_FAST_LAUNCH=0 python3 scripts/bench_decode.py \
    --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 --async-scheduling off --no-hf --no-plot \
    --json "$OUT/decode_before.json"
  step decode-sync 100 python3 scripts/bench_decode.py --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 \
    --async-scheduling off --no-hf --no-plot --json "$OUT/decode_sync.json"
  step decode-async 100 python3 scripts/bench_decode.py --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 \
    --async-scheduling on --no-hf --no-plot --json "$OUT/decode_async.json"
fi
if [[ $STAGE == s3goals ]]; then
  step decode 200 python3 scripts/bench_decode.py --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step capture 120 python3 scripts/bench_capture.py --cold --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step throughput 90 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1 --host-profile
fi
if [[ $STAGE == s3tests ]]; then
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step kernel-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fused_kernels.py \
    tests/test_small_batch_kernels.py tests/test_fast_launch.py
fi
if [[ $STAGE == s4probe ]]; then  # session 4: data for the GEMV tiles, the PIECEWISE host path, the 1B step
  step gemv 240 python3 scripts/bench_gemv_configs.py --json "$OUT/gemv.json"
  step profile-pw 60 python3 scripts/profile_step.py --mode PIECEWISE --batch-size 1 --host-profile --top 40
  step profile-1b 60 python3 scripts/profile_step.py --shape llama-3.2-1b --mode FULL --batch-size 1 --top 30
fi
if [[ $STAGE == s4check ]]; then  # session 4: GPU tests of the changed kernels, their micro-benchmarks, decode
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step kernel-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_small_batch_kernels.py tests/test_greedy_argmax.py tests/test_fast_launch.py
  step linear 90 python3 scripts/bench_linear.py --rows 1 --json "$OUT/linear.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
  step profile-1b 60 python3 scripts/profile_step.py --shape llama-3.2-1b --mode FULL --batch-size 1
  step decode 200 python3 scripts/bench_decode.py --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 15 \
    --no-hf --no-plot --json "$OUT/decode.json"
fi
if [[ $STAGE == s4split ]]; then  # session 4: the split-KV merge variants, FULL bs1 decode of the three shapes
  step kernel-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_greedy_argmax.py tests/test_triton_gpu.py \
    tests/test_triton_kernels.py -k "split or argmax or fast_launch or graph"
  for variant in 1:1 0:1 1:2 1:4; do
    fused=${variant%%:*} min_tiles=${variant##*:}
    step "decode-f${fused}-m${min_tiles}" 100 env GRAPHRUNNER_FUSED_MERGE=$fused GRAPHRUNNER_MIN_SPLIT_TILES=$min_tiles \
      python3 scripts/bench_decode.py --modes FULL --batch-sizes 1 --warmup 3 --steps 15 --no-hf --no-plot \
      --json "$OUT/decode_f${fused}_m${min_tiles}.json"
  done
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
fi
if [[ $STAGE == s4goals ]]; then  # session 4: the goal figures on HEAD
  step decode 240 python3 scripts/bench_decode.py --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step capture 150 python3 scripts/bench_capture.py --cold --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step throughput 100 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
fi
if [[ $STAGE == s5check ]]; then  # session 5: PDL and the hand-pipelined K loop, tested, then measured on/off/before
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step kernel-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_pdl.py \
    tests/test_small_batch_kernels.py tests/test_greedy_argmax.py tests/test_fused_kernels.py
  step linear 60 env GRAPHRUNNER_PDL=0 python3 scripts/bench_linear.py --rows 1 --shapes llama-3.2-1b \
    --json "$OUT/linear.json"
  small=(--shapes smollm2-135m llama-3.2-1b --modes FULL --batch-sizes 1 32 --warmup 3 --steps 15 --no-hf --no-plot)
  step decode-pdl0 90 env GRAPHRUNNER_PDL=0 python3 scripts/bench_decode.py "${small[@]}" --json "$OUT/decode_pdl0.json"
  step decode 90 python3 scripts/bench_decode.py "${small[@]}" --json "$OUT/decode.json"
  if [[ -n ${OLD_TREE:-} ]]; then
    step decode-old 90 env PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 "$OLD_TREE/scripts/bench_decode.py" "${small[@]}" \
      --json "$OUT/decode_old.json"
  fi
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
  step profile-1b 60 python3 scripts/profile_step.py --shape llama-3.2-1b --mode FULL --batch-size 1
fi
if [[ $STAGE == s5verify ]]; then  # session 5: GPU tests of every change, then the small shapes per mode
  step cuda-tests 240 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step decode 120 python3 scripts/bench_decode.py --shapes smollm2-135m llama-3.2-1b --modes FULL PIECEWISE \
    --batch-sizes 1 32 --warmup 3 --steps 15 --no-hf --no-plot --json "$OUT/decode.json"
  step profile-pw 60 python3 scripts/profile_step.py --mode PIECEWISE --batch-size 1 --host-profile --top 25
fi
if [[ $STAGE == s5goals ]]; then  # session 5: the goal figures on HEAD
  step decode 270 python3 scripts/bench_decode.py --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step capture 150 python3 scripts/bench_capture.py --cold --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step throughput 100 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
fi
if [[ $STAGE == s5host ]]; then  # session 5: where the host time of a SmolLM2 step goes; capture cold and warm
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1 --host-profile --top 45
  step capture 150 python3 scripts/bench_capture.py --cold --modes FULL_AND_PIECEWISE FULL_AND_PIECEWISE \
    --json "$OUT/capture.json"
  step decode 60 python3 scripts/bench_decode.py --shapes smollm2-135m --modes FULL PIECEWISE --batch-sizes 1 32 \
    --warmup 3 --steps 15 --no-hf --no-plot --json "$OUT/decode.json"
fi
if [[ $STAGE == s5head ]]; then  # session 5: the LM head and greedy argmax inside decode graphs
  step cuda-tests 240 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step decode 120 python3 scripts/bench_decode.py --shapes smollm2-135m llama-3.2-1b --modes FULL PIECEWISE \
    --batch-sizes 1 32 --warmup 3 --steps 15 --no-hf --no-plot --json "$OUT/decode.json"
  step capture 120 python3 scripts/bench_capture.py --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1 --host-profile --top 30
fi
if [[ $STAGE == s5final ]]; then  # session 5: tests and goal figures on the final commit, one call
  step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rA tests --deselect tests/test_pipeline.py
  step decode 150 python3 scripts/bench_decode.py --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step capture 120 python3 scripts/bench_capture.py --cold --modes FULL_AND_PIECEWISE FULL_AND_PIECEWISE PIECEWISE FULL \
    --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step throughput 80 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
fi
if [[ $STAGE == goals ]]; then
  step decode 150 python3 scripts/bench_decode.py --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
    --json "$OUT/decode.json" --plot "$OUT/decode.png"
  step capture 120 python3 scripts/bench_capture.py --cold --gpu-memory-utilization 0.95 --serve 256 --json "$OUT/capture.json"
  step throughput 90 python3 scripts/bench_throughput.py --json "$OUT/throughput.json"
  step profile-full 60 python3 scripts/profile_step.py --mode FULL --batch-size 1
fi
echo
echo "| step         | result | time  |"
echo "|--------------|--------|-------|"
printf '%s\n' "${SUMMARY[@]}"
