"""cuBLAS's first calls of a start-up's capture shapes: on the main thread, after a helper thread made them, and beside it.

    graphrunner bench cublas_first [--shape qwen3-0.6b] [--rounds 2] [--out DIR]

Why: the start-up's cuBLAS warm-up (runner/gemm_warm_up.py) rests on two facts, measured here on
the GPU at hand. (1) What cuBLAS learns at the first call of a shape (its heuristic, the kernel
it loads) serves every thread of the process: after the helper's first calls, the main thread's
calls cost what repeats cost. (2) The helper's calls leave the main thread's work alone (torch
releases the GIL inside each op): a loop of small torch ops takes as long beside the helper as
alone.

Each case runs in a fresh process (cuBLAS keeps its state per process), `--rounds` times:
- main: the main thread calls every (projection, capture size) GEMM once, then again;
- helper: `GemmWarmUp` makes the first calls on its thread (start, wait); then the main thread
  calls them all;
- beside: 3000 small elementwise ops on the main thread, alone, then while the helper runs.
The GEMMs: the shape's projections with dummy weights (`gemm_signatures`, bf16) at the default
capture sizes that take cuBLAS (not the one-row GEMV), each call followed by a synchronisation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from runner.benchmarks.results import add_out_argument, write_json

CASES = ("main", "helper", "beside")


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(shape: str, folder: str, device):
    """A GemmWarmUp (not started) for the shape's projections at the default capture sizes."""
    import torch
    from models import load_hf_config, model_spec
    from models.loader import build_model
    from runner.benchmarks.model_shapes import write_config
    from runner.cudagraph import default_capture_sizes
    from runner.gemm_warm_up import GemmWarmUp, gemm_signatures
    path = write_config(shape, folder)
    model = build_model(model_spec(load_hf_config(path)), path, device=device, dtype=torch.bfloat16,
                        load_format="dummy")
    return GemmWarmUp(gemm_signatures(model), default_capture_sizes(), device)


def _main_pass(calls) -> float:
    """Seconds of the main thread's F.linear of every call (each synchronised)."""
    import torch
    import torch.nn.functional as F
    inputs = {(m, w.shape[1]): torch.zeros(m, w.shape[1], dtype=w.dtype, device=w.device) for w, _, m in calls}
    device = calls[0][0].device
    _sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for weight, bias, rows in calls:
            F.linear(inputs[rows, weight.shape[1]], weight, bias)
            _sync(device)
    return time.perf_counter() - started


def _small_ops(device, count: int = 3000) -> float:
    import torch
    a = torch.zeros(64, 64, device=device)
    _sync(device)
    started = time.perf_counter()
    for _ in range(count):
        a = a * 1.0001 + 0.1
    _sync(device)
    return time.perf_counter() - started


def run_case(case: str, shape: str, device=None) -> dict:
    """One case in this process (a fresh one: `main` runs each case in a subprocess), on the GPU
    (`device`: another, for tests of the benchmark itself)."""
    import torch
    device = device or torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="graphrunner-cublas-") as folder:
        warm = _warm_up(shape, folder, device)
        result = {"case": case, "calls": len(warm.calls)}
        if case == "main":
            result["first_s"], result["repeat_s"] = _main_pass(warm.calls), _main_pass(warm.calls)
        elif case == "helper":
            warm.start()
            warm.wait()
            result["helper_s"], result["after_helper_s"] = warm.seconds, _main_pass(warm.calls)
        else:
            _small_ops(device, 200)
            result["alone_s"] = _small_ops(device)
            warm.start()
            result["beside_s"] = _small_ops(device)
            warm.wait()
            result["helper_s"] = warm.seconds
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench cublas_first", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", help="model shape (runner/benchmarks/model_shapes.py)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case, each in a fresh process")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)   # one case, in this process
    add_out_argument(parser)
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("graphrunner bench cublas_first: no CUDA device, nothing to measure")
        return 0
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args.shape)))
        return 0
    rows = []
    for _ in range(args.rounds):
        for case in CASES:
            done = subprocess.run([sys.executable, "-m", "runner.benchmarks.cublas_first", "--case", case,
                                   "--shape", args.shape], capture_output=True, text=True, timeout=600)
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(line[len("RESULT "):]))
    print(f"{torch.cuda.get_device_name()}, {args.shape}, {rows[0]['calls']} GEMM shapes; ms")
    print("| case | main thread's first calls | their repeat | helper's first calls | main thread after the helper "
          "| small ops alone | small ops beside the helper |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [r.get(k) for k in ("first_s", "repeat_s", "helper_s", "after_helper_s", "alone_s", "beside_s")]
        print(f"| {r['case']} | " + " | ".join("-" if c is None else f"{1e3 * c:.1f}" for c in cells) + " |")
    write_json(args.out, "cublas_first.json", {"shape": args.shape, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
