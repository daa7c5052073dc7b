"""PIECEWISE decode with its replay shortcuts on and off, in one process.

    graphrunner bench break_replay [--shape smollm2-135m] [--batch-size 1] [--blocks 6] [--steps 40] [--out DIR]

Four variants alternate in blocks of `--steps` engine steps (a GPU host's speed drifts within
minutes, so a before/after across runs measures the host, not the change); the median step time of each is
printed with the host time spent inside the PIECEWISE replay call per step (launching, not the GPU's
work), the replays launched as step graphs, and the per-block figures:
- "native": as the engine runs: the whole replay as one step graph (runner/cudagraph/step_graph.py:
  segments as child graphs, attention as kernel nodes re-parameterised when the step's launch differs);
- "fast": the layer loop in Python (break replays prepared at capture, attention through Triton's C
  launch directly, segments through torch's C++ replay): the path a step takes when it cannot use the
  step graph;
- "python-launch": prepared break replays, but attention through Triton's Python launcher and
  segments through `CUDAGraph.replay`;
- "generic": every captured BreakableGraph's calls rebuilt as `op(*args, **kwargs)`, which is what
  a replay did before `prepare_replay`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time

from runner.benchmarks.model_shapes import SHAPES, write_config
from runner.benchmarks.results import add_out_argument, write_json


VARIANTS = ("native", "fast", "python-launch", "generic")


def _set_variant(runner, variant: str) -> None:
    """Rebuild every captured BreakableGraph's per-segment replays and break calls for `variant`."""
    from attention.kernels import unified_attention
    from runner.cudagraph.breakable import _replay_of
    launcher = unified_attention._attention_launch
    vars(launcher).pop("direct_launch", None)          # FastLaunch.direct_launch again
    if variant not in ("native", "fast"):
        launcher.direct_launch = lambda kernel, grid, stream: None
    for entry in runner.piecewise._entries.values():
        graph = entry.graph
        prepared = variant != "generic"
        graph._calls = [(r.replay if prepared and r.replay else functools.partial(r.op, *r.args, **r.kwargs))
                        for r in graph.breaks]
        graph._replays = [_replay_of(s) if variant in ("native", "fast") else s.replay for s in graph.segments]
        _, engines = _step_graphs.setdefault(id(graph), (graph, graph.step_graph))   # the engine's own, kept
        graph.step_graph = engines if variant == "native" else None


_step_graphs: dict[int, tuple] = {}


_replay_seconds = [0.0]


def _time_replays(runner) -> None:
    """Add each PIECEWISE replay's host time (the call, not the GPU work) to `_replay_seconds`."""
    for entry in runner.piecewise._entries.values():
        replay = type(entry.graph).replay.__get__(entry.graph)

        def timed(replay=replay) -> None:
            started = time.perf_counter()
            replay()
            _replay_seconds[0] += time.perf_counter() - started

        entry.graph.replay = timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench break_replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("graphrunner bench break_replay: needs a CUDA device (PIECEWISE graphs are CUDA graphs)")
        return 0

    from configs import SamplingParams
    from runner import LLM
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(model=str(write_config(args.shape, folder)), load_format="dummy", dtype="bfloat16",
                  cudagraph_mode="PIECEWISE", max_model_len=2048, gpu_memory_utilization=0.5)
        engine = llm.engine
        runner = engine.model_runner
        params = SamplingParams(temperature=0.0, max_tokens=args.blocks * args.steps * len(VARIANTS) + 50,
                                ignore_eos=True)
        for i in range(args.batch_size):
            engine.add_request(list(range(1, 129)), params, request_id=f"r{i}")
        for _ in range(10):   # prefill and warm-up
            engine.step()
        _time_replays(runner)
        times = {variant: [] for variant in VARIANTS}
        replay_us = {variant: [] for variant in VARIANTS}
        loop_runs = dict.fromkeys(VARIANTS, 0)
        for block in range(len(VARIANTS) * args.blocks):
            variant = VARIANTS[block % len(VARIANTS)]
            _set_variant(runner, variant)
            torch.cuda.synchronize()
            _replay_seconds[0] = 0.0
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            times[variant].append((time.perf_counter() - started) / args.steps * 1e3)
            replay_us[variant].append(_replay_seconds[0] / args.steps * 1e6)
            loop_runs[variant] += runner.piecewise.step_graph_runs
        llm.shutdown()
    medians = {variant: statistics.median(t) for variant, t in times.items()}
    for variant in VARIANTS:
        print(f"{args.shape} PIECEWISE bs{args.batch_size} {variant:13s}: median {medians[variant]:.3f} ms/step "
              f"({medians[variant] / medians['fast']:.3f}x fast), host in replay {statistics.median(replay_us[variant]):.0f} "
              f"us/step, step graph runs {loop_runs[variant]}, blocks {', '.join(f'{t:.3f}' for t in times[variant])}")
    write_json(args.out, "break_replay.json", {
        "shape": args.shape, "batch_size": args.batch_size, "device": torch.cuda.get_device_name(),
        "ms_per_step": times, "median_ms_per_step": medians, "replay_host_us": replay_us, "step_graph_runs": loop_runs})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
