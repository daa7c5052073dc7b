#!/usr/bin/env bash
# The multi-GPU tensor-parallel tests run again and again, to check that the push all-reduce's
# rare start-up stall (docs/PARALLEL.md, "Push all-reduce": its cause, and the fix) no longer comes:
#   bash scripts/tp_soak.sh DIR [RUNS]          (RUNS default 5; gpu_suite.sh's tp-soak stage)
# Each run is `pytest -m multigpu tests/test_push_all_reduce.py tests/test_tensor_parallel.py` in a
# fresh process. TP_SOAK_ORDER picks what the runs are:
# - alternate (the default): odd runs start as cold as a first run on a fresh machine: empty kernel
#   caches (a fresh GRAPHRUNNER_CACHE_DIR, TRITON_CACHE_DIR and CUDA_CACHE_PATH) and no compiled
#   Python files (a fresh PYTHONPYCACHEPREFIX); even runs are warm: they take the folders the cold
#   run before them filled. Runs 1, 5, 9, ... start with the NCCL engines (the TP parity test with
#   NCCL all-reduces, then the push tests), runs 3, 7, ... with the push tests, as the files list
#   them, so that a failure of whichever TP engine meets the cold start first can be told from one
#   of the push all-reduce;
# - cold-push: every run cold, only the tests whose names do not mention NCCL (`-k "not nccl"`: the
#   push parity tests and the trap test of a peer that never pushes; the NCCL parity tests and the
#   push-against-NCCL sums are left out), the page cache dropped first where this user may (as
#   after a machine's start): two stalls in 88 runs of the kernel before its fix, about as often
#   as the three in about 85 alternating runs, in shorter runs; none in 24 runs of the fixed
#   kernel.
# TP_SOAK_PAIRS=N runs N soaks side by side, one on each pair of GPUs (the first two of
# CUDA_VISIBLE_DEVICES, or of 0..2N-1, then the next two, ...), each into DIR/pairP with its lines
# prefixed "pair P (GPUs a,b)": a 4-GPU machine soaks twice as many runs in the same time.
# pytest's PYTEST_ADDOPTS narrows the runs further, e.g. `--deselect
# 'tests/test_tensor_parallel.py::test_multigpu_tp2_matches_tp1_in_graph_modes[push-FULL_AND_PIECEWISE]'`.
# TP_SOAK_TRACE=1 (the default) traces every process of a run (scripts/push_trace/sitecustomize.py:
# DIR/runK-trace-PID.txt, each push call, collective, graph and start-up phase, and a snapshot of
# the push kernels' counters and slots when a synchronize stalls); TP_SOAK_PEER_TIMEOUT_S shortens
# the push kernels' peer timeout (120 s, the TP group's), so a stalled run traps and goes on.
# Every run's output is kept in DIR/runK.log. From STALL_S seconds into a run (default 60; a run
# takes 60-160 s on two H100s or H200s) the GPUs' load, the processes holding them and the stacks of
# every python3 process, native frames included, are dumped every 20 s with py-spy, where it is
# installed, each time into one file beside the log (DIR/runK-stacks-tSECONDS.txt; a flat folder of
# a few files is easy to copy off the machine whole): a push call stuck for the TP group's timeout
# (120 s) traps, so a stall is dumped before that whenever it began. A run past RUN_S seconds
# (default 330) is killed and the soak stops there. Prints one line per run: the pytest summary and
# the seconds it took, then any timeout record the push kernels left (models/push_all_reduce.py: the
# runs turn it on, GRAPHRUNNER_PUSH_ALL_REDUCE_TIMEOUT_RECORD=1), each also appended to
# DIR/summary.txt as the run ends (gpu_suite.sh shows a stage's output only when the stage ends, so
# an outer time limit that cuts the soak short would otherwise lose every run's line).
# Exits 1 if a run failed or was killed.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")   # the pairs' soaks run it again from the root
cd "$(dirname "$SELF")/.."
DIR=${1:?usage: bash scripts/tp_soak.sh DIR [RUNS]}
RUNS=${2:-5}
STALL_S=${STALL_S:-60}
RUN_S=${RUN_S:-330}
ORDER=${TP_SOAK_ORDER:-alternate}
TRACE=${TP_SOAK_TRACE:-1}
[[ $ORDER == alternate || $ORDER == cold-push ]] || { echo "TP_SOAK_ORDER: alternate or cold-push, not '$ORDER'" >&2; exit 2; }
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)   # absolute: the runs' processes write their traces there from anywhere
PAIRS=${TP_SOAK_PAIRS:-1}
if ((PAIRS > 1)); then   # one soak per GPU pair, side by side; fails if any failed
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
  else gpus=($(seq 0 $((2 * PAIRS - 1)))); fi
  ((${#gpus[@]} >= 2 * PAIRS)) || { echo "TP_SOAK_PAIRS=$PAIRS needs $((2 * PAIRS)) GPUs, not ${gpus[*]}" >&2; exit 2; }
  pids=()
  for ((pair = 0; pair < PAIRS; pair++)); do
    devices=${gpus[2 * pair]},${gpus[2 * pair + 1]}
    (TP_SOAK_PAIRS=1 CUDA_VISIBLE_DEVICES=$devices bash "$SELF" "$DIR/pair$pair" "$RUNS" \
      | sed -u "s/^/pair $pair (GPUs $devices): /") &   # the pipeline's status (pipefail): the soak's
    pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  exit $failed
fi
SPY=$(command -v py-spy || true)
[[ -n $SPY ]] || echo "py-spy not found: a stalled run is killed without its stacks"

report() {  # ... | report: the lines printed, and appended to DIR/summary.txt at once
  tee -a "$DIR/summary.txt"
}

dump_stacks() {  # dump_stacks FILE: the GPUs' load and the processes holding them, then every python3
  # process's stacks (native frames too)
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader > "$1" 2>&1
  nvidia-smi --query-compute-apps=gpu_bus_id,pid,used_memory --format=csv,noheader >> "$1" 2>&1
  [[ -n $SPY ]] || return 0
  local pid
  for pid in $(pgrep -f python3); do
    echo "=== pid $pid: $(ps -o args= -p "$pid" | cut -c1-200)" >> "$1"
    timeout 20 "$SPY" dump --native --pid "$pid" >> "$1" 2>&1 \
      || timeout 10 "$SPY" dump --pid "$pid" >> "$1" 2>&1
  done
}

PARITY=tests/test_tensor_parallel.py::test_multigpu_tp2_matches_tp1_in_graph_modes
PUSH_FIRST=(tests/test_push_all_reduce.py tests/test_tensor_parallel.py)
NCCL_FIRST=("$PARITY[nccl-FULL]" "$PARITY[nccl-FULL_AND_PIECEWISE]" tests/test_push_all_reduce.py
            "$PARITY[push-FULL]" "$PARITY[push-FULL_AND_PIECEWISE]")   # pytest runs node ids in this order

failed=0
folders=""   # the cache folders of the last cold run, which the warm run after it takes
trap '[[ -z $folders ]] || rm -rf "$folders"' EXIT
for ((run = 1; run <= RUNS; run++)); do
  kind=warm
  if ((run % 2)) || [[ $ORDER == cold-push ]]; then
    [[ -z $folders ]] || rm -rf "$folders"
    folders=$(mktemp -d)
    kind=empty
  fi
  caches=(GRAPHRUNNER_CACHE_DIR="$folders" TRITON_CACHE_DIR="$folders/triton" CUDA_CACHE_PATH="$folders/nv"
          PYTHONPYCACHEPREFIX="$folders/pycache")
  tests=("${PUSH_FIRST[@]}")
  order="push first"
  if [[ $ORDER == cold-push ]]; then
    tests=(-k "not nccl" "${PUSH_FIRST[@]}")
    order="push only"
    sync; echo 3 2>/dev/null > /proc/sys/vm/drop_caches && order+=", page cache dropped"
  elif ((run % 4 == 1)); then
    tests=("${NCCL_FIRST[@]}")
    order="NCCL first"
  fi
  traced=()
  if ((TRACE)); then
    traced=(PYTHONPATH="$PWD/scripts/push_trace${PYTHONPATH:+:$PYTHONPATH}" PUSH_TRACE_PREFIX="$DIR/run$run-trace")
    [[ -z ${TP_SOAK_PEER_TIMEOUT_S:-} ]] || traced+=(PUSH_TRACE_TIMEOUT_S="$TP_SOAK_PEER_TIMEOUT_S")
  fi
  start=$SECONDS
  env "${caches[@]}" "${traced[@]}" GRAPHRUNNER_PUSH_ALL_REDUCE_TIMEOUT_RECORD=1 \
    python3 -m pytest -v -p no:cacheprovider -m multigpu -rA --durations=0 \
    "${tests[@]}" > "$DIR/run$run.log" 2>&1 &
  pid=$!
  next_dump=$STALL_S
  while kill -0 "$pid" 2>/dev/null && ((SECONDS - start < RUN_S)); do
    sleep 2
    if ((SECONDS - start >= next_dump)); then
      dump_stacks "$DIR/run$run-stacks-t$((SECONDS - start)).txt"
      next_dump=$((next_dump + 20))
    fi
  done
  if kill -0 "$pid" 2>/dev/null; then
    dump_stacks "$DIR/run$run-stacks-killed.txt"
    pkill -9 -P "$pid"; kill -9 "$pid"
    echo "run $run ($kind caches, $order): killed after $RUN_S s; stacks in $DIR/run$run-stacks-*.txt" | report
    exit 1
  fi
  wait "$pid"
  rc=$?
  ((rc == 0)) || failed=1
  echo "run $run ($kind caches, $order): $(grep -E '^=+ .* in [0-9.]+s' "$DIR/run$run.log" | tail -1 | tr -d '=' | xargs) [$((SECONDS - start)) s, rc $rc]" | report
  grep -o 'push all-reduce timeout: .*' "$DIR/run$run.log" | sort | uniq -c | head -20 | report
done
exit $failed
