"""Capture time and graph memory with the DEFAULT capture sizes, per graph mode.

    python scripts/bench_capture.py [--shape smollm2-135m] [--modes FULL_AND_PIECEWISE PIECEWISE FULL]

Builds the engine as a user would (default capture sizes 1, 2, 4, 8, 16, 24, ... 512, default
max_num_seqs 256), with dummy bf16 weights of the shape, and prints per mode: graphs captured,
capture seconds, graph memory actually taken (growth of reserved memory during capture) and the
estimate the KV budget subtracted (the largest graph of each runtime mode captured once into a
throwaway pool), with their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from model_shapes import SHAPES, write_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"], type=str.upper)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from runner import LLM
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = write_config(args.shape, folder)
        for mode in args.modes:
            started = time.perf_counter()
            llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", cudagraph_mode=mode,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048)
            runner = llm.engine.model_runner
            summary = runner.capture_summary
            estimate = runner.graph_reserve_bytes
            rows.append({"shape": args.shape, "mode": mode, "graphs": summary.num_graphs,
                         "capture_s": round(summary.seconds, 2), "actual_mib": round(summary.pool_bytes / 2**20, 1),
                         "estimate_mib": round(estimate / 2**20, 1),
                         "estimate_over_actual": round(estimate / summary.pool_bytes, 3) if summary.pool_bytes else None,
                         "start_up_s": round(time.perf_counter() - started, 1),
                         "kv_blocks": runner.num_blocks})
            llm.shutdown()
            del llm, runner
            gc.collect()
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print("| shape | mode | graphs | capture s | graph MiB (actual) | estimate MiB | estimate/actual | start-up s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} | {r['graphs']} | {r['capture_s']} | {r['actual_mib']} | "
              f"{r['estimate_mib']} | {r['estimate_over_actual']} | {r['start_up_s']} |")


if __name__ == "__main__":
    main()
