"""Offline throughput, nano-vllm's recipe: 256 random requests through `LLM.generate`, end to end.

    graphrunner bench throughput [--shape qwen3-0.6b] [--mode FULL_AND_PIECEWISE]
        [--num-seqs 256] [--min-len 100] [--max-input-len 1024] [--max-output-len 1024] [--out DIR]
    graphrunner bench throughput --cpu-small     # CPU smoke: 4-layer SmolLM2 shape, 16 short requests
    graphrunner bench throughput --profile-kernels 25   # then where a run's device time goes

As nano-vllm's bench.py: `random.seed(0)`; per request a prompt of `randint(100, max_input_len)`
token ids drawn with `randint(0, 10000)`, then per request `SamplingParams(temperature=0.6,
ignore_eos=True, max_tokens=randint(100, max_output_len))`; max_model_len 4096; dummy weights in
bf16 (the Qwen3-0.6B shape of runner/benchmarks/model_shapes.py). One short warm-up generate, then the timed
`llm.generate(prompts, params)`. Output tok/s = generated tokens / seconds (nano-vllm's
"Throughput"); total tok/s counts the prompt tokens too. Engine start-up is not timed.

`--cpu-small`: the SmolLM2-135M shape cut to 4 layers, 16 requests of 16-64 prompt and output
tokens, fp32 on the CPU (well under 2 minutes on 2 cores); for CI, not a benchmark.

Bandwidth bound: the time the device would need just to read the weights and every live KV
entry once per step, sum over the timed run's steps of (weight bytes + live KV bytes of that
step) / bandwidth. The scheduler counts the steps and, per step, the KV entries attention reads
(every scheduled request's context after the step: Scheduler.num_kv_tokens_attended, a plain
counter); weight bytes are those a step streams (model_shapes.parameter_bytes: the LM head, not
a separate embedding table). The bandwidth is measured in the same run by a large device copy
(decode.copy_bandwidth: bytes read + written / time), or given with --bandwidth-gbs (e.g. the
nominal figure). `bound/measured` is the share of the bound reached: 100% would mean the run did
nothing but stream weights and KV at copy speed.

`--profile-kernels N` (a GPU): after the timed run, one more run of a workload of the next seed
(new prompts: the timed ones would hit the prefix cache) under torch.profiler, its device kernels
totalled per name (runner/benchmarks/kernel_profile.py): the N longest, the device's busy time,
and attention's time against the KV part of that run's bound (attention reading every live KV
entry once per step at the copy bandwidth would take exactly that part). The profiler slows the
run; its seconds are not the benchmark's.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

from runner.benchmarks.model_shapes import SHAPES, kv_bytes_per_token, parameter_bytes, write_config
from runner.benchmarks.results import add_out_argument, write_json

CPU_SMALL = dict(shape="smollm2-135m", num_layers=4, num_seqs=16, min_len=16, max_input_len=64, max_output_len=64,
                 dtype="float32", device="cpu", max_model_len=256)


def make_workload(num_seqs: int, min_len: int, max_input_len: int, max_output_len: int, seed: int = 0):
    """nano-vllm's draw order: every prompt first, then every max_tokens. A `random.Random(seed)`
    draws exactly what `random.seed(seed)` then `random.randint` does, without touching global state."""
    from configs import SamplingParams
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(min_len, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def bandwidth_bound_s(num_steps: int, kv_tokens_attended: int, weight_bytes: int, kv_bytes_per_token: int,
                      bandwidth: float) -> float:
    """Seconds to read the weights once per step and every live KV entry of every step once:
    (num_steps * weight_bytes + kv_tokens_attended * kv_bytes_per_token) / bandwidth (bytes/s)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return (num_steps * weight_bytes + kv_tokens_attended * kv_bytes_per_token) / bandwidth


def step_counts(before: dict, after: dict) -> dict:
    """The scheduler's step and attended-KV counts of a run: `Scheduler.stats()` after minus before."""
    return {key: after[key] - before[key] for key in ("num_scheduled_steps", "num_kv_tokens_attended")}


