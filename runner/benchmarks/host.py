"""Host time of one engine decode step on a CPU: everything `LLMEngine.step()` does besides the model.

    graphrunner bench host [--batch-sizes 1 8 32 128] [--steps 100] [--warmup 20] [--repeats 3]
        [--prompt-len 32] [--tokenizer none smollm2] [--threads 1] [--out DIR]
        [--profile [--profile-batch-size 32] [--top 30]]

Why: with CUDA graphs a decode step's GPU time is small (tenths of a ms for small models at
batch 32), so the Python around the forward (scheduling, input preparation, attention metadata,
the scheduler update, detokenization, outputs) decides the step time unless it stays well under
it. That host work is the same Python on a CPU as on the GPU machine's host, so it can be
measured and optimised here in seconds, without a GPU.

What it measures: `host ms`, with the definition of runner/benchmarks/decode.py (same `StepMarks`):
(start -> forward) + (sampled -> end), where `start`/`end` are taken around `engine.step()`,
`forward` just before the model runner calls the model (after inputs and attention metadata
are built) and `sampled` just after its `sample` returned the tokens to the host. So the
forward and the logits + sampling are excluded; everything else in the step is in.

What it does not show: the GPU path's own host costs (the host-to-device copies of the step's
inputs, a few µs each) and the speed of a GPU server's CPU, which may differ from the one this
runs on by 2x either way: compare figures taken on one machine only.

Setup: the SmolLM2-135M shape cut to one tiny layer (hidden 16) with random (`load_format=
"dummy"`) fp32 weights. Without a tokenizer the vocabulary is cut to 512 tokens too, so the
(excluded) forward evicts little of the CPU caches, as a GPU forward would not; with SmolLM2's
tokenizer it must stay 49152 tokens, and the logits (6 MB at batch 32) flush the caches, which
makes that variant's host figures pessimistic. B requests of `--prompt-len` tokens (greedy,
ignore_eos, max_tokens large enough never to finish) are prefilled, `--warmup` decode steps are
discarded, then
`--steps` decode steps are timed (every one a uniform decode batch of B). Median over the steps
of each repeat, then the median over `--repeats` repeats (the machine may be shared: medians
resist other processes' bursts). `--tokenizer none`: the checkpoint has no tokenizer (no
detokenization, as when token ids are served); `smollm2`: SmolLM2's tokenizer files (from the
embedded model, built on first use), so the incremental detokenizer runs every step. A random
model repeats one token forever, often a lone byte that never decodes, which no served model
does; so with a tokenizer the sampled tokens are replaced (inside the excluded sampling region)
by the tokens of a real text, `TEXT`, each request at its own offset.

`--profile` then runs `--steps` more decode steps of `--profile-batch-size` under cProfile and
prints the top functions by own time (forward included: look for the host functions).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runner.benchmarks.decode import Clock, StepMarks
from runner.benchmarks.model_shapes import write_config
from runner.benchmarks.results import add_out_argument, torch_threads, write_json

TINY_OVERRIDES = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8)
"""The SmolLM2 shape cut down so the forward is cheap (it is excluded anyway)."""
SMALL_VOCAB = 512
"""The vocabulary without a tokenizer (prompts use ids 100..499)."""
BLOCK_SIZE = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps out of habit: "
        "one hundred and twelve. From the lamp room he could see the harbour, the café on the quay, the naïve "
        "tourists photographing gulls, and far out, the ferry to Île-d'Yeu. He wrote in his log — wind west, "
        "sea moderate, visibility good — and, since nobody read it, a line of verse now and then. "
        "Tonight: 灯台 (lighthouse), a word his granddaughter taught him, and a small 🌊 for the tide.\n")
"""Stands in for the model's choices when a tokenizer is on (English, some accents, CJK, an emoji)."""


class TextTokens:
    """Replaces the sampled tokens by those of `TEXT`, request by request, in a loop."""

    def __init__(self, runner, tokenizer) -> None:
        self.tokens = tokenizer.encode(TEXT, add_special_tokens=False)
        self.position: dict[str, int] = {}
        self.runner, self.sample = runner, runner.sample

        def sample(*args, **kwargs):
            result = self.sample(*args, **kwargs)
            result.sampled = {request_id: self._next(request_id) for request_id in result.sampled}
            return result

        runner.sample = sample

    def _next(self, request_id: str) -> int:
        position = self.position.get(request_id, 7 * len(self.position))
        self.position[request_id] = position + 1
        return self.tokens[position % len(self.tokens)]

    def restore(self) -> None:
        self.runner.sample = self.sample


@dataclass
class Row:
    tokenizer: str
    batch_size: int
    host_ms: float
    host_us_per_request: float
    step_ms: float
    forward_sample_ms: float
    host_ms_repeats: list[float]


def make_checkpoint(folder: Path, tokenizer: str, max_model_len: int) -> Path:
    vocab = {} if tokenizer == "smollm2" else {"vocab_size": SMALL_VOCAB}
    write_config("smollm2-135m", folder, dtype="float32", max_position_embeddings=max_model_len, **TINY_OVERRIDES,
                 **vocab)
    if tokenizer == "smollm2":
        from models.embedded import ensure_smollm2
        source = ensure_smollm2()
        for name in TOKENIZER_FILES:
            shutil.copy(source / name, folder / name)
    return folder


