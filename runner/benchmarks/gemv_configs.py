"""One decode row's GEMVs: tile configurations of the small-batch kernel against cuBLAS and the copy bandwidth.

    graphrunner bench gemv_configs [--shapes smollm2-135m llama-3.2-1b llama-3-8b] [--tensor-parallel-size 1]
        [--out DIR]
    graphrunner bench gemv_configs --device cpu --shapes tiny --configs 2   # smoke (TRITON_INTERPRET=1)

Why: at one row a decode step is a chain of GEMVs whose time is their weight bytes over HBM
bandwidth, and a guessed tile can lose to cuBLAS on a large weight (`graphrunner bench linear`
shows it per projection). This benchmark measures,
for every weight of a layer and the LM head, x [1, K] @ W[N, K].T through `small_batch_kernels.linear`
with each (BLOCK_N, BLOCK_K, num_warps, num_stages) of CONFIGS, next to F.linear (cuBLAS) and the
device-to-device copy bandwidth of the same run, and prints GB/s (weight bytes / time) for each:
the data that picks block_sizes' rule. Timing as bench_linear: calls captured into one CUDA graph,
each reading its own weight copy (cold, from HBM), median of the replays. --tensor-parallel-size N
times one rank's shards instead (models/parallel_state.py's split: q heads and MLP columns 1/N,
KV heads 1/N or one replicated, o_proj and down_proj inputs 1/N, the LM head's padded row block):
the half-size weights a TP=2 decode step streams, where a kernel's fixed costs weigh twice as much.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from runner.benchmarks.decode import copy_bandwidth
from runner.benchmarks.linear import COLD_BYTES, shape_dims, time_us_per_call, unavailable
from runner.benchmarks.model_shapes import SHAPES
from runner.benchmarks.results import add_out_argument, write_json

CONFIGS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (2, 1024, 4, 1), (4, 512, 4, 1), (4, 1024, 4, 1), (8, 256, 4, 1), (8, 512, 4, 1), (8, 512, 4, 3),
    (8, 1024, 8, 1), (16, 256, 4, 1), (16, 512, 4, 1), (16, 512, 4, 3), (16, 512, 8, 1), (32, 256, 4, 1),
    (32, 256, 8, 1), (32, 512, 8, 1), (64, 128, 4, 1), (4, 2048, 8, 1),
]


def weights_of(shape: str, tp_size: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of one layer's projections and the LM head, as one of `tp_size` ranks holds them."""
    from models.parallel_state import padded_vocab_size, shard_heads, shard_size
    d = shape_dims(shape)
    vocab = SHAPES[shape]["vocab_size"] if shape in SHAPES else 256
    heads = shard_heads(d["heads"], d["kv_heads"], tp_size, 0)
    q, kv = heads.num_heads * d["head_dim"], heads.num_kv_heads * d["head_dim"]
    intermediate = shard_size(d["intermediate"], tp_size, "intermediate_size")
    return {"qkv": (q + 2 * kv, d["hidden"]), "o": (d["hidden"], q),
            "gate_up": (2 * intermediate, d["hidden"]), "down": (d["hidden"], intermediate),
            "lm_head": (padded_vocab_size(vocab, tp_size) // tp_size, d["hidden"])}


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and return the figures (also written to DIR/gemv_configs.json with --out)."""
    parser = argparse.ArgumentParser(prog="graphrunner bench gemv_configs", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.2-1b", "llama-3-8b"],
                        choices=sorted(SHAPES) + ["tiny"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--configs", type=int, default=len(CONFIGS), help="the first N of CONFIGS")
    parser.add_argument("--repeats", type=int, default=50, help="calls captured into one graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="time one rank's shards of each weight")
    add_out_argument(parser)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    skipped = unavailable(device, "graphrunner bench gemv_configs")
    if skipped:
        return skipped
    from models import small_batch_kernels as sbk

    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    configs = CONFIGS[:args.configs]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    copy = copy_bandwidth(device) / 1e9 if device.type == "cuda" else float("nan")
    tp = args.tensor_parallel_size
    print(f"{name}: {args.dtype}, one row, copy bandwidth {copy:.0f} GB/s"
          + (f", one rank's shards at tensor_parallel_size {tp}" if tp > 1 else ""), flush=True)
    rows = []
    for shape in args.shapes:
        for proj, (n, k) in weights_of(shape, tp).items():
            nbytes = n * k * elem
            copies = min(args.repeats, max(1, math.ceil(COLD_BYTES / nbytes)))
            torch.manual_seed(0)
            weights = [torch.randn(n, k, device=device, dtype=dtype) / math.sqrt(k) for _ in range(copies)]
            x = torch.randn(1, k, device=device, dtype=dtype)
            repeats = min(args.repeats, max(4, copies))
            timings = {"cublas": time_us_per_call(lambda i: F.linear(x, weights[i % copies]), repeats,
                                                  args.replays, device),
                       "default": time_us_per_call(lambda i: sbk.linear(x, weights[i % copies]), repeats,
                                                   args.replays, device)}
            for cfg in configs:
                timings[cfg] = time_us_per_call(
                    lambda i, cfg=cfg: sbk._launch(x, None, None, 0.0, weights[i % copies], None, False, cfg)[0],
                    repeats, args.replays, device)
            best = min(configs, key=lambda c: timings[c])
            row = dict(shape=shape, projection=proj, n=n, k=k, weight_mb=nbytes / 1e6,
                       cublas_us=timings["cublas"], default_us=timings["default"], best_config=list(best),
                       best_us=timings[best], configs={"x".join(map(str, c)): timings[c] for c in configs})
            rows.append(row)
            gbps = {key: nbytes / (t * 1e-6) / 1e9 for key, t in (("cublas", timings["cublas"]),
                                                                  ("default", timings["default"]),
                                                                  ("best", timings[best]))}
            print(f"{shape:>14} {proj:>8} [{n}x{k}] {nbytes / 1e6:8.1f} MB: cublas {timings['cublas']:8.2f} us "
                  f"({gbps['cublas']:5.0f} GB/s)  default {timings['default']:8.2f} ({gbps['default']:5.0f})  "
                  f"best {timings[best]:8.2f} ({gbps['best']:5.0f}) {best}", flush=True)
            print("      " + "  ".join(f"{'x'.join(map(str, c))}:{timings[c]:.1f}" for c in configs), flush=True)
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = dict(device=name, dtype=args.dtype, copy_gbps=copy, tensor_parallel_size=tp, rows=rows)
    write_json(args.out, "gemv_configs.json", result)
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
