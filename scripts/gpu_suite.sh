#!/usr/bin/env bash
# The GPU checks of graphrunner in one call, on a machine with an NVIDIA GPU:
#   bash scripts/gpu_suite.sh [--out DIR] [STAGE...]            (default: tests bench)
# Stages, each named for what it measures:
#   tests       every `cuda`-marked test (one GPU; the pipeline tests are the `pp` stage) and the
#               Triton kernel tests compiled for the GPU
#   bench       decode-step latency, FULL and PIECEWISE, dummy bf16 weights: the SmolLM2-135M and
#               Llama-3.2-1B shapes at batch 1 and 32, Llama-3-8B at batch 1; two rounds. With
#               OLD_TREE=DIR (a checkout of another commit) each round also runs that tree's decode
#               benchmark, so a change is measured against its absence in one run
#   decode-hf   decode latency per mode at batch 1-128 for the three shapes against HF transformers
#               eager and the memory floor, with the plot (docs/plots/decode_h100.png)
#   attention   decode attention bandwidth against a device-to-device copy
#   throughput  offline throughput, nano-vllm's recipe (Qwen3-0.6B shape), against its bandwidth bound
#               (with OLD_TREE=DIR also that tree's throughput, in the same run)
#   features    the sampling stage at batch 1/32/256 (the Triton kernels, the default, then the torch path)
#               structured output's cost at batch 32, and the OpenAI server against offline
#               generation with the engine in a thread and in its own process (Llama-3.2-1B shape;
#               the process also with 1024 output tokens)
#   startup     LLM(...) to ready with empty then warm caches (Llama-3.2-1B, Qwen3-0.6B shapes), and
#               weight loading to the GPU against reading the file
#   capture     start-up: capture of the default sizes cold then warm, graph memory estimate vs
#               actual, 256 requests served at gpu_memory_utilization 0.95
#   replay      PIECEWISE replay variants (step graph vs the Python layer loop) in one process
#   addresses   host cost of the debug address check
#   profile     kernels and host functions of a FULL decode step (SmolLM2, Llama-3.2-1B; bs 1)
#   pp          the multi-GPU tests (pipeline, tensor parallel, push all-reduce; two GPUs) and the Llama-3-8B
#               shape's FULL decode step at batch 1, 16 and 32, TP=1 against TP=2 (the default: the push
#               all-reduce up to 131072 bytes), then the push all-reduce against NCCL in a graph, TP=2
#               with NCCL for every all-reduce, and at batch 1 with the push sum after the o_proj / down
#               GEMVs instead of inside them; the one-row GEMV tiles on a TP=2 rank's Llama-3-8B shards
#   tp-soak     the multi-GPU tensor-parallel tests TP_SOAK_RUNS times (default 5), every other run with
#               cold caches (half of those with the NCCL engines first, half with the push tests
#               first; TP_SOAK_ORDER=cold-push: every run cold, push tests only; TP_SOAK_PAIRS=2: on
#               two GPU pairs side by side), each run's log, trace and the push kernels' timeout
#               record kept, every process's stacks dumped while it runs long (scripts/tp_soak.sh;
#               the push all-reduce's rare start-up stall, docs/PARALLEL.md)
#   all         tests bench decode-hf attention throughput capture replay addresses
# Raw output goes to DIR (--out, else $OUT, else bench-results/gpu-suite): suite.log holds every
# step's output, DIR/<step>/ its JSON and plots. Printed last: each step's exit code and time, then
# the decode figures of the run (and OLD_TREE's beside them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-bench-results/gpu-suite}
STAGES=()
while (($#)); do
  case $1 in
    --out) OUT_DIR=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) STAGES+=("$1"); shift ;;
  esac
