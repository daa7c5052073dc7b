"""Does Triton compile kernels in parallel on threads here? (The premise of compile_ahead.)

    graphrunner bench compile_threads [--variants 8] [--threads 8] [--out DIR]

Compiles `--variants` distinct variants of the attention kernel (BLOCK_Q differs, half with
split KV) for this machine's GPU, first one after another, then as many other variants on a
thread pool, each on an empty Triton cache, and prints the seconds and the speedup. A speedup
near 1 means the compiler holds the GIL and threads cannot help.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from runner.benchmarks.results import add_out_argument, write_json


def compile_variant(index: int) -> float:
    import triton
    from triton.compiler import ASTSource

    from attention.kernels import unified_attention as ua
    fn = ua.attention_kernel
    constexprs = dict(GROUP=3, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=5 + index, BLOCK_N=64,
                      REQ_CHUNK=64, SPLIT_KV=bool(index % 2), DOT_FP32=False, FUSED_MERGE=True, MIN_SPLIT_TILES=1,
                      MAX_SPLITS=16, HAS_WINDOW=False, HAS_SOFT_CAP=False, PDL=False)
    int_pointers = {"qsl_ptr", "seq_lens_ptr", "block_table_ptr", "ticket_ptr"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in int_pointers else "*fp32" if name.startswith("part_") else "*bf16"
        elif name in ("scale_log2", "soft_cap_log2"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    target = triton.runtime.driver.active.get_current_target()
    started = time.perf_counter()
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                   options=dict(num_warps=4, num_stages=2))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench compile_threads", description=__doc__)
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--threads", type=int, default=8)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-threads-")
    import triton
    started = time.perf_counter()
    serial = [compile_variant(i) for i in range(args.variants)]
    serial_s = time.perf_counter() - started
    started = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        threaded = list(pool.map(compile_variant, range(args.variants, 2 * args.variants)))
    threaded_s = time.perf_counter() - started
    print(f"triton {triton.__version__}, {os.cpu_count()} CPUs: {args.variants} attention variants "
          f"one after another {serial_s:.2f} s (each {min(serial):.2f}-{max(serial):.2f} s), on "
          f"{args.threads} threads {threaded_s:.2f} s (each {min(threaded):.2f}-{max(threaded):.2f} s): "
          f"speedup {serial_s / threaded_s:.2f}x")
    write_json(args.out, "compile_threads.json", {
        "triton": triton.__version__, "cpus": os.cpu_count(), "variants": args.variants, "threads": args.threads,
        "serial_s": serial_s, "threaded_s": threaded_s, "serial_each_s": serial, "threaded_each_s": threaded})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
