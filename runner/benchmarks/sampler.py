"""Time per step of the whole sampling stage (`SamplingStage.launch` + its wait), beside a decode step.

    graphrunner bench sampler --device cuda --out /tmp/sampler-bench [--step-ms 2.37]

For each batch size (default 1, 32, 256) over a Llama-3.2-1B-size vocabulary (128256) of bf16
logits: `greedy` (the plain greedy fast path), `random` (temperature, top-k 50, top-p 0.9),
`penalties` (`random` plus presence, frequency and repetition penalties over a 512-token
prompt, counts growing every step) and `bitmask` (`random` plus a structured-output token
bitmask of random bits on every row, handed to the stage as the engine hands it: on a GPU the
first pass over the logits applies it).
The stage's tensors are built once; each timed step runs the whole stage: host-side metadata,
the processors, the sampler, the copy of the tokens to the host. CUDA events time it on a GPU
(perf_counter on a CPU); the median of `--iters` steps after `--warmup`. With `--step-ms` (a
decode step's time, e.g. from `graphrunner bench decode`), each figure is also printed as a
share of that step. `host ms` is the median time `launch` takes to enqueue a step (host work:
the per-step plan, uploads, launches); on a GPU the device's share is the rest. Raw results:
`<out>/sampler.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from configs import SamplingParams
from runner.sampling import SamplingStage, argmax_rows
from runner.scheduler import ScheduledRequest
from runner.structured_output.bitmask import TokenBitmask

SCENARIOS = ("greedy", "random", "penalties", "bitmask")


def _params(scenario: str) -> SamplingParams:
    if scenario == "greedy":
        return SamplingParams(temperature=0.0)
    extra = {}
    if scenario == "penalties":
        extra = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, **extra)


def time_stage(scenario: str, batch: int, vocab: int, device: torch.device, iters: int, warmup: int,
               prompt_len: int = 512, host_times: list[float] | None = None) -> list[float]:
    """Milliseconds per step of the whole sampling stage, one entry per timed step; `host_times`,
    if given, gets the host's share of each: the time `launch` takes to enqueue the step (on a GPU
    the device runs behind it; on a CPU it is the whole step but the wait)."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, vocab, device=device, generator=g).to(torch.bfloat16)
    prompt = torch.randint(0, vocab, (prompt_len,)).tolist()
    params = _params(scenario)
    reqs = [ScheduledRequest(f"r{i}", [0], 0, [], True, params, 0, -1, frozenset({vocab - 1}), prompt, None,
                             params.needs_logits_processors) for i in range(batch)]
    token_bitmask = None
    if scenario == "bitmask":
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (batch, words), device=device, dtype=torch.int32, generator=g)
        every_row = torch.arange(batch, dtype=torch.int32, device=device)
        token_bitmask = TokenBitmask(bitmask, every_row, vocab, torch.ones_like(every_row))
    stage = SamplingStage(vocab, device)

    def logits_fn():
        return logits

    times = []
    for step in range(warmup + iters):
        for req in reqs:
            req.output_token_count = step
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            pending = stage.launch(reqs, logits_fn, lambda: argmax_rows(logits), token_bitmask=token_bitmask)
            host = (time.perf_counter() - t0) * 1e3
            pending.resolve()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            pending = stage.launch(reqs, logits_fn, lambda: argmax_rows(logits), token_bitmask=token_bitmask)
            host = (time.perf_counter() - t0) * 1e3
            pending.resolve()
            elapsed = (time.perf_counter() - t0) * 1e3
        if step >= warmup:
            times.append(elapsed)
            if host_times is not None:
                host_times.append(host)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama-3.2-1B's by default)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--step-ms", type=float, help="a decode step's time to print each figure against")
    parser.add_argument("--out", required=True, help="folder for the raw results (sampler.json)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    results = []
    print(f"sampling stage per step, vocab {args.vocab}, {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), median of {args.iters}")
    header = f"{'scenario':>10} {'batch':>6} {'median ms':>10} {'p90 ms':>8} {'host ms':>8}"
    print(header + (f" {'% of step':>10}" if args.step_ms else ""))
    with torch.inference_mode():
        for batch in args.batch:
            for scenario in args.scenarios:
                host_times = []
                times = time_stage(scenario, batch, args.vocab, device, args.iters, args.warmup,
                                   host_times=host_times)
                median = statistics.median(times)
                p90 = sorted(times)[int(0.9 * (len(times) - 1))]
                host = statistics.median(host_times)
                line = f"{scenario:>10} {batch:>6} {median:>10.3f} {p90:>8.3f} {host:>8.3f}"
                if args.step_ms:
                    line += f" {100 * median / args.step_ms:>9.1f}%"
                print(line)
                results.append({"scenario": scenario, "batch": batch, "vocab": args.vocab, "device": str(device),
                                "median_ms": median, "p90_ms": p90, "times_ms": times,
                                "host_median_ms": host, "host_times_ms": host_times, "step_ms": args.step_ms})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(results, indent=1))
    print(f"raw results: {out / 'sampler.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
