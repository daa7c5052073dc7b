"""Decode-size projections: the unfused kernels (cuBLAS + norm / SiLU kernels) vs models/small_batch_kernels.py.

    graphrunner bench linear [--shapes smollm2-135m llama-3.2-1b llama-3-8b] [--rows 1 2 4 8 16 32]
                         [--dtype bfloat16] [--out DIR]
    graphrunner bench linear --device cpu --shapes tiny --rows 1 3 --repeats 2   # smoke (TRITON_INTERPRET=1)

Per model shape (runner/benchmarks/model_shapes.py) and row count M, one decoder layer's four projections:

    qkv      unfused: add_rms_norm + F.linear                   fused: norm_linear
    o        unfused: F.linear                                  fused: linear (Triton GEMV)
    gate_up  unfused: add_rms_norm + F.linear + silu_and_mul    fused: norm_gate_up_silu
    down     unfused: F.linear                                  fused: linear (Triton GEMV)

and `layer`, their sum. For one row (M = 1) a separate `qkv+rope` row times the decode step's
norm + qkv + RoPE + KV-cache write (not part of `layer`, and reported under the JSON's `rope_rows`):

    qkv+rope unfused: norm_linear + rope_and_cache             fused: norm_qkv_rope_cache

Each variant is captured `--repeats` (50) times into one CUDA graph, as
it runs inside a FULL-graph decode step, and the graph's replays are timed with CUDA events (the
median of `--replays`); the figure is microseconds per call. Each captured call reads its own copy
of the weights (up to `--repeats` copies, about COLD_BYTES in all), so weights come from HBM as in
a real step, where a model's layers do not fit in L2; `--hot` uses one copy (L2-resident for small
shapes). The ratio is unfused / fused: above 1, the fused kernels win.

On a CPU (`--device cpu`, Triton's interpreter) the same code runs without graphs, timed by the
host clock: a smoke test of the code (tests/test_benchmarks.py), not a measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from runner.benchmarks.model_shapes import SHAPES
from runner.benchmarks.results import add_out_argument, write_json

COLD_BYTES = 256 << 20
"""Weight bytes the captured calls of one variant read in all (> 5x an H100's 50 MB L2)."""

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            rms_norm_eps=1e-5)
"""--shapes tiny: a shape small enough for Triton's interpreter (the CPU smoke test)."""

PROJECTIONS = ("qkv", "o", "gate_up", "down")
EPS = 1e-5


def shape_dims(name: str) -> dict[str, int]:
    c = TINY if name == "tiny" else SHAPES[name]
    hidden = c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return dict(hidden=hidden, q=q, kv=kv, intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                kv_heads=c["num_key_value_heads"], head_dim=head_dim)


ROPE_CACHE_BLOCKS, ROPE_CACHE_BLOCK_SIZE = 64, 16
"""The paged KV cache the qkv+rope row writes into (one slot per call)."""