done
((${#STAGES[@]})) || STAGES=(tests bench)
if [[ " ${STAGES[*]} " == *" all "* ]]; then
  STAGES=(tests bench decode-hf attention throughput capture replay addresses)
fi
for stage in "${STAGES[@]}"; do
  case $stage in
    tests|bench|decode-hf|attention|throughput|features|startup|capture|replay|addresses|profile|pp|tp-soak) ;;
    *) echo "unknown stage '$stage' (see bash scripts/gpu_suite.sh --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

# Without network access pydantic may be missing: install the wheels carried in .whl/ (git-ignored).
SITE=""
if ! python3 -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site
fi
export PYTHONPATH=$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PATH=${SITE:+$SITE/bin:}$PATH   # the carried wheels' programs (py-spy for the tp-soak stage)
unset TRITON_INTERPRET
LOG=$OUT_DIR/suite.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$LOG"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$LOG"

SUMMARY=()
step() {  # step NAME SECONDS CMD...: run with a time limit, append its output to the log, remember how it went
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "===== $name: $*" >> "$LOG"
  timeout "$limit" "$@" > "$OUT_DIR/$name.tmp" 2>&1
  local rc=$?
  cat "$OUT_DIR/$name.tmp" >> "$LOG"
  tail -n 30 "$OUT_DIR/$name.tmp"
  rm -f "$OUT_DIR/$name.tmp"
  SUMMARY+=("$(printf '| %-22s | %-4s | %5ss |' "$name" "$rc" "$((SECONDS - start))")")
}
BENCH=(python3 -m runner.cli bench)   # `graphrunner bench` of this tree
old_decode() {  # old_decode OUTDIR ARGS...: OLD_TREE's decode benchmark (installed module, or its older script)
  local out=$1; shift
  mkdir -p "$out"
  if [[ -f $OLD_TREE/runner/benchmarks/decode.py ]]; then
    env -C "$OLD_TREE" PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 -m runner.cli bench decode "$@" --out "$out"
  else
    PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 "$OLD_TREE/scripts/bench_decode.py" "$@" --json "$out/decode.json"
  fi
}
export -f old_decode
export OLD_TREE=${OLD_TREE:-} SITE

for stage in "${STAGES[@]}"; do
  case $stage in
    tests)
      step cuda-tests 540 python3 -m pytest -q -p no:cacheprovider -m cuda -rA --timeout 180 tests \
        --deselect tests/test_pipeline.py
      step triton-gpu-kernels 240 python3 -m pytest -q -p no:cacheprovider -m "not cuda" tests/test_triton_kernels.py \
        tests/test_fused_kernels.py tests/test_small_batch_kernels.py tests/test_greedy_argmax.py
      ;;
    bench)
      small=(--shapes smollm2-135m llama-3.2-1b --modes FULL PIECEWISE --batch-sizes 1 32 --warmup 3 --steps 20
             --no-hf --no-plot)
      large=(--shapes llama-3-8b --modes FULL PIECEWISE --batch-sizes 1 --warmup 3 --steps 20 --no-hf --no-plot)
      for round in 1 2; do
        step decode-small-r$round 120 "${BENCH[@]}" decode "${small[@]}" --out "$OUT_DIR/decode-small-r$round"
        step decode-8b-r$round 120 "${BENCH[@]}" decode "${large[@]}" --out "$OUT_DIR/decode-8b-r$round"
        if [[ -n $OLD_TREE ]]; then
          step old-decode-small-r$round 120 bash -c 'old_decode "$@"' _ "$OUT_DIR/old-decode-small-r$round" "${small[@]}"
          step old-decode-8b-r$round 120 bash -c 'old_decode "$@"' _ "$OUT_DIR/old-decode-8b-r$round" "${large[@]}"
        fi
      done
      ;;
    decode-hf)
      step decode-hf 330 "${BENCH[@]}" decode --modes FULL PIECEWISE --warmup 3 --steps 15 --hf-max-batch 32 \
        --out "$OUT_DIR/decode-hf"
      ;;
    attention) step attention 90 "${BENCH[@]}" attention --out "$OUT_DIR/attention" ;;
    throughput)
      step throughput 150 "${BENCH[@]}" throughput --out "$OUT_DIR/throughput"
      if [[ -n $OLD_TREE ]]; then
        step old-throughput 150 env -C "$OLD_TREE" PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 -m runner.cli bench \
          throughput --out "$OUT_DIR/old-throughput"
      fi
      ;;
    features)
      # A model folder of the Llama-3.2-1B shape with a real tokenizer (SmolLM2's, carried in TOKENIZER_DIR).
      tok=${TOKENIZER_DIR:-.diag/tok}
      served=$OUT_DIR/llama-3.2-1b-dummy
      python3 -c "import sys; from runner.benchmarks.model_shapes import write_config; write_config('llama-3.2-1b', sys.argv[1])" \
        "$served" && cp "$tok"/tokenizer* "$served"/
      step sampler 120 "${BENCH[@]}" sampler --device cuda --step-ms 1.434 --out "$OUT_DIR/sampler"
      step sampler-torch 120 env GRAPHRUNNER_TRITON_SAMPLING=0 "${BENCH[@]}" sampler --device cuda --step-ms 1.434 \
        --out "$OUT_DIR/sampler-torch"
      step structured 200 "${BENCH[@]}" structured --shape llama-3.2-1b --batch 32 --steps 128 --tokenizer "$tok" \
        --out "$OUT_DIR/structured"
      serve=(serve --model "$served" --load-format dummy --num-prompts 256 --input-len 256 --output-len 128 --offline)
      step serve-thread 240 "${BENCH[@]}" "${serve[@]}" --no-engine-process --out "$OUT_DIR/serve-thread"
      step serve-process 240 "${BENCH[@]}" "${serve[@]}" --engine-process --out "$OUT_DIR/serve-process"
      # 1024 output tokens: the steady state, where the API process paces the server (the ramp is < 5%).
      step serve-process-1024 300 "${BENCH[@]}" serve --model "$served" --load-format dummy --num-prompts 256 \
        --input-len 256 --output-len 1024 --offline --engine-process --out "$OUT_DIR/serve-process-1024"
      ;;
    startup)
      step startup 300 "${BENCH[@]}" startup --no-cpu --out "$OUT_DIR/startup"
      # The cuBLAS warm-up against its absence, alternating on one host (hosts differ by more than it).
      step startup-gemm-warm-up 300 "${BENCH[@]}" startup --no-cpu --gpu-shapes qwen3-0.6b --gpu-warm-runs 6 \
        --gpu-against GRAPHRUNNER_GEMM_WARM_UP=0 --out "$OUT_DIR/startup-gemm-warm-up"
      step cublas-first 120 "${BENCH[@]}" cublas_first --shape qwen3-0.6b --out "$OUT_DIR/cublas-first"
      step load 120 "${BENCH[@]}" load --device cuda --no-embedded --num-layers 16 --out "$OUT_DIR/load"
      ;;
    capture)
      step capture 150 "${BENCH[@]}" capture --cold --modes FULL_AND_PIECEWISE FULL_AND_PIECEWISE PIECEWISE \
        --gpu-memory-utilization 0.95 --serve 256 --out "$OUT_DIR/capture"
      ;;
    replay)
      step replay-bs1 100 "${BENCH[@]}" break_replay --blocks 4 --steps 40 --out "$OUT_DIR/replay-bs1"
      step replay-bs32 100 "${BENCH[@]}" break_replay --batch-size 32 --blocks 4 --steps 40 --out "$OUT_DIR/replay-bs32"
      ;;
    addresses) step addresses 30 "${BENCH[@]}" addresses --out "$OUT_DIR/addresses" ;;
    profile)
      step profile-smollm2 60 "${BENCH[@]}" profile_step --mode FULL --batch-size 1 --host-profile
      step profile-llama-1b 60 "${BENCH[@]}" profile_step --shape llama-3.2-1b --mode FULL --batch-size 1
      ;;
    pp)
      step pp-tests 330 python3 -m pytest -q -p no:cacheprovider -m "cuda or multigpu" -rA tests/test_pipeline.py \
        tests/test_tensor_parallel.py tests/test_push_all_reduce.py tests/test_push_trace.py
      step tp-decode 240 "${BENCH[@]}" decode --shapes llama-3-8b --modes FULL --batch-sizes 1 16 32 \
        --tensor-parallel-size 1 2 --no-hf --no-plot --out "$OUT_DIR/tp-decode"
      step all-reduce 120 "${BENCH[@]}" all_reduce --out "$OUT_DIR/all-reduce"
      step gemv-tp2 240 "${BENCH[@]}" gemv_configs --shapes llama-3-8b --tensor-parallel-size 2 \
        --out "$OUT_DIR/gemv-tp2"
      # The default's all-reduces (the push kernel's up to 131072 bytes) against NCCL's for all, and
      # against the push kernel's run after the o_proj/down_proj GEMVs instead of inside them.
      step tp-decode-nccl 180 env GRAPHRUNNER_PUSH_ALL_REDUCE_MAX_BYTES=0 "${BENCH[@]}" decode \
        --shapes llama-3-8b --modes FULL --batch-sizes 1 16 32 --tensor-parallel-size 2 --no-hf --no-plot \
        --out "$OUT_DIR/tp-decode-nccl"
      step tp-decode-push-after-gemv 180 env GRAPHRUNNER_PUSH_ALL_REDUCE_IN_GEMV=0 "${BENCH[@]}" decode \
        --shapes llama-3-8b --modes FULL --batch-sizes 1 --tensor-parallel-size 2 --no-hf --no-plot \
        --out "$OUT_DIR/tp-decode-push-after-gemv"
      ;;
    tp-soak)
      runs=${TP_SOAK_RUNS:-5}
      step tp-soak $((runs * 340 + 10)) bash scripts/tp_soak.sh "$OUT_DIR/tp-soak" "$runs"
      ;;
  esac
