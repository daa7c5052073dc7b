"""Decode-step latency per CUDA graph mode vs HF transformers eager and the memory floor, same run.

(A benchmark of ~620 lines on purpose: the engine side, the HF side, the bandwidth floor and the
report of one comparison stay in one file so a figure and its method are read together.)

    graphrunner bench decode [--shapes smollm2-135m llama-3.2-1b llama-3-8b]
        [--batch-sizes 1 8 32 128] [--modes NONE PIECEWISE FULL] [--warmup 5] [--steps 20]
        [--prompt-len 128 | --context-len 1024 32768 ...] [--max-kv-tokens N]
        [--async-scheduling {auto,on,off}] [--no-hf] [--hf-max-batch N] [--quick]
        [--tensor-parallel-size 1 2] [--out DIR] [--no-plot]

Long context: `--context-len 1024 32768 61440` runs every batch size at each context in one engine
(max_model_len raised to fit; `--max-kv-tokens` skips batch x context products above it), and
prints a long-context table: decode ms/token, the bandwidth floor, x floor and the prefill
tokens/s of the prompts (first token of every request, from adding them; a warm-up request first
compiles the prefill kernels).

Model shapes come from runner/benchmarks/model_shapes.py, with random (`load_format="dummy"`) bf16 weights.
One engine per (shape, mode, tensor-parallel size), graphs captured for exactly the batch sizes
asked. `--tensor-parallel-size 1 2` runs every mode at TP=1 and at TP=2 (one GPU per rank; rows
of TP=N > 1 are labelled `MODE tpN`, their floor is per rank: 1/N of the bytes) and ends with a
table of the TP=N / TP=1 step-time ratios. For each batch
size B: B requests with a random `--prompt-len`-token prompt (greedy, ignore_eos) are added, steps
run until every request has its first token (prefill, chunked as the scheduler likes), then
`--warmup` decode steps are discarded and `--steps` decode steps are timed. Each decode step is
a uniform batch of B one-token requests, so it replays the graph captured for B.

`--async-scheduling` (default `auto`: on for CUDA) is passed to the engine. With it on, `engine.step()`
launches step n+1 and then waits for step n's tokens, so the GPU work of a step is still in
flight when `step()` returns and events around the call no longer bracket one step.

How a step is timed (CUDA events; `time.perf_counter` on a CPU):

    start ─ schedule, prepare inputs, metadata ─ forward ─ forward + logits + sample ─ sampled ─ update, outputs ─ end
                                                 (event)                              (event)

- `ms/step`: the median interval between consecutive steps' `sampled` events: the inter-token
  latency, in both modes. `sampled` is recorded by wrapping the model runner's `sample` (sync:
  just after the tokens reached the host) and `sample_async` (async: just after the sampling
  kernels and the tokens' copy to the host were enqueued), so on the GPU timeline it marks a
  step's tokens being ready. Synchronous, the GPU idles during the host work, and the interval is
  everything a served decode step costs (host work, launches, kernels, sampling; `call ms`, the
  `start -> end` events around `engine.step()`, is the same less the benchmark's own loop);
  async, the host work of one step overlaps the GPU work of the next.
- `host ms`: the part of the step that is host work outside the model.
  Synchronous: `start -> forward` (scheduler, input preparation, attention metadata) plus
  `sampled -> end` (scheduler update, detokenizer, outputs), where `forward` is recorded by
  wrapping the model runner's `forward` (just before the model or graph is launched). The GPU has
  no work queued during these two intervals, so this is the host time per step that no graph can
  hide. Launch overhead inside the forward is NOT in it: that is the `ms/step` difference between
  the modes. Async: the `perf_counter` time of `engine.step()` minus the time it spent waiting
  for the GPU (the previous step's tokens, `PendingOutput.wait`): everything the host does per
  step, launches included; the GPU hides it while it is below the GPU time of a step. (On a CPU
  nothing runs asynchronously: the forward is inside this figure.)
- `tok/s` = B / median ms/step.
- HF: `AutoModelForCausalLM.from_config(config, dtype=bf16)` on the device (random weights, its
  default attention, eager), same B and prompt; prefill once, then a manual loop of
  `model(next_token, past_key_values=cache, logits_to_keep=1)`, argmax, and the next tokens copied
  to the host (as `generate` syncs every step); events around each step, median.
- Floor: (bytes a decode step must read: weights as streamed, i.e. the LM head but not the
  embedding table unless tied + K/V of every cached token at the mean context of the timed steps)
  / copy bandwidth, where copy bandwidth = (bytes read + written) / time of a large
  device-to-device `copy_`, median of several, measured at the start of the same run.
  `% of floor` = floor / ms per step.

Prints capture figures per (shape, mode) (graph count, seconds, pool bytes from the model
runner's capture summary; measured graph reserve) and then the main table, last. With `--out DIR`,
writes the figures to DIR/decode.json and a plot to DIR/decode.png (ms/step vs batch size, log y,
one panel per shape).

One file of ~620 lines: the step marks, the engine and HF loops, the floor and the report share the
Row / EngineFigures types and are read together when a figure looks wrong; runner/benchmarks/host.py
and attention.py import its Clock, StepMarks and copy_bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from runner.benchmarks.model_shapes import SHAPES, kv_bytes_per_token, parameter_bytes, write_config
from runner.benchmarks.results import add_out_argument, result_path, write_json

DEFAULT_SHAPES = ["smollm2-135m", "llama-3.2-1b", "llama-3-8b"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BLOCK_SIZE = 16  # the engine's default; only used to size the KV cache


# ---- timing -----------------------------------------------------------------------------------
class Clock:
    """Timestamps on the device's timeline: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def new(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else [None]

    def record(self, mark) -> None:
        if self.cuda:
            mark.record()
        else:
            mark[0] = time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b[0] - a[0]) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class _TimedPending:
    """An async step's pending tokens that add the time `resolve` waits for the GPU to `marks.waited_s`."""

    def __init__(self, pending, marks: "StepMarks") -> None:
        self.pending, self.marks = pending, marks

    @property
    def sampled(self):
        return self.pending.sampled

    def resolve(self):
        started = time.perf_counter()
        self.pending.wait()
        self.marks.waited_s += time.perf_counter() - started
        return self.pending.resolve()


