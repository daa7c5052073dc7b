"""Attention kernels alone: decode bandwidth against its floor, and long-prompt prefill throughput.

    graphrunner bench attention [--context-len 4096 ...] [--batch-sizes 1 8 32] [--splits 1 4 16 64]
        [--heads 32 8 128] [--prefill-len 8192 32768 ...] [--prefill-chunk 8192]
        [--prefill-configs 128,64,8,3 ...] [--out DIR]

Llama-3-8B attention by default (32 query heads, 8 KV heads, head_dim 128; `--heads 32 8 64` is
Llama-3.2-1B's), bf16, block size 16, blocks scattered through the cache as a long-running server
leaves them.

Decode: a stream over the KV cache, so its floor is the K+V bytes read once at the bandwidth of a
large `copy_` (bytes read + written / time), measured in the same run; each row prints the time,
the floor and x floor, per split count (the default marked). The call is captured in a CUDA graph
(as the engine runs it) and its replays timed by `triton.testing.do_bench` (median), which flushes
L2 before every call: bs 1 at 4096 tokens, 16.8 MB of KV, would otherwise sit in the H100's 50 MB
L2. The split merge is included in the time.

Prefill (`--prefill-len`): one prompt attended chunk by chunk (`--prefill-chunk` tokens a step,
each chunk over the prompt so far, as chunked prefill runs it), eager; prints ms, prompt tokens/s
and the TFLOP/s of the causal attention (4 * Hq * D flops per visible query-key pair).
`--prefill-configs BLOCK_M,BLOCK_N,num_warps,num_stages ...` times the prefill tiles under each.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.testing

from attention.kernels import unified_attention as ua
from attention.kernels.unified_attention import default_num_splits, unified_attention
from runner.benchmarks.decode import copy_bandwidth
from runner.benchmarks.results import add_out_argument, write_json

BLOCK_SIZE = 16


def decode_case(batch_size: int, context: int, heads: tuple[int, int, int], dtype=torch.bfloat16):
    """Tensors for one decode step: every request has `context` cached tokens plus the new one."""
    hq, hkv, d = heads
    seq_len = context + 1
    blocks_per_req = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch_size * blocks_per_req
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, d, device="cuda").to(dtype)
    block_table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch_size, blocks_per_req)
    query = torch.randn(batch_size, hq, d, device="cuda").to(dtype)
    query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch_size,), seq_len, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch_size * seq_len * hkv * d * kv_cache.element_size()
    return (query, kv_cache, torch.empty_like(query), query_start_loc, seq_lens, block_table), kv_bytes


def time_graph_ms(fn) -> float:
    """Median ms of replaying `fn` captured in a CUDA graph (compiled and warmed up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def prefill_ms(prompt_len: int, chunk: int, heads: tuple[int, int, int], dtype=torch.bfloat16) -> tuple[float, float]:
    """(median ms to attend a `prompt_len` prompt in chunks of `chunk`, causal flops)."""
    hq, hkv, d = heads
    blocks = -(-prompt_len // BLOCK_SIZE)
    kv_cache = torch.randn(2, blocks, BLOCK_SIZE, hkv, d, device="cuda").to(dtype)
    block_table = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, blocks)
    query = torch.randn(prompt_len, hq, d, device="cuda").to(dtype)
    out = torch.empty_like(query)
    steps = []
    for start in range(0, prompt_len, chunk):
        end = min(start + chunk, prompt_len)
        steps.append((query[start:end], out[start:end], torch.tensor([0, end - start], dtype=torch.int32, device="cuda"),
                      torch.tensor([end], dtype=torch.int32, device="cuda"), end - start, end))

    def run():
        for q, o, qsl, seq_lens, q_len, seq_len in steps:
            unified_attention(q, kv_cache, o, qsl, seq_lens, block_table, scale=d ** -0.5, max_seq_len=seq_len,
                              max_query_len=q_len)

    flops = 4 * hq * d * sum(q_len * (seq_len - q_len) + q_len * (q_len + 1) / 2
                             for _, _, _, _, q_len, seq_len in steps)
    return triton.testing.do_bench(run, return_mode="median"), flops


def set_prefill_config(text: str | None) -> dict:
    """Put BLOCK_M,BLOCK_N,num_warps,num_stages in force for the prefill tiles (None: the default)."""
    if text is not None:
        block_m, block_n, warps, stages = (int(x) for x in text.split(","))
        ua.PREFILL_CONFIG.update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    ua.launch_config.cache_clear()
    ua._constexprs.cache_clear()
    return dict(ua.PREFILL_CONFIG)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--context-len", "--context", dest="contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    parser.add_argument("--prefill-len", type=int, nargs="*", default=[])
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--prefill-configs", nargs="*", default=[None])
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graphrunner bench attention needs a CUDA GPU (torch sees none)")

    heads = tuple(args.heads)
    device = torch.device("cuda")
    copy_bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bw / 1e9:.0f} GB/s; heads {heads}")
    rows = []
    for context in args.contexts:
        for batch_size in args.batch_sizes:
            tensors, kv_bytes = decode_case(batch_size, context, heads)
            default = default_num_splits(batch_size, batch_size, heads[1], device)
            floor_ms = kv_bytes / copy_bw * 1e3
            for splits in sorted(set(args.splits) | {default}):
                ms = time_graph_ms(lambda: unified_attention(*tensors, scale=heads[2] ** -0.5, num_splits=splits))
                bw = kv_bytes / (ms * 1e-3)
                rows.append(dict(batch_size=batch_size, context=context, num_splits=splits,
                                 default=splits == default, time_us=ms * 1e3, kv_mb=kv_bytes / 1e6,
                                 kv_gb_per_s=bw / 1e9, pct_of_copy=100 * bw / copy_bw, floor_us=floor_ms * 1e3,
                                 x_floor=ms / floor_ms))
                print(f"ctx {context:6d} bs {batch_size:3d} splits {splits:2d}"
                      f"{' (default)' if splits == default else '          '} {ms * 1e3:8.1f} us  "
                      f"floor {floor_ms * 1e3:8.1f} us  x{ms / floor_ms:5.2f}  {bw / 1e9:6.0f} GB/s", flush=True)
            del tensors

    prefill = []
    for config in args.prefill_configs:
        tiles = set_prefill_config(config)
        for prompt_len in args.prefill_len:
            ms, flops = prefill_ms(prompt_len, args.prefill_chunk, heads)
            prefill.append(dict(prompt_len=prompt_len, chunk=args.prefill_chunk, config=tiles, ms=ms,
                                tok_s=prompt_len / ms * 1e3, tflop_s=flops / ms / 1e9))
            print(f"prefill {prompt_len:6d} (chunks of {args.prefill_chunk}) {tiles}: {ms:8.2f} ms  "
                  f"{prompt_len / ms * 1e3:9.0f} tok/s  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    set_prefill_config(None)

    print("\n| batch | context | KV splits | time (us) | floor (us) | x floor | KV GB/s | % of copy BW |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        splits = f"{r['num_splits']}{' (default)' if r['default'] else ''}"
        print(f"| {r['batch_size']} | {r['context']} | {splits} | {r['time_us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['x_floor']:.2f} | {r['kv_gb_per_s']:.0f} | {r['pct_of_copy']:.1f} |")
    if prefill:
        print("\n| prompt | chunk | tiles | ms | tokens/s | TFLOP/s |")
        print("|---:|---:|---|---:|---:|---:|")
        for p in prefill:
            print(f"| {p['prompt_len']} | {p['chunk']} | {p['config']} | {p['ms']:.2f} | {p['tok_s']:.0f} | "
                  f"{p['tflop_s']:.1f} |")
    write_json(args.out, "attention.json", dict(device=torch.cuda.get_device_name(), copy_gb_per_s=copy_bw / 1e9,
                                                heads=list(heads), dtype="bfloat16", block_size=BLOCK_SIZE,
                                                rows=rows, prefill=prefill))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