done

echo
echo "| step                   | rc   | time   |"
echo "|------------------------|------|--------|"
printf '%s\n' "${SUMMARY[@]}"
python3 - "$OUT_DIR" <<'EOF'
"""The decode figures of this run: median ms/step over the rounds, and OLD_TREE's beside them."""
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
figures = {}   # (tree, shape, bs, mode) -> [ms per step of each round]
paths = [p for pattern in ("decode-small-r*", "decode-8b-r*", "old-decode-*") for p in out.glob(pattern + "/decode.json")]
for path in sorted(paths):
    tree = "old" if path.parent.name.startswith("old-") else "this"
    for row in json.loads(path.read_text())["rows"]:
        figures.setdefault((tree, row["shape"], row["batch_size"], row["mode"]), []).append(row["ms_per_step"])
keys = sorted({k[1:] for k in figures if k[0] == "this"})
if keys:
    print("\n| shape | bs | mode | ms/step (rounds) | OLD_TREE ms/step (rounds) | this / OLD_TREE |")
    print("|---|---:|---|---|---|---:|")
    for shape, bs, mode in keys:
        mine, old = figures[("this", shape, bs, mode)], figures.get(("old", shape, bs, mode))
        ratio = f"{statistics.median(mine) / statistics.median(old):.3f}" if old else "-"
        fmt = lambda ms: " / ".join(f"{m:.3f}" for m in ms) if ms else "-"
        print(f"| {shape} | {bs} | {mode} | {fmt(mine)} | {fmt(old)} | {ratio} |")
EOF
