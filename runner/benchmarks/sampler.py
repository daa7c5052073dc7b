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
the per-step plan, uploads, launches); on a GPU the device's share is the rest.

`median ms` times the stage alone: the device idles while the host launches it, so on a GPU it
is mostly host time, and it moves with the host's speed and load. The engine launches the stage
right behind the step's forward (ModelRunner.execute_async), so its host work overlaps the
forward's device time. On a GPU with `--step-ms`, `in step ms` measures that: each step first
queues a device wait as long as the decode step (standing for the forward), then launches the
stage; it is the device time from the end of that wait to the end of the tokens' copy to the
host, i.e. what the stage adds to a decode step's device time: its kernels, copies and the gaps
between them, plus any host time the step does not cover. (The host's wake-up after the copy is
not counted: with async scheduling the next step is launched before it.) Raw results:
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


def sleep_cycles_per_ms(device: torch.device) -> float:
    """Clock cycles of `torch.cuda._sleep` per millisecond on `device` (measured over 5 ms)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)   # first call: module load
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def time_stage(scenario: str, batch: int, vocab: int, device: torch.device, iters: int, warmup: int,
               prompt_len: int = 512, host_times: list[float] | None = None,
               behind_cycles: int = 0) -> list[float]:
    """Milliseconds per step of the whole sampling stage, one entry per timed step; `host_times`,
    if given, gets the host's share of each: the time `launch` takes to enqueue the step (on a GPU
    the device runs behind it; on a CPU it is the whole step but the wait). `behind_cycles` (GPU):
    queue a device wait of that many cycles before each step's launch and time from its end (the
    stage behind a forward, as the engine launches it)."""
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
            if behind_cycles:
                torch.cuda._sleep(behind_cycles)
            start.record()
            t0 = time.perf_counter()
            pending = stage.launch(reqs, logits_fn, lambda: argmax_rows(logits), token_bitmask=token_bitmask)
            host = (time.perf_counter() - t0) * 1e3
            if behind_cycles:   # the device's own end of the stage (the tokens' copy), not the host's wake-up
                end.record()
                pending.resolve()
            else:
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
    in_step = bool(args.step_ms) and device.type == "cuda"
    behind_cycles = int(args.step_ms * sleep_cycles_per_ms(device)) if in_step else 0
    print(header + (f" {'% of step':>10}" if args.step_ms else "")
          + (f" {'in step ms':>11} {'% of step':>10}" if in_step else ""))
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
                in_step_times = []
                if in_step:
                    in_step_times = time_stage(scenario, batch, args.vocab, device, args.iters, args.warmup,
                                               behind_cycles=behind_cycles)
                    in_step_median = statistics.median(in_step_times)
                    line += f" {in_step_median:>11.3f} {100 * in_step_median / args.step_ms:>9.1f}%"
                print(line)
                results.append({"scenario": scenario, "batch": batch, "vocab": args.vocab, "device": str(device),
                                "median_ms": median, "p90_ms": p90, "times_ms": times,
                                "host_median_ms": host, "host_times_ms": host_times, "step_ms": args.step_ms,
                                "in_step_times_ms": in_step_times})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(results, indent=1))
    print(f"raw results: {out / 'sampler.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