class StepMarks:
    """Four marks per step (start, forward, sampled, end); the model runner's `forward`, `sample`
    and `sample_async` are wrapped to record the middle two while a step is armed. `waited_s`:
    seconds the armed step spent waiting for an async step's tokens."""

    NAMES = ("start", "forward", "sampled", "end")

    def __init__(self, clock: Clock, runner) -> None:
        self.clock, self.runner = clock, runner
        self.current: dict | None = None
        self.seen: set[str] = set()
        self.waited_s = 0.0
        forward, sample = runner.forward, runner.sample
        sample_async = getattr(runner, "sample_async", None)

        def timed_forward(*args, **kwargs):
            self._mark("forward")
            return forward(*args, **kwargs)

        def timed_sample(*args, **kwargs):
            result = sample(*args, **kwargs)
            self._mark("sampled")
            return result

        def timed_sample_async(*args, **kwargs):
            pending = sample_async(*args, **kwargs)
            self._mark("sampled")
            return _TimedPending(pending, self)

        runner.forward, runner.sample = timed_forward, timed_sample
        if sample_async is not None:
            runner.sample_async = timed_sample_async
        self._originals = (forward, sample, sample_async)

    def _mark(self, name: str) -> None:
        if self.current is not None and name not in self.seen:  # first forward of the step only
            self.clock.record(self.current[name])
            self.seen.add(name)

    def arm(self) -> dict:
        self.current, self.seen = {name: self.clock.new() for name in self.NAMES}, set()
        self.waited_s = 0.0
        self._mark("start")
        return self.current

    def disarm(self) -> None:
        self._mark("end")
        missing = set(self.NAMES) - self.seen
        if missing:
            raise RuntimeError(f"step ran without reaching {sorted(missing)}; is it a decode step?")
        self.current = None

    def restore(self) -> None:
        forward, sample, sample_async = self._originals
        self.runner.forward, self.runner.sample = forward, sample
        if sample_async is not None:
            self.runner.sample_async = sample_async


