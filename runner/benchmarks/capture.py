"""Capture time and graph memory with the DEFAULT capture sizes, per graph mode.

    graphrunner bench capture [--shape smollm2-135m] [--modes FULL_AND_PIECEWISE PIECEWISE FULL]
        [--gpu-memory-utilization 0.5] [--cold] [--serve N] [--out DIR]

Builds the engine as a user would (the default capture sizes of
runner/cudagraph/dispatcher.default_capture_sizes, default max_num_seqs 256), with dummy bf16
weights of the shape, and prints per mode: graphs captured,
seconds spent queuing the start-up's kernel compiles (`ModelRunner.kernels_compiled_ahead`: the
compiles then run on threads during the profile run, reserve measurement and capture;
GRAPHRUNNER_COMPILE_THREADS=0 compiles each kernel at its first launch instead) and waiting for
the last of them after the capture, capture seconds, graph memory actually taken (growth of reserved memory during capture) and the
estimate the KV budget subtracted (the largest graph of each runtime mode captured once into a
throwaway pool), with their ratio; also the growth after the first graph alone and the device-wide
growth (driver allocations included).

--cold points the kernel caches (KernelConfig.cache_dir: Triton's and the native builds') at an empty folder first, as on a fresh machine: the first mode's
start-up and capture then include compiling every kernel (later modes reuse them, as a second
engine in one process would). --serve N runs N requests (prompts of 100-1000 random tokens, 64
new tokens each, ignore_eos) through each engine after start-up and reports the peak memory
reserved against the gpu_memory_utilization budget: the no-OOM check at high utilization.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import sys
import tempfile
import time

import torch

from runner.benchmarks.model_shapes import SHAPES, write_config
from runner.benchmarks.results import add_out_argument, write_json


def serve(llm, num_requests: int, utilization: float) -> dict:
    """Serve a mixed workload after start-up; an OOM is reported, not raised (the table says so)."""
    from configs import SamplingParams
    rng = random.Random(0)
    vocab = llm.engine.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1000))] for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    torch.cuda.reset_peak_memory_stats()
    started, oom, tokens = time.perf_counter(), False, 0
    try:
        tokens = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    except torch.OutOfMemoryError as error:
        oom = f"OOM: {str(error).splitlines()[0]}"
    total = torch.cuda.mem_get_info()[1]
    return {"served": num_requests, "output_tokens": tokens, "serve_s": round(time.perf_counter() - started, 1),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "budget_gib": round(utilization * total / 2**30, 2), "oom": oom or "no"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench capture", description=__doc__)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"], type=str.upper)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--cold", action="store_true", help="empty Triton cache (first mode compiles everything)")
    parser.add_argument("--serve", type=int, default=0, help="requests to serve after start-up (0: none)")
    parser.add_argument("--profile", type=int, default=0,
                        help="print the N functions of the first start-up with the most cumulative time (cProfile)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graphrunner bench capture needs a CUDA GPU (torch sees none)")
    # --cold: every compiled-kernel cache (Triton's, the native builds') in an empty folder
    cache = {"cache_dir": tempfile.mkdtemp(prefix="graphrunner-cold-")} if args.cold else {}
    from runner import LLM
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = write_config(args.shape, folder)
        for index, mode in enumerate(args.modes):
            started = time.perf_counter()
            profiler = cProfile.Profile() if args.profile and index == 0 else None
            if profiler is not None:
                profiler.enable()
            llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", cudagraph_mode=mode,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048, **cache)
            if profiler is not None:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
            runner = llm.engine.model_runner
            summary = runner.capture_summary
            estimate = runner.graph_reserve_bytes
            rows.append({"shape": args.shape, "mode": mode, "graphs": summary.num_graphs,
                         "precompile_s": round(runner.precompile_seconds, 2),
                         "compile_wait_s": round(runner.compile_wait_seconds, 2),
                         "capture_s": round(summary.seconds, 2), "actual_mib": round(summary.pool_bytes / 2**20, 1),
                         "estimate_mib": round(estimate / 2**20, 1),
                         "estimate_over_actual": round(estimate / summary.pool_bytes, 3) if summary.pool_bytes else None,
                         "first_graph_mib": round(summary.first_graph_bytes / 2**20, 1),
                         "device_mib": round(summary.device_bytes / 2**20, 1),
                         "start_up_s": round(time.perf_counter() - started, 1),
                         "cold": args.cold and index == 0,   # later runs find the kernels compiled
                         "kv_blocks": runner.num_blocks})
            if args.serve:
                rows[-1].update(serve(llm, args.serve, args.gpu_memory_utilization))
            llm.shutdown()
            del llm, runner
            gc.collect()
            torch.cuda.empty_cache()
    write_json(args.out, "capture.json", rows)
    if args.serve:
        print("| mode | utilization | requests | output tokens | seconds | peak reserved GiB | budget GiB | OOM |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['mode']} | {args.gpu_memory_utilization} | {r['served']} | {r['output_tokens']} | "
                  f"{r['serve_s']} | {r['peak_reserved_gib']} | {r['budget_gib']} | {r['oom']} |")
    print("| shape | mode | graphs | compiles queued s | waited after s | capture s | cold | graph MiB (actual) | estimate MiB | estimate/actual | "
          "after 1st graph MiB | device MiB | start-up s |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} | {r['graphs']} | {r['precompile_s']} | {r['compile_wait_s']} | {r['capture_s']} | {r['cold']} | {r['actual_mib']} | "
              f"{r['estimate_mib']} | {r['estimate_over_actual']} | {r['first_graph_mib']} | {r['device_mib']} | "
              f"{r['start_up_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
