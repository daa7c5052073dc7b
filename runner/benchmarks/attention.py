"""Decode attention bandwidth of the Triton unified kernel vs a device-to-device copy, same run.

    graphrunner bench attention [--context 4096] [--batch-sizes 1 8 32] [--out DIR]

Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16, block size 16, blocks
scattered through the cache as a long-running server leaves them. Decode attention is a stream
over the KV cache, so its roofline is memory bandwidth: we report K+V bytes read / kernel time as
a percentage of what a large `copy_` achieves (bytes read + written / time). The attention call is
captured in a CUDA graph (as the engine runs it) and its replays timed by `triton.testing.do_bench`
(median), which flushes L2 before every call: bs 1 at 4096 tokens, 16.8 MB of KV, would otherwise
sit in the H100's 50 MB L2, and eager launches of a few-microsecond kernel would time the Python
launch instead. The split-KV merge kernel is included in the time.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.testing

from attention.kernels.unified_attention import default_num_splits, unified_attention
from runner.benchmarks.decode import copy_bandwidth
from runner.benchmarks.results import add_out_argument, write_json

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16


def decode_case(batch_size: int, context: int, dtype=torch.bfloat16):
    """Tensors for one decode step: every request has `context` cached tokens plus the new one."""
    seq_len = context + 1
    blocks_per_req = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch_size * blocks_per_req
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, HKV, D, device="cuda").to(dtype)
    block_table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch_size, blocks_per_req)
    query = torch.randn(batch_size, HQ, D, device="cuda").to(dtype)
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch_size,), seq_len, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch_size * seq_len * HKV * D * kv_cache.element_size()
    return (query, kv_cache, torch.empty_like(query), query_start_loc, seq_lens, block_table), kv_bytes


def time_graph_ms(fn) -> float:
    """Median ms of replaying `fn` captured in a CUDA graph (compiled and warmed up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graphrunner bench attention needs a CUDA GPU (torch sees none)")

    device = torch.device("cuda")
    copy_bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    rows = []
    for batch_size in args.batch_sizes:
        tensors, kv_bytes = decode_case(batch_size, args.context)
        default = default_num_splits(batch_size, batch_size, HKV, device)
        for splits in sorted(set(args.splits) | {default}):
            ms = time_graph_ms(lambda: unified_attention(*tensors, scale=D ** -0.5, num_splits=splits))
            bw = kv_bytes / (ms * 1e-3)
            rows.append(dict(batch_size=batch_size, context=args.context, num_splits=splits,
                             default=splits == default, time_us=ms * 1e3, kv_mb=kv_bytes / 1e6,
                             kv_gb_per_s=bw / 1e9, pct_of_copy=100 * bw / copy_bw))
            print(f"bs {batch_size:3d} splits {splits:2d}{' (default)' if splits == default else '          '} "
                  f"{ms * 1e3:8.1f} us  {bw / 1e9:7.0f} GB/s  {100 * bw / copy_bw:5.1f}% of copy", flush=True)

    print("\n| batch | context | KV splits | time (us) | KV read (MB) | KV GB/s | % of copy BW |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        splits = f"{r['num_splits']}{' (default)' if r['default'] else ''}"
        print(f"| {r['batch_size']} | {r['context']} | {splits} | {r['time_us']:.1f} | {r['kv_mb']:.1f} | "
              f"{r['kv_gb_per_s']:.0f} | {r['pct_of_copy']:.1f} |")
    write_json(args.out, "attention.json", dict(device=torch.cuda.get_device_name(), copy_gb_per_s=copy_bw / 1e9,
                                                heads=[HQ, HKV, D], dtype="bfloat16", block_size=BLOCK_SIZE,
                                                rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