def copy_bandwidth(device: torch.device, num_bytes: int | None = None, repeats: int = 10) -> float:
    """Bytes moved (read + written) per second by a large copy on `device`, median of `repeats`."""
    num_bytes = num_bytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    clock = Clock(device)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = clock.new(), clock.new()
        clock.record(a)
        dst.copy_(src)
        clock.record(b)
        clock.sync()
        times.append(clock.ms(a, b))
    del src, dst
    return 2 * num_bytes / (statistics.median(times) * 1e-3)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- the engine -------------------------------------------------------------------------------
@dataclass
class EngineFigures:
    shape: str
    mode: str
    resolved_mode: str
    startup_s: float
    async_scheduling: bool = False
    num_graphs: int = 0
    capture_s: float = 0.0
    pool_bytes: int = 0
    graph_reserve_bytes: int = 0
    cuda_graph_ready: bool = False


@dataclass
class Row:
    shape: str
    batch_size: int
    mode: str
    ms_per_step: float
    tok_s: float
    host_ms: float
    forward_sample_ms: float
    wall_ms: float
    context: float
    async_scheduling: bool = False
    call_ms: float | None = None
    """Median `start -> end` (events around `engine.step()`): the old ms/step, sync mode only."""
    floor_ms: float | None = None
    pct_of_floor: float | None = None
    prompt_len: int = 0
    prefill_tok_s: float | None = None
    """Prompt tokens of the batch / seconds from adding the requests to the first token of each."""
    hf_ms_per_step: float | None = None
    speedup_vs_hf: float | None = None
    tensor_parallel_size: int = 1
    step_ms: list[float] = field(default_factory=list)


def random_prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch_size)]


