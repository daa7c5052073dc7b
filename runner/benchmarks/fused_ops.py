"""Device time of two per-step kernels that grow with the batch: RoPE + KV write, and the random draw.

    graphrunner bench fused_ops [--tokens 1 256 2048 8192] [--rows 1 32 256]
        [--heads 16 8 128] [--vocab 151936] [--out DIR]

- `rope_and_cache` (models/fused_kernels.py) on bf16 strided q/k/v views of one qkv projection
  (Qwen3-0.6B's 16 query / 8 KV heads of 128 by default), positions and cache slots at random,
  without and with Qwen3's q/k norms;
- `race` (runner/sampling/race_kernel.py): the draw at temperature alone over [rows, vocab] bf16
  logits (Qwen3's 151936 tokens by default).

On a GPU each figure is `triton.testing.do_bench`'s median (microseconds) after one untimed call
that compiles. On a CPU (Triton's interpreter: TRITON_INTERPRET=1) each case runs once, timed: a
smoke run of the same code, not a figure. To compare with another commit, run this file in a
checkout of it: `cd CHECKOUT && PYTHONPATH=$PWD python -P THIS_TREE/runner/benchmarks/fused_ops.py`
(a tree whose rope_and_cache has no q/k norms reports the row without them only).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import torch

from runner.benchmarks.results import add_out_argument, write_json


def _time_us(fn, on_gpu: bool) -> float:
    fn()   # compiles
    if on_gpu:
        import triton
        return 1000 * triton.testing.do_bench(fn, warmup=20, rep=200)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def rope_cases(tokens_list: list[int], heads: tuple[int, int, int], device: str, on_gpu: bool) -> list[dict]:
    from models import fused_kernels
    hq, hkv, dim = heads
    positions_max, block_size = 4096, 16
    slots_total = max(tokens_list) * 2
    cos_sin = torch.randn(positions_max, dim, device=device)
    cache = torch.zeros(2, -(-slots_total // block_size), block_size, hkv, dim, device=device, dtype=torch.bfloat16)
    weight = torch.ones(dim, device=device, dtype=torch.bfloat16)
    has_norms = "qk_norm" in inspect.signature(fused_kernels.rope_and_cache).parameters
    rows = []
    for tokens in tokens_list:
        qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, device=device, dtype=torch.bfloat16)
        q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        q, k, v = q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim)
        positions = torch.randint(0, positions_max, (tokens,), device=device)
        slots = torch.randperm(slots_total, device=device)[:tokens]
        row = {"tokens": tokens, "us": _time_us(
            lambda: fused_kernels.rope_and_cache(positions, q, k, v, cos_sin, cache, slots), on_gpu)}
        if has_norms:
            row["us_with_qk_norms"] = _time_us(lambda: fused_kernels.rope_and_cache(
                positions, q, k, v, cos_sin, cache, slots, (weight, weight, 1e-6)), on_gpu)
        rows.append(row)
    return rows


def race_cases(rows_list: list[int], vocab: int, device: str, on_gpu: bool) -> list[dict]:
    from runner.sampling.race_kernel import race
    results = []
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device=device).to(torch.bfloat16)
        temperature = torch.full((rows, 1), 0.6, device=device)
        results.append({"rows": rows, "us": _time_us(lambda: race(logits, temperature, None, 123), on_gpu)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench fused_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 2048, 8192],
                        help="token counts of the rope_and_cache calls")
    parser.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("Q", "KV", "DIM"),
                        help="query heads, KV heads, head_dim (default Qwen3-0.6B's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256], help="rows of the race calls")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary of the race calls (Qwen3's)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on a CPU the Triton kernels run only in the interpreter: set TRITON_INTERPRET=1")
    device = "cuda" if on_gpu else "cpu"
    name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter: a smoke run, not figures)"
    rope = rope_cases(args.tokens, tuple(args.heads), device, on_gpu)
    race_rows = race_cases(args.rows, args.vocab, device, on_gpu)
    hq, hkv, dim = args.heads
    print(f"{name}; rope_and_cache, {hq} q / {hkv} KV heads of {dim}, bf16:")
    for row in rope:
        norms = f", with q/k norms {row['us_with_qk_norms']:8.1f} us" if "us_with_qk_norms" in row else ""
        print(f"  {row['tokens']:6d} tokens: {row['us']:8.1f} us{norms}")
    print(f"race, temperature only, vocabulary {args.vocab}, bf16:")
    for row in race_rows:
        print(f"  {row['rows']:6d} rows: {row['us']:8.1f} us")
    write_json(args.out, "fused_ops.json", {"device": name, "heads": args.heads, "vocab": args.vocab,
                                            "rope_and_cache": rope, "race": race_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