def build_engine(folder: Path, args, max_model_len: int):
    from runner import LLMEngine
    max_batch = max(args.batch_sizes + [args.profile_batch_size if args.profile else 1])
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    return LLMEngine.from_kwargs(model=str(folder), load_format="dummy", dtype="float32", device="cpu",
                                 max_num_seqs=max_batch, max_model_len=max_model_len, block_size=BLOCK_SIZE,
                                 num_kv_blocks=max_batch * blocks_per_request + 1,
                                 max_num_batched_tokens=max(2048, max_batch * args.prompt_len))


def start_decoding(engine, batch_size: int, args, tag: str) -> list[str]:
    """Add `batch_size` requests and step until every one has its first token."""
    from configs import SamplingParams
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps * (args.repeats + 1) + 100)
    ids = [engine.add_request([(7 * i + j) % 400 + 100 for j in range(args.prompt_len)], params,
                              request_id=f"{tag}-{i}") for i in range(batch_size)]
    started: set[str] = set()
    while len(started) < batch_size:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    return ids


def timed_steps(engine, marks: StepMarks, clock: Clock, batch_size: int, count: int) -> list[dict]:
    """Run `count` decode steps with the four marks recorded; each must serve the whole batch."""
    recorded = []
    for step in range(count):
        current = marks.arm()
        outputs = engine.step()
        marks.disarm()
        if len(outputs) != batch_size or any(o.finished for o in outputs):
            raise RuntimeError(f"decode step {step}: {len(outputs)} outputs for {batch_size} running requests")
        recorded.append(current)
    return recorded


def bench_batch(engine, tokenizer: str, batch_size: int, args) -> Row:
    clock = Clock(torch.device("cpu"))
    text = TextTokens(engine.model_runner, engine.tokenizer) if engine.tokenizer is not None else None
    ids = start_decoding(engine, batch_size, args, f"bs{batch_size}")
    marks = StepMarks(clock, engine.model_runner)
    host_repeats, steps_all, inner_all = [], [], []
    try:
        timed_steps(engine, marks, clock, batch_size, args.warmup)
        for _ in range(args.repeats):
            recorded = timed_steps(engine, marks, clock, batch_size, args.steps)
            step_ms = [clock.ms(m["start"], m["end"]) for m in recorded]
            inner_ms = [clock.ms(m["forward"], m["sampled"]) for m in recorded]
            host_repeats.append(statistics.median(s - i for s, i in zip(step_ms, inner_ms)))
            steps_all += step_ms
            inner_all += inner_ms
    finally:
        marks.restore()
        if text is not None:
            text.restore()
        for request_id in ids:
            engine.abort_request(request_id)
        engine.step()  # lets the runner drop the aborted requests' state
    host = statistics.median(host_repeats)
    return Row(tokenizer=tokenizer, batch_size=batch_size, host_ms=host, host_us_per_request=host * 1e3 / batch_size,
               step_ms=statistics.median(steps_all), forward_sample_ms=statistics.median(inner_all),
               host_ms_repeats=host_repeats)


def profile(engine, args) -> None:
    import cProfile
    import pstats
    text = TextTokens(engine.model_runner, engine.tokenizer) if engine.tokenizer is not None else None
    ids = start_decoding(engine, args.profile_batch_size, args, "profile")
    for _ in range(args.warmup):
        engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    if text is not None:
        text.restore()
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()
    print(f"\ncProfile: {args.steps} decode steps at batch {args.profile_batch_size} (forward included)")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)


def print_table(rows: list[Row]) -> None:
    print("| tokenizer | batch | host ms | host µs/request | step ms | forward+sample ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.tokenizer} | {r.batch_size} | {r.host_ms:.3f} | {r.host_us_per_request:.2f} | "
              f"{r.step_ms:.3f} | {r.forward_sample_ms:.3f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="graphrunner bench host", description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per repeat")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokenizer", nargs="+", choices=["none", "smollm2"], default=["none", "smollm2"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the forward is not measured)")
    add_out_argument(parser)
    parser.add_argument("--profile", action="store_true", help="cProfile some decode steps afterwards")
    parser.add_argument("--profile-batch-size", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and return the figures (also written to DIR/host.json with --out)."""
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _run(args)


def _run(args) -> dict:
    max_model_len = args.prompt_len + args.warmup + args.steps * (args.repeats + 1) + 200
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokenizer in args.tokenizer:
            folder = make_checkpoint(Path(tmp) / tokenizer, tokenizer, max_model_len)
            engine = build_engine(folder, args, max_model_len)
            try:
                for batch_size in args.batch_sizes:
                    rows.append(bench_batch(engine, tokenizer, batch_size, args))
                if args.profile and tokenizer == args.tokenizer[-1]:
                    profile(engine, args)
            finally:
                engine.shutdown()
    print()
    print_table(rows)
    result = {"steps": args.steps, "repeats": args.repeats, "prompt_len": args.prompt_len, "threads": args.threads,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": [asdict(r) for r in rows]}
    write_json(args.out, "host.json", result)
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