def bound_figures(counts: dict, shape: str, dtype: str, bandwidth: float, seconds: float, **overrides) -> dict:
    """The bandwidth bound of a run from the scheduler's step and KV counts (deltas over the run)."""
    element = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    weights, per_token = parameter_bytes(shape, element, **overrides), kv_bytes_per_token(shape, element, **overrides)
    bound = bandwidth_bound_s(counts["num_scheduled_steps"], counts["num_kv_tokens_attended"], weights, per_token,
                              bandwidth)
    return {"steps": counts["num_scheduled_steps"], "kv_tokens_attended": counts["num_kv_tokens_attended"],
            "weight_bytes": weights, "kv_bytes_per_token": per_token, "bandwidth_bytes_per_s": bandwidth,
            "bound_s": bound, "bound_fraction": bound / seconds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="graphrunner bench throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default qwen3-0.6b")
    parser.add_argument("--mode", default="FULL_AND_PIECEWISE", type=str.upper,
                        choices=["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"],
                        help="cudagraph_mode (resolves to NONE on a CPU)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None, help="default auto")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="default bfloat16")
    parser.add_argument("--num-seqs", type=int, default=None, help="default 256")
    parser.add_argument("--min-len", type=int, default=None, help="lower bound of both lengths (default 100)")
    parser.add_argument("--max-input-len", type=int, default=None, help="default 1024")
    parser.add_argument("--max-output-len", type=int, default=None, help="default 1024")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 4096")
    parser.add_argument("--num-layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine default unless given")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default unless given")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="engine default unless given")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                        help="a GPU: profile one more run and print its N longest kernels (see above)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="device memory bandwidth for the bound, GB/s (default: measured by a large copy)")
    parser.add_argument("--cpu-small", action="store_true",
                        help="CPU smoke run: " + ", ".join(f"{k}={v}" for k, v in CPU_SMALL.items()))
    add_out_argument(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    defaults = dict(shape="qwen3-0.6b", device="auto", dtype="bfloat16", num_seqs=256, min_len=100,
                    max_input_len=1024, max_output_len=1024, max_model_len=4096)
    if args.cpu_small:
        defaults.update(CPU_SMALL)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.min_len <= min(args.max_input_len, args.max_output_len):
        parser.error("need 1 <= --min-len <= --max-input-len and --max-output-len")
    if args.max_input_len + args.max_output_len > args.max_model_len:
        parser.error(f"--max-input-len + --max-output-len must fit in --max-model-len ({args.max_model_len})")
    if args.profile_kernels < 0:
        parser.error("--profile-kernels must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return the figures (also written to DIR/throughput.json with --out)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    import torch
    from configs import SamplingParams
    from runner import LLM

    from runner.benchmarks.decode import copy_bandwidth

    prompts, params = make_workload(args.num_seqs, args.min_len, args.max_input_len, args.max_output_len, args.seed)
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.bandwidth_gbs is not None:
        bandwidth = args.bandwidth_gbs * 1e9
    else:  # before the engine takes its share of the device memory
        bandwidth = copy_bandwidth(torch.device("cuda" if on_cuda else "cpu"))
        if on_cuda:
            torch.cuda.empty_cache()
    options = dict(load_format="dummy", dtype=args.dtype, device=args.device, cudagraph_mode=args.mode,
                   max_model_len=args.max_model_len, seed=args.seed)
    for key in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as tmp:
        folder = write_config(args.shape, Path(tmp) / args.shape, dtype=args.dtype, **overrides)
        if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
            # Enough KV blocks for every request at once, not a quarter of the machine's memory.
            block = 16
            options["num_kv_blocks"] = sum(-(-(len(p) + sp.max_tokens) // block) for p, sp in zip(prompts, params)) \
                + -(-args.max_model_len // block)
        started = time.perf_counter()
        llm = LLM(model=str(folder), **options)
        startup = time.perf_counter() - started
        try:
            warm = [[random.Random(i).randint(0, 10000) for _ in range(16)] for i in range(4)]
            llm.generate(warm, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8), use_tqdm=False)
            if torch.cuda.is_available() and llm.engine.device.type == "cuda":
                torch.cuda.synchronize()
            before = llm.engine.scheduler.stats()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            after = llm.engine.scheduler.stats()
            counts = step_counts(before, after)
            profile = None
            if args.profile_kernels and llm.engine.device.type == "cuda":
                profile = profile_kernels(llm, args, bandwidth, overrides)
            runner = llm.engine.model_runner
            device, resolved = str(runner.device), runner.cudagraph_mode.name
            device_name = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu"
        finally:
            llm.shutdown()

    short = [(i, len(o.outputs[0].token_ids), p.max_tokens) for i, (o, p) in enumerate(zip(outputs, params))
             if len(o.outputs[0].token_ids) != p.max_tokens]
    if short:
        raise RuntimeError(f"requests stopped short of max_tokens (index, got, wanted): {short[:5]}")
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    input_tokens = sum(len(p) for p in prompts)
    result = {
        "shape": args.shape, "num_layers": args.num_layers or SHAPES[args.shape]["num_hidden_layers"],
        "mode": args.mode, "resolved_mode": resolved, "device": device, "device_name": device_name,
        "dtype": args.dtype, "num_seqs": args.num_seqs, "min_len": args.min_len,
        "max_input_len": args.max_input_len, "max_output_len": args.max_output_len,
        "input_tokens": input_tokens, "output_tokens": output_tokens, "seconds": seconds,
        "output_tok_s": output_tokens / seconds, "total_tok_s": (input_tokens + output_tokens) / seconds,
        "startup_s": startup, "torch": torch.__version__,
        "bound": bound_figures(counts, args.shape, args.dtype, bandwidth, seconds, **overrides),
        "bandwidth_source": "given" if args.bandwidth_gbs is not None else "measured copy",
    }
    bound = result["bound"]
    print(f"{args.shape} ({result['num_layers']} layers, {args.dtype}, {device_name}, {resolved}): "
          f"{args.num_seqs} seqs, {input_tokens} in + {output_tokens} out tokens in {seconds:.2f} s; "
          f"output {result['output_tok_s']:.1f} tok/s, total {result['total_tok_s']:.1f} tok/s "
          f"(start-up {startup:.1f} s)")
    print(f"  bandwidth bound: {bound['steps']} steps x {bound['weight_bytes'] / 1e9:.3f} GB of weights + "
          f"{bound['kv_tokens_attended']} KV entries x {bound['kv_bytes_per_token']} B at "
          f"{bandwidth / 1e9:.0f} GB/s ({result['bandwidth_source']}) = {bound['bound_s']:.3f} s; measured "
          f"{seconds:.3f} s = {seconds / bound['bound_s']:.2f}x the bound (bound/measured "
          f"{100 * bound['bound_fraction']:.1f}%)")
    if profile is not None:
        result["kernel_profile"] = profile
        print("\n".join(profile["lines"]))
    elif args.profile_kernels:
        print("--profile-kernels: no CUDA device, nothing profiled")
    write_json(args.out, "throughput.json", result)
    return result


def profile_kernels(llm, args: argparse.Namespace, bandwidth: float, overrides: dict) -> dict:
    """One more run (a workload of the next seed) under torch.profiler: its kernel totals, and
    attention's time against the KV part of that run's bound."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runner.benchmarks.kernel_profile import device_kernels, kernel_totals, table

    prompts, params = make_workload(args.num_seqs, args.min_len, args.max_input_len, args.max_output_len, args.seed + 1)
    before = llm.engine.scheduler.stats()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    after = llm.engine.scheduler.stats()
    counts = step_counts(before, after)
    bound = bound_figures(counts, args.shape, args.dtype, bandwidth, seconds, **overrides)
    totals = kernel_totals(device_kernels(prof))
    kv_s = counts["num_kv_tokens_attended"] * bound["kv_bytes_per_token"] / bandwidth
    attention_s = totals.matching_us("attention", excluding=("merge",)) / 1e6
    lines = [f"kernel profile (seed {args.seed + 1}, {seconds:.2f} s under the profiler, bound {bound['bound_s']:.3f} s):"]
    lines += table(totals, args.profile_kernels)
    if attention_s > 0:
        lines.append(f"attention kernels {attention_s:.3f} s against the bound's KV reads {kv_s:.3f} s "
                     f"({100 * kv_s / attention_s:.1f}% of the copy bandwidth)")
    return {"seconds": seconds, "bound_s": bound["bound_s"], "busy_s": totals.busy_us / 1e6,
            "kernel_s": totals.total_us / 1e6, "attention_s": attention_s, "kv_bound_s": kv_s,
            "top": sorted(([name, us / 1e6, n] for name, (us, n) in totals.per_name.items()), key=lambda r: -r[1])
            [:args.profile_kernels], "lines": lines}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
