"""Host cost of eager kernel launches: attention, the fused per-layer kernels, a graph replay.

    graphrunner bench launch [--calls 300] [--out DIR]

PIECEWISE replays a graph segment per layer and launches attention eagerly between segments, so
its step time on a small model is bound by host microseconds per layer, not by the GPU; and a
start-up's graph captures run every layer's kernels once per graph from Python. This measures:
- `unified_attention` per call for the SmolLM2-135M decode shape at batch 1 and 32 (9 query / 3 KV
  heads, head_dim 64, context 160), through Triton's `JITFunction.run`
  (KernelConfig.fast_launch=False) and through launch/fast_launch.py;
- the fused `add_rms_norm` (64 x 1024 bf16, with a residual) and `silu_and_mul` (64 x 2 x 3072
  bf16) per call, whole Python entry points (their output allocations included), both ways;
- `torch.cuda.CUDAGraph.replay()` of a one-kernel graph;
- one cuBLAS GEMM (`F.linear`, 64 x 1024 by 6144 x 1024 bf16: Qwen3-0.6B's gate_up projection at 64
  tokens) eagerly and while a stream captures it into a graph, as a start-up's captures call it.
Host time = perf_counter over `--calls` back-to-back calls (no sync inside; the GPU work per call
is a few microseconds, so the launch queue never fills), median of 5 repeats, microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from runner.benchmarks.results import add_out_argument, write_json


def host_us(fn, calls: int, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def attention_case(batch_size: int, context: int = 160):
    from attention.kernels.unified_attention import unified_attention
    hq, hkv, d, block = 9, 3, 64, 16
    blocks_per_req = -(-context // block)
    dev = "cuda"
    query = torch.randn(batch_size, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    cache = torch.randn(2, batch_size * blocks_per_req + 1, block, hkv, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(batch_size + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch_size,), context, dtype=torch.int32, device=dev)
    table = torch.arange(batch_size * blocks_per_req, dtype=torch.int32, device=dev).view(batch_size, -1)

    def call():
        unified_attention(query, cache, out, qsl, seq_lens, table, d ** -0.5, max_seq_len=context)
    return call


def fused_cases() -> dict:
    """The fused per-layer kernels' entry points, as a layer calls them (launch_kernel)."""
    from models import fused_kernels
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(64, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    return {"add_rms_norm 64x1024": lambda: fused_kernels.add_rms_norm(x, weight, 1e-6, residual),
            "silu_and_mul 64x3072": lambda: fused_kernels.silu_and_mul(gate_up)}


def graph_replay_case():
    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return graph.replay


def linear_case():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(6144, 1024, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.nn.functional.linear(x, weight)


def captured_host_us(fn, calls: int, repeats: int = 5) -> float:
    """Host microseconds per `fn()` while a stream captures `calls` of them into one graph, median
    of `repeats` graphs (each dropped after its capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # the first call on the capture stream sets up its cuBLAS workspace
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls * 1e6)
        del graph
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and return the figures (also written to DIR/launch.json with --out)."""
    parser = argparse.ArgumentParser(prog="graphrunner bench launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graphrunner bench launch: no CUDA device, nothing to measure")
        return {}
    from configs import using_kernel_config
    rows = {}
    for batch_size in (1, 32):
        call = attention_case(batch_size)
        for fast in ("0", "1"):
            with using_kernel_config(fast_launch=fast == "1"):
                name = f"unified_attention bs{batch_size} ({'fast launch' if fast == '1' else 'JITFunction.run'})"
                rows[name] = host_us(call, args.calls)
    for label, call in fused_cases().items():
        for fast in (False, True):
            with using_kernel_config(fast_launch=fast):
                rows[f"{label} ({'fast launch' if fast else 'JITFunction.run'})"] = host_us(call, args.calls)
    rows["CUDAGraph.replay (1 kernel)"] = host_us(graph_replay_case(), args.calls)
    rows["F.linear 64x1024 by 6144x1024 (eager)"] = host_us(linear_case(), args.calls)
    rows["F.linear 64x1024 by 6144x1024 (while capturing)"] = captured_host_us(linear_case(), args.calls)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| host work | us per call |\n|---|---:|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    write_json(args.out, "launch.json", rows)
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