def prefill_step_bound(batch_size: int, prompt_len: int, max_num_batched_tokens: int) -> int:
    """Steps at most until every request has its first token (each yields <= 1 token per request;
    beside running requests a prompt's chunk is capped, SchedulerConfig.long_prefill_token_threshold,
    so several prompts share a step's budget and the last steps may not fill it)."""
    return 2 * -(-batch_size * prompt_len // max_num_batched_tokens) + 2 * batch_size + 2


def max_tokens_for(batch_size: int, args, prompt_len: int | None = None) -> int:
    """Enough that no request finishes before the last timed step, whatever the prefill took (+2:
    with async scheduling the engine runs a step ahead of the outputs it returns)."""
    prompt_len = args.prompt_len if prompt_len is None else prompt_len
    return prefill_step_bound(batch_size, prompt_len, args.max_num_batched_tokens) + 3 + args.warmup + args.steps


def cases(args) -> list[tuple[int, int]]:
    """(prompt length, batch size) pairs to run: every batch size at every context, less those
    over --max-kv-tokens."""
    return [(c, b) for c in args.contexts for b in args.batch_sizes
            if args.max_kv_tokens is None or b * c <= args.max_kv_tokens]


def build_engine(folder: Path, mode: str, args, tensor_parallel_size: int = 1):
    from runner import LLM
    max_bs = max(args.batch_sizes)
    num_blocks = max(b * -(-(c + max_tokens_for(b, args, c)) // BLOCK_SIZE) for c, b in cases(args))
    num_blocks = max(num_blocks, -(-args.max_model_len // BLOCK_SIZE)) + 8
    return LLM(model=str(folder), load_format="dummy", dtype=args.dtype, device=args.device, cudagraph_mode=mode,
               cudagraph_capture_sizes=sorted(set(args.batch_sizes)), max_num_seqs=max_bs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, seed=0, tensor_parallel_size=tensor_parallel_size,
               async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])


def warm_prefill(llm, args) -> None:
    """One short request whose prompt fills a whole step (a prefill and the decode after it), so the
    first timed prefill does not compile the prefill kernels."""
    from configs import SamplingParams
    engine = llm.engine
    prompt = random_prompts(1, min(args.max_num_batched_tokens, max(args.contexts)), engine.spec.vocab_size,
                            seed=-1)[0]
    engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2), request_id="warm")
    while engine.has_unfinished_requests():
        engine.step()


def bench_engine_batch(llm, shape: str, mode: str, batch_size: int, args, prompt_len: int | None = None) -> Row:
    from configs import SamplingParams
    engine = llm.engine
    runner = engine.model_runner
    clock = Clock(runner.device)
    prompt_len = args.prompt_len if prompt_len is None else prompt_len
    prefill_bound = prefill_step_bound(batch_size, prompt_len, args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens_for(batch_size, args, prompt_len))
    prompts = random_prompts(batch_size, prompt_len, engine.spec.vocab_size, seed=batch_size * 7919 + prompt_len)

    clock.sync()
    prefill_started = time.perf_counter()
    ids = [engine.add_request(p, params, request_id=f"bs{batch_size}-ctx{prompt_len}-{i}")
           for i, p in enumerate(prompts)]
    started: set[str] = set()
    for _ in range(prefill_bound + 2):  # async: the first step() returns nothing
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        if len(started) == batch_size:
            break
    else:
        raise RuntimeError(f"{batch_size} requests did not all start decoding within {prefill_bound} steps")
    prefill_s = time.perf_counter() - prefill_started   # the first tokens are on the host: no sync needed

    marks = StepMarks(clock, runner)
    recorded, walls, waits, contexts = [], [], [], []
    try:
        for step in range(args.warmup + args.steps):
            wall = time.perf_counter()
            current = marks.arm()
            outputs = engine.step()
            marks.disarm()
            wall = time.perf_counter() - wall
            if len(outputs) != batch_size or any(o.finished for o in outputs):
                raise RuntimeError(f"decode step {step}: {len(outputs)} outputs for {batch_size} running requests")
            recorded.append(current)
            if step >= args.warmup:
                walls.append(wall * 1e3)
                waits.append(marks.waited_s * 1e3)
                contexts.append(statistics.fmean(prompt_len + len(o.outputs[0].token_ids) for o in outputs))
    finally:
        marks.restore()
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()  # lets the runner drop the finished requests' state (and applies a step in flight)
    clock.sync()
    first = max(args.warmup, 1)  # an interval needs the previous step's mark
    step_ms = [clock.ms(recorded[i - 1]["sampled"], recorded[i]["sampled"]) for i in range(first, len(recorded))]
    timed = recorded[args.warmup:]
    call_ms = [clock.ms(m["start"], m["end"]) for m in timed]
    inner_ms = [clock.ms(m["forward"], m["sampled"]) for m in timed]
    if engine.async_scheduling:
        host_ms = [w - g for w, g in zip(walls, waits)]
    else:
        host_ms = [s - i for s, i in zip(call_ms, inner_ms)]
    median = statistics.median(step_ms)
    return Row(shape=shape, batch_size=batch_size, mode=mode, ms_per_step=median, tok_s=batch_size / median * 1e3,
               host_ms=statistics.median(host_ms), forward_sample_ms=statistics.median(inner_ms),
               wall_ms=statistics.median(walls), context=statistics.fmean(contexts),
               async_scheduling=engine.async_scheduling,
               call_ms=None if engine.async_scheduling else statistics.median(call_ms), step_ms=step_ms,
               prompt_len=prompt_len, prefill_tok_s=batch_size * prompt_len / prefill_s)


def tp_label(mode: str, tensor_parallel_size: int) -> str:
    """A row's mode column: the graph mode, with ` tpN` for a tensor-parallel engine."""
    return mode if tensor_parallel_size == 1 else f"{mode} tp{tensor_parallel_size}"


def bench_engine(shape: str, folder: Path, mode: str, args, tensor_parallel_size: int = 1
                 ) -> tuple[EngineFigures, list[Row]]:
    started = time.perf_counter()
    llm = build_engine(folder, mode, args, tensor_parallel_size)
    label = tp_label(mode, tensor_parallel_size)
    startup = time.perf_counter() - started
    runner = llm.engine.model_runner
    summary = getattr(runner, "capture_summary", None)
    figures = EngineFigures(shape=shape, mode=label, resolved_mode=runner.cudagraph_mode.name, startup_s=startup,
                            async_scheduling=llm.engine.async_scheduling, cuda_graph_ready=runner.cuda_graph_ready,
                            graph_reserve_bytes=runner.graph_reserve_bytes or 0)
    if summary is not None:
        figures.num_graphs, figures.capture_s, figures.pool_bytes = (summary.num_graphs, summary.seconds,
                                                                      summary.pool_bytes)
    rows = []
    try:
        if args.context_len:
            warm_prefill(llm, args)
        for prompt_len, batch_size in cases(args):
            rows.append(bench_engine_batch(llm, shape, label, batch_size, args, prompt_len))
            rows[-1].tensor_parallel_size = tensor_parallel_size
            log(f"  {shape} {label:9s} bs {batch_size:4d} ctx {prompt_len:6d}"
                f"{' async' if rows[-1].async_scheduling else ''}: {rows[-1].ms_per_step:8.3f} ms/step, "
                f"host {rows[-1].host_ms:.3f} ms, prefill {rows[-1].prefill_tok_s:.0f} tok/s")
    finally:
        llm.shutdown()
        del llm, runner
        free_memory()
    return figures, rows


# ---- HF transformers --------------------------------------------------------------------------
def bench_hf(folder: Path, batch_sizes: list[int], args) -> dict[int, float]:
    """Median ms per decode step of HF eager with a DynamicCache, per batch size."""
    from transformers import AutoConfig, AutoModelForCausalLM
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()
    clock = Clock(device)
    results = {}
    try:
        for batch_size in batch_sizes:
            prompts = random_prompts(batch_size, args.prompt_len, config.vocab_size, seed=batch_size)
            input_ids = torch.tensor(prompts, device=device)
            times = []
            with torch.inference_mode():
                out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
                cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                next_ids.tolist()
                for step in range(args.warmup + args.steps):
                    a, b = clock.new(), clock.new()
                    clock.record(a)
                    out = model(input_ids=next_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    next_ids.tolist()
                    clock.record(b)
                    if step >= args.warmup:
                        times.append((a, b))
                clock.sync()
            results[batch_size] = statistics.median(clock.ms(a, b) for a, b in times)
            log(f"  {folder.name} HF        bs {batch_size:4d}: {results[batch_size]:8.3f} ms/step")
            del out, cache, next_ids, input_ids
            free_memory()
    finally:
        del model
        free_memory()
    return results


# ---- report -----------------------------------------------------------------------------------
def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def capture_table(engines: list[EngineFigures]) -> str:
    lines = ["| shape | mode | resolved | graphs | capture s | pool MiB | reserve MiB | start-up s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for e in engines:
        lines.append(f"| {e.shape} | {e.mode} | {e.resolved_mode} | {e.num_graphs} | {e.capture_s:.2f} | "
                     f"{e.pool_bytes / 2**20:.1f} | {e.graph_reserve_bytes / 2**20:.1f} | {e.startup_s:.1f} |")
    return "\n".join(lines)


def main_table(rows: list[Row]) -> str:
    lines = ["| shape | bs | mode | async | ms/step | tok/s | host ms | HF ms/step | speedup vs HF | floor ms "
             "| % of floor |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speedup = None if r.speedup_vs_hf is None else f"{r.speedup_vs_hf:.2f}x"
        lines.append(f"| {r.shape} | {r.batch_size} | {r.mode} | {'on' if r.async_scheduling else 'off'} | "
                     f"{r.ms_per_step:.3f} | {r.tok_s:.0f} | "
                     f"{r.host_ms:.3f} | {fmt(r.hf_ms_per_step, '.3f')} | {speedup or '-'} | "
                     f"{fmt(r.floor_ms, '.3f')} | {fmt(r.pct_of_floor, '.1f')} |")
    return "\n".join(lines)


def tp_ratio_table(rows: list[Row]) -> str:
    """TP=N step time over TP=1's, per shape, mode and batch size (issue 22's goal: <= 0.6 at bs 1, TP=2)."""
    base = {(r.shape, r.mode, r.batch_size): r.ms_per_step for r in rows if r.tensor_parallel_size == 1}
    lines = ["| shape | bs | mode | TP | ms/step | TP=1 ms/step | ratio to TP=1 |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.tensor_parallel_size == 1:
            continue
        mode = r.mode.rsplit(" tp", 1)[0]
        one = base.get((r.shape, mode, r.batch_size))
        ratio = None if one is None else r.ms_per_step / one
        lines.append(f"| {r.shape} | {r.batch_size} | {mode} | {r.tensor_parallel_size} | {r.ms_per_step:.3f} | "
                     f"{fmt(one, '.3f')} | {fmt(ratio, '.3f')} |")
    return "\n".join(lines)


def long_context_table(rows: list[Row]) -> str:
    """The issue-style table: per context, decode ms/token against the bandwidth floor, and prefill."""
    lines = ["| shape | mode | bs | context | decode ms/step | floor ms | x floor | prefill tok/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        x_floor = None if r.floor_ms is None else r.ms_per_step / r.floor_ms
        lines.append(f"| {r.shape} | {r.mode} | {r.batch_size} | {r.prompt_len} | {r.ms_per_step:.3f} | "
                     f"{fmt(r.floor_ms, '.3f')} | {fmt(x_floor, '.2f')} | {fmt(r.prefill_tok_s, '.0f')} |")
    return "\n".join(lines)


def plot(rows: list[Row], hf: dict[str, dict[int, float]], shapes: list[str], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r.shape == shape]
        for mode in dict.fromkeys(r.mode for r in mine):
            pts = sorted((r.batch_size, r.ms_per_step) for r in mine if r.mode == mode)
            ax.plot(*zip(*pts), marker="o", label=mode)
        if hf.get(shape):
            pts = sorted(hf[shape].items())
            ax.plot(*zip(*pts), marker="s", color="gray", label="HF eager")
        floors: dict[int, float] = {}
        for r in mine:
            if r.floor_ms is not None:
                floors[r.batch_size] = min(r.floor_ms, floors.get(r.batch_size, math.inf))
        floor = sorted(floors.items())
        if floor:
            ax.plot(*zip(*floor), linestyle="--", color="black", label="memory floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.batch_size for r in mine}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms / decode step")
        ax.set_title(shape)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="graphrunner bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                        help=f"default: {' '.join(DEFAULT_SHAPES)}")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="default: 1 8 32 128")
    parser.add_argument("--modes", nargs="+", default=None, type=str.upper,
                        choices=["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"],
                        help="default: NONE PIECEWISE FULL")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps discarded per batch size")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--context-len", type=int, nargs="+", default=None,
                        help="long-context runs: prompt lengths to decode at (each batch size at each; "
                             "replaces --prompt-len, raises --max-model-len to fit)")
    parser.add_argument("--max-kv-tokens", type=int, default=None,
                        help="skip batch size x context products above this (with --context-len)")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                        help="the engine's async_scheduling (auto: on for CUDA)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--hf-max-batch", type=int, default=None,
                        help="run HF only up to this batch size (e.g. to skip HF bs 128 on the 8B shape)")
    parser.add_argument("--tensor-parallel-size", "-tp", nargs="+", type=int, default=[1],
                        help="tensor-parallel sizes to run each mode at (one GPU per rank), e.g. 1 2")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: smollm2-135m, batch sizes 1 32, warmup 3, steps 10")
    add_out_argument(parser)
    parser.add_argument("--no-plot", action="store_true", help="do not write DIR/decode.png")
    parser.add_argument("-v", "--verbose", action="store_true", help="engine INFO logs (capture, KV cache)")
    # For a CPU smoke run of the code paths (every mode resolves to NONE there); not a benchmark.
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help=argparse.SUPPRESS)
    parser.add_argument("--num-layers", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes = args.shapes or ["smollm2-135m"]
        args.batch_sizes = args.batch_sizes or [1, 32]
        args.warmup, args.steps = min(args.warmup, 3), min(args.steps, 10)
    args.shapes = args.shapes or DEFAULT_SHAPES
    args.batch_sizes = sorted(set(args.batch_sizes or [1, 8, 32, 128]))
    args.modes = args.modes or ["NONE", "PIECEWISE", "FULL"]
    if min(args.tensor_parallel_size) < 1:
        parser.error("--tensor-parallel-size: sizes must be >= 1")
    args.tensor_parallel_size = list(dict.fromkeys(args.tensor_parallel_size))
    if args.steps < 1 or args.warmup < 0 or min(args.batch_sizes) < 1:
        parser.error("--steps must be >= 1, --warmup >= 0, batch sizes >= 1")
    args.contexts = args.context_len or [args.prompt_len]
    if min(args.contexts) < 1:
        parser.error("--context-len values must be >= 1")
    if args.context_len:
        args.prompt_len = max(args.contexts)
        needed = max(c + max_tokens_for(b, args, c) for c, b in cases(args)) if cases(args) else 0
        args.max_model_len = max(args.max_model_len, -(-needed // BLOCK_SIZE) * BLOCK_SIZE)
        if not cases(args):
            parser.error("--max-kv-tokens leaves no batch size x context to run")
    if any(c + max_tokens_for(b, args, c) > args.max_model_len for c, b in cases(args)):
        parser.error("--prompt-len plus the steps do not fit in --max-model-len")
    return args


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the tables and return the figures (also written under --out)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("graphrunner bench decode needs a CUDA GPU (torch sees none)")
    device = torch.device(args.device)
    elem = DTYPES[args.dtype].itemsize
    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    started = time.perf_counter()
    bandwidth = copy_bandwidth(device)
    free_memory()
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")

    engines: list[EngineFigures] = []
    rows: list[Row] = []
    hf: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        for shape in args.shapes:
            folder = write_config(shape, Path(tmp) / shape, dtype=args.dtype, **overrides)
            for tp in args.tensor_parallel_size:
                for mode in args.modes:
                    figures, mode_rows = bench_engine(shape, folder, mode, args, tp)
                    engines.append(figures)
                    rows.extend(mode_rows)
            hf_sizes = [b for b in args.batch_sizes if args.hf_max_batch is None or b <= args.hf_max_batch]
            if not args.no_hf and hf_sizes:
                hf[shape] = bench_hf(folder, hf_sizes, args)

    for r in rows:
        weights = parameter_bytes(r.shape, elem, **overrides)
        kv = r.batch_size * r.context * kv_bytes_per_token(r.shape, elem, **overrides)
        r.floor_ms = (weights + kv) / r.tensor_parallel_size / bandwidth * 1e3
        r.pct_of_floor = 100 * r.floor_ms / r.ms_per_step
        r.hf_ms_per_step = hf.get(r.shape, {}).get(r.batch_size)
        if r.hf_ms_per_step is not None:
            r.speedup_vs_hf = r.hf_ms_per_step / r.ms_per_step

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    import transformers
    result = {
        "device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
        "dtype": args.dtype, "prompt_len": args.prompt_len, "warmup_steps": args.warmup, "timed_steps": args.steps,
        "async_scheduling": args.async_scheduling, "tensor_parallel_sizes": args.tensor_parallel_size,
        "max_model_len": args.max_model_len, "copy_bandwidth_bytes_per_s": bandwidth,
        "num_layers_override": args.num_layers, "seconds": time.perf_counter() - started,
        "engines": [asdict(e) for e in engines],
        "rows": [asdict(r) for r in rows],
        "hf_ms_per_step": {shape: {str(b): ms for b, ms in per.items()} for shape, per in hf.items()},
    }
    write_json(args.out, "decode.json", result)
    if args.out is not None and not args.no_plot:
        plot(rows, hf, args.shapes, result_path(args.out, "decode.png"),
             f"decode step, {device_name}, {args.dtype}, prompt {args.prompt_len}, median of {args.steps}")
    print(f"\n{device_name}, {args.dtype}, prompt {args.prompt_len} tokens, median of {args.steps} decode steps "
          f"after {args.warmup}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; total {result['seconds']:.0f} s\n")
    print(capture_table(engines))
    print()
    print(main_table(rows))
    if len(args.tensor_parallel_size) > 1:
        print()
        print(tp_ratio_table(rows))
    if args.context_len:
        print(f"\nLong context (floor: weights as streamed + live KV once at {bandwidth / 1e9:.0f} GB/s; "
              f"prefill: tokens of the batch's prompts / time to every first token)\n")
        print(long_context_table(rows))
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