def qkv_rope_calls(dims: dict[str, int], dtype: torch.dtype, device: torch.device, copies: int | None,
                   repeats: int):
    """(unfused(i), fused(i), weight bytes) for one row's norm + qkv + RoPE + KV write: norm_linear then
    fused_kernels.rope_and_cache, against small_batch_kernels.norm_qkv_rope_cache."""
    from models import fused_kernels, small_batch_kernels as sbk

    hidden, hq, hkv, dim = dims["hidden"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    n = dims["q"] + 2 * dims["kv"]
    weight_bytes = n * hidden * torch.empty((), dtype=dtype).element_size()
    if copies is None:
        copies = min(repeats, max(1, math.ceil(COLD_BYTES / weight_bytes)))
    torch.manual_seed(0)
    weights = [torch.randn(n, hidden, device=device, dtype=dtype) / math.sqrt(hidden) for _ in range(copies)]
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    residual = torch.randn(1, hidden, device=device, dtype=dtype)
    norm_w = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    positions = torch.tensor([100], device=device)
    slots = torch.tensor([37], device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(1024, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    cache = torch.zeros(2, ROPE_CACHE_BLOCKS, ROPE_CACHE_BLOCK_SIZE, hkv, dim, device=device, dtype=dtype)

    def unfused(i):
        qkv, r = sbk.norm_linear(x, residual, norm_w, EPS, weights[i % copies])
        q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        return fused_kernels.rope_and_cache(positions, q.view(1, hq, dim), k.view(1, hkv, dim), v.view(1, hkv, dim),
                                            cos_sin, cache, slots), r

    def fused(i):
        return sbk.norm_qkv_rope_cache(x, residual, norm_w, EPS, weights[i % copies], None, positions, cos_sin,
                                       cache, slots, hq, hkv, dim)
    return unfused, fused, weight_bytes


def projection_calls(proj: str, dims: dict[str, int], rows: int, dtype: torch.dtype, device: torch.device,
                     copies: int | None, repeats: int):
    """(unfused(i), fused(i), weight bytes): call i reads weight copy i % copies."""
    from models import fused_kernels, small_batch_kernels as sbk

    hidden, inter = dims["hidden"], dims["intermediate"]
    k, n = {"qkv": (hidden, dims["q"] + 2 * dims["kv"]), "o": (dims["q"], hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}[proj]
    weight_bytes = n * k * torch.empty((), dtype=dtype).element_size()
    if copies is None:
        copies = min(repeats, max(1, math.ceil(COLD_BYTES / weight_bytes)))
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=device, dtype=dtype) / math.sqrt(k) for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=dtype)
    residual = torch.randn(rows, k, device=device, dtype=dtype)
    norm_w = torch.rand(k, device=device, dtype=dtype) + 0.5

    if proj in ("o", "down"):
        return (lambda i: F.linear(x, weights[i % copies]),
                lambda i: sbk.linear(x, weights[i % copies]), weight_bytes)
    if proj == "qkv":
        def unfused(i):
            h, r = fused_kernels.add_rms_norm(x, norm_w, EPS, residual)
            return F.linear(h, weights[i % copies]), r
        return unfused, lambda i: sbk.norm_linear(x, residual, norm_w, EPS, weights[i % copies]), weight_bytes

    def unfused_mlp(i):
        h, r = fused_kernels.add_rms_norm(x, norm_w, EPS, residual)
        return fused_kernels.silu_and_mul(F.linear(h, weights[i % copies])), r
    return unfused_mlp, lambda i: sbk.norm_gate_up_silu(x, residual, norm_w, EPS, weights[i % copies]), weight_bytes


def unavailable(device: torch.device, script: str) -> dict | None:
    """Why `script` cannot run on `device` (printed, and returned as its result), or None: a CUDA
    run needs a GPU; a CPU run needs Triton's interpreter (TRITON_INTERPRET=1), a smoke test only."""
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{script}: no CUDA device (use --device cpu with TRITON_INTERPRET=1 for a smoke run)")
        return {"skipped": "no CUDA device"}
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(f"{script}: --device cpu runs the Triton kernels in the interpreter; set TRITON_INTERPRET=1")
        return {"skipped": "TRITON_INTERPRET is not 1"}
    return None


def time_us_per_call(fn, repeats: int, replays: int, device: torch.device) -> float:
    """Median microseconds per call of `fn(0..repeats-1)`: captured into one CUDA graph and replayed
    (`replays` timed replays) on a GPU; called directly and timed by the host clock on a CPU."""
    for i in range(min(repeats, 2)):   # compile (Triton) and warm cuBLAS outside the capture
        fn(i)
    if device.type != "cuda":
        times = []
        for _ in range(replays):
            start = time.perf_counter()
            for i in range(repeats):
                fn(i)
            times.append((time.perf_counter() - start) / repeats * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            fn(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    del graph
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and return the figures (also written to DIR/linear.json with --out)."""
    parser = argparse.ArgumentParser(prog="graphrunner bench linear", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.2-1b", "llama-3-8b"],
                        choices=sorted(SHAPES) + ["tiny"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=50, help="calls captured into one graph")
    parser.add_argument("--replays", type=int, default=20, help="timed replays (the median is reported)")
    parser.add_argument("--hot", action="store_true", help="one weight copy for all calls (L2-resident)")
    add_out_argument(parser)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    skipped = unavailable(device, "graphrunner bench linear")
    if skipped:
        return skipped
    from models.small_batch_kernels import MAX_ROWS
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{name}: {args.dtype}, {args.repeats} calls per graph, median of {args.replays} replays, "
          f"{'hot (one weight copy)' if args.hot else 'cold weights'}", flush=True)

    rows_out = []
    rope_rows = []   # qkv+rope at M = 1: kept apart from the four projections and their `layer` sum
    for shape in args.shapes:
        dims = shape_dims(shape)
        for m in args.rows:
            if not 0 < m <= MAX_ROWS:
                print(f"skipping M={m}: the kernels take 1..{MAX_ROWS} rows")
                continue
            layer = dict(unfused_us=0.0, fused_us=0.0)
            for proj in PROJECTIONS:
                copies = 1 if args.hot else None
                unfused, fused, weight_bytes = projection_calls(proj, dims, m, dtype, device, copies, args.repeats)
                t_unfused = time_us_per_call(unfused, args.repeats, args.replays, device)
                t_fused = time_us_per_call(fused, args.repeats, args.replays, device)
                del unfused, fused
                row = dict(shape=shape, projection=proj, rows=m, weight_mb=weight_bytes / 1e6,
                           unfused_us=t_unfused, fused_us=t_fused, ratio=t_unfused / t_fused)
                rows_out.append(row)
                layer["unfused_us"] += t_unfused
                layer["fused_us"] += t_fused
                print(f"{shape:>14} M={m:<3d} {proj:>8}: unfused {t_unfused:8.2f} us  fused {t_fused:8.2f} us  "
                      f"x{row['ratio']:.2f}", flush=True)
            rows_out.append(dict(shape=shape, projection="layer", rows=m, weight_mb=None, **layer,
                                 ratio=layer["unfused_us"] / layer["fused_us"]))
            if m == 1:
                unfused, fused, weight_bytes = qkv_rope_calls(dims, dtype, device, 1 if args.hot else None,
                                                              args.repeats)
                t_unfused = time_us_per_call(unfused, args.repeats, args.replays, device)
                t_fused = time_us_per_call(fused, args.repeats, args.replays, device)
                del unfused, fused
                rope_rows.append(dict(shape=shape, projection="qkv+rope", rows=m, weight_mb=weight_bytes / 1e6,
                                      unfused_us=t_unfused, fused_us=t_fused, ratio=t_unfused / t_fused))
                print(f"{shape:>14} M={m:<3d} qkv+rope: unfused {t_unfused:8.2f} us  fused {t_fused:8.2f} us  "
                      f"x{t_unfused / t_fused:.2f}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print("\n| shape | projection | M | unfused (us) | fused (us) | unfused / fused |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows_out + rope_rows:
        proj = f"**{r['projection']}**" if r["projection"] == "layer" else r["projection"]
        print(f"| {r['shape']} | {proj} | {r['rows']} | {r['unfused_us']:.2f} | {r['fused_us']:.2f} | "
              f"{r['ratio']:.2f} |")
    result = dict(device=name, dtype=args.dtype, repeats=args.repeats, replays=args.replays, hot=args.hot,
                  rows=rows_out, rope_rows=rope_rows)
    write_json(args.out, "linear.json", result)
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
