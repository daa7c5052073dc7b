"""PIECEWISE decode with break replays prepared at capture vs the generic op call, in one process.

    python scripts/bench_break_replay.py [--shape smollm2-135m] [--batch-size 1] [--blocks 6] [--steps 40]

The two replays alternate in blocks of `--steps` engine steps (the device host's speed drifts, so a
before/after across runs measures the host, not the change); the median step time of each is
printed with the per-block figures. "generic" rebuilds every captured BreakableGraph's calls as
`op(*args, **kwargs)`, which is what a replay did before `prepare_replay`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_shapes import SHAPES, write_config  # noqa: E402


def _set_calls(runner, prepared: bool) -> None:
    for entry in runner.piecewise._entries.values():
        graph = entry.graph
        graph._calls = [(r.replay if prepared and r.replay else functools.partial(r.op, *r.args, **r.kwargs))
                        for r in graph.breaks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("bench_break_replay.py: needs a CUDA device (PIECEWISE graphs are CUDA graphs)")
        return

    from configs import SamplingParams
    from runner import LLM
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(model=str(write_config(args.shape, folder)), load_format="dummy", dtype="bfloat16",
                  cudagraph_mode="PIECEWISE", max_model_len=2048, gpu_memory_utilization=0.5)
        engine = llm.engine
        runner = engine.model_runner
        params = SamplingParams(temperature=0.0, max_tokens=args.blocks * args.steps * 2 + 50, ignore_eos=True)
        for i in range(args.batch_size):
            engine.add_request(list(range(1, 129)), params, request_id=f"r{i}")
        for _ in range(10):   # prefill and warm-up
            engine.step()
        times = {True: [], False: []}
        for block in range(2 * args.blocks):
            prepared = block % 2 == 0
            _set_calls(runner, prepared)
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            times[prepared].append((time.perf_counter() - started) / args.steps * 1e3)
        llm.shutdown()
    for prepared, name in ((True, "prepared"), (False, "generic")):
        print(f"{args.shape} PIECEWISE bs{args.batch_size} {name:8s}: median {statistics.median(times[prepared]):.3f} "
              f"ms/step, blocks {', '.join(f'{t:.3f}' for t in times[prepared])}")
    print(f"generic / prepared: {statistics.median(times[False]) / statistics.median(times[True]):.3f}")


if __name__ == "__main__":
    main()
