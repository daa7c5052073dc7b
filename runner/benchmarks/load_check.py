"""What the load-time NaN/Inf check of the weights costs (ModelConfig.check_finite_weights).

Writes a random checkpoint of a model shape (default: Llama-3.2-1B, bfloat16, 2.5 GB) into a
temporary folder, then loads it with the check on and off, alternating, and also times the
check alone on the loaded weights (one sum per tensor and one read-back, as the loader does),
against the same weights' element-wise `isfinite(t).all()` for comparison.

    python -m runner.benchmarks.load_check --out /tmp/load_check [--shape llama-3.2-1b] [--device cpu]

Prints the figures and writes them to <out>/load_check.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from runner.benchmarks.load import write_random_checkpoint

SHAPES = ("smollm2-135m", "llama-3.2-1b")
"""Model shapes of runner/benchmarks/model_shapes.py this benchmark offers."""


def _time_load(folder: Path, device: torch.device, dtype: torch.dtype, check: bool) -> tuple[float, object]:
    from models import build_model, load_hf_config, model_spec
    spec = model_spec(load_hf_config(folder))
    started = time.perf_counter()
    model = build_model(spec, folder, device=device, dtype=dtype, check_finite=check)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, model


def _time_checks(model, device: torch.device, repeats: int) -> dict[str, float]:
    params = [p.data for p in model.parameters()]

    def summed() -> bool:
        return all(torch.isfinite(torch.stack([p.sum().float() for p in params])).tolist())

    def elementwise() -> bool:
        return all(torch.stack([torch.isfinite(p).all() for p in params]).tolist())

    out = {}
    for name, check in (("sum_check_s", summed), ("isfinite_all_s", elementwise)):
        assert check()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            check()
            times.append(time.perf_counter() - started)
        out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for load_check.json")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--loads", type=int, default=3, help="loads with the check on, and as many off")
    parser.add_argument("--repeats", type=int, default=5, help="timings of the check alone")
    args = parser.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="graphrunner-load-check-"))
    try:
        nbytes = write_random_checkpoint(args.shape, work / args.shape, dtype)
        loads: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.loads):
            for check in (True, False):
                seconds, model = _time_load(work / args.shape, device, dtype, check)
                loads[check].append(seconds)
        checks = _time_checks(model, device, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"shape": args.shape, "dtype": args.dtype, "device": args.device, "weight_bytes": nbytes,
              "load_checked_s": statistics.median(loads[True]), "load_unchecked_s": statistics.median(loads[False]),
              **checks, "torch": torch.__version__}
    result["check_fraction_of_load"] = result["sum_check_s"] / result["load_unchecked_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.shape} {args.dtype} on {args.device}: {nbytes / 2**30:.2f} GiB of weights; load "
          f"{result['load_unchecked_s']:.2f} s unchecked, {result['load_checked_s']:.2f} s checked; the check alone "
          f"{result['sum_check_s'] * 1e3:.1f} ms ({100 * result['check_fraction_of_load']:.1f}% of a load; "
          f"isfinite(t).all() would take {result['isfinite_all_s'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
