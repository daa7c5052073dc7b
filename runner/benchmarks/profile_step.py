"""Where one decode step's GPU time goes: the kernels of a replayed step, from the profiler.

    graphrunner bench profile_step [--shape smollm2-135m] [--mode FULL] [--batch-size 1] [--steps 10]
        [--prompt-len 128] [--top 25] [--host-profile] [--tensor-parallel-size 1]

Builds the engine (dummy bf16 weights of the shape, graphs captured for --batch-size only), lets
B requests reach decode, then records --steps decode steps with torch.profiler (CUDA activity:
kernels inside replayed graphs are listed one by one). Prints, per step: kernel launches, the sum
of kernel times (GPU busy), the GPU idle time in short gaps between kernels (launch gaps inside a
step: what a small model's replayed step is made of besides kernels), and the top kernels by time
with their count per step. --host-profile also runs the same steps under cProfile and prints the
host functions by own time per step (what PIECEWISE's eager attention and a step's Python cost).
With --tensor-parallel-size N the engine spawns ranks 1..N-1 and the kernels are rank 0's (its
all-reduces included: the push all-reduce's, or NCCL's with ParallelConfig.push_all_reduce_max_bytes 0).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from runner.benchmarks.model_shapes import SHAPES, write_config


GAP_US = 50
"""Gaps shorter than this count as launch gaps inside a step; longer ones are host work between steps."""


def host_profile(engine, steps: int, top: int) -> None:
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    print(f"host functions by own time (cProfile, {steps} steps; per-step figures)")
    print("| function | calls/step | own us/step | cumulative us/step |")
    print("|---|---:|---:|---:|")
    for (file, line, name), (_, calls, own, cumulative, _) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{Path(file).name}:{line}({name})"
        print(f"| {where[:80]} | {calls / steps:.0f} | {own / steps * 1e6:.1f} | {cumulative / steps * 1e6:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench profile_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--mode", default="FULL", type=str.upper)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    from configs import SamplingParams
    from runner import LLM
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as folder:
        path = write_config(args.shape, folder)
        llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", cudagraph_mode=args.mode,
                  cudagraph_capture_sizes=[args.batch_size], max_num_seqs=args.batch_size,
                  max_model_len=args.prompt_len + args.steps + 64, gpu_memory_utilization=0.3, seed=0,
                  tensor_parallel_size=args.tensor_parallel_size,
                  async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
        engine = llm.engine
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps + 32)
        for i in range(args.batch_size):
            engine.add_request([(7 * i + j) % engine.spec.vocab_size for j in range(args.prompt_len)], params)
        for _ in range(8):  # prefill, then a few decode steps so every graph and kernel is warm
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        if args.host_profile:
            host_profile(engine, args.steps, args.top)
        llm.shutdown()

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        print("the profiler saw no kernels")
        return 1
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    busy = sum(t for _, t in by_name.values())
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(ordered, ordered[1:])]
    small_gaps = sum(g for g in gaps if 0 < g < GAP_US)
    n = args.steps
    print(f"{args.shape} {args.mode} bs{args.batch_size}: {len(kernels) / n:.0f} kernels/step, "
          f"GPU busy {busy / n:.1f} us/step, idle gaps < {GAP_US} us between kernels {small_gaps / n:.1f} us/step")
    print("| kernel | per step | us/step | us each |")
    print("|---|---:|---:|---:|")
    for name, (count, total) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"| {name[:90]} | {count / n:.1f} | {total / n:.1f} | {total / count:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
