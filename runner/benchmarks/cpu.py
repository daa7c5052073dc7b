"""Engine vs HF transformers generate on a CPU: 32 prompts x 64 new tokens, same run, printed ratio.

    graphrunner bench cpu [--model default] [--prompts 32] [--tokens 64] [--repeats 3]
                          [--warmup-runs 1] [--lockstep-runs 3] [--threads N] [--warm-prefix-cache]
                          [--cpu-isa auto|avx512|avx2|neon|generic] [--out DIR]

Both sides: fp32, greedy, ignore EOS (every request makes exactly --tokens tokens), the whole
generate timed (prefill included). HF runs the whole batch in one left-padded `generate` call
with its KV cache, which is its fastest offline path; the engine runs `LLM.generate` with
continuous batching and the paged KV cache.

Both models are loaded and warmed up with one untimed run of the whole workload each (`--warmup-runs`):
a first run at full batch pays one-time costs (first touch of KV-cache pages, buffers growing to the
batch's shapes) that no later run pays, on both sides (on a 2-core VM, `graphrunner bench cpu
--warmup-runs 0 --repeats 3`: the engine's first run 230 tok/s then 315-334, HF's 228 then 241-256).
Then the two sides alternate `--repeats` times
(engine, HF, engine, HF, ...) and the medians are reported (ratio = median engine / median HF;
the per-pair ratios are printed too). On a small shared machine one other busy process slows
a 2-thread run several-fold, so a pair during which other processes used more than
`--max-other-load` cores (Linux /proc/stat) is dropped, said so, and run again.

Same work on both sides: the engine's prefix cache is emptied before every timed run, so it
computes every prompt token as HF does (otherwise the warm-up and earlier repeats would let it
skip the shared chat-template prefix and whole repeated prompts). `--warm-prefix-cache` keeps
the cache warm, which is the serving case but not an equal-work comparison.

`--cpu-isa` caps the instruction set of the engine's C kernels (KernelConfig.cpu_isa), to measure on an
AVX-512 machine what a CPU without AVX-512 gets; to take torch's own AVX-512 kernels away from both
sides too, run it with ATEN_CPU_CAPABILITY=avx2 (torch's element-wise kernels) and
MKL_ENABLE_INSTRUCTIONS=AVX2 (its GEMMs), which torch and MKL read at start-up.

Lockstep runs (`--lockstep-runs`, after the alternating pairs): the two sides interleave step by
step instead of run by run. HF's `generate` calls its stopping criteria once per generated token;
there the engine runs one `step()` (its first is the whole prefill, as HF's first token is), timed
on its own clock, and HF's time is the wall time of `generate` minus the engine's. The engine's
clock also counts its `add_request` calls (tokenizing the prompts, which HF's side does before
timing). A slow spell of a shared VM (its neighbours' memory traffic, which /proc/stat does
not show) then slows both sides within the same 0.1 s instead of one whole run: on a 2-core VM,
`graphrunner bench cpu --repeats 5 --lockstep-runs 5` gave per-pair ratios of 0.92-1.46 alternating
run by run and 1.22-1.30 in lockstep, same code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from runner.benchmarks.results import add_out_argument, torch_threads, write_json

TOPICS = ["the ocean", "a robot", "mountains", "coffee", "the moon", "a library", "trains", "winter"]


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            ticks = list(map(int, stat.readline().split()[1:9]))
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def timed(run):
    """run() -> tok/s, plus the cores' worth of CPU that OTHER processes used meanwhile (None if unknown):
    on a small shared machine, a run with load beside it is not comparable."""
    busy, own, started = _busy_seconds(), os.times(), time.perf_counter()
    tok_s = run()
    wall, busy_after, own_after = time.perf_counter() - started, _busy_seconds(), os.times()
    if busy is None or busy_after is None:
        return tok_s, None
    mine = own_after.user + own_after.system - own.user - own.system
    return tok_s, max(0.0, (busy_after - busy - mine) / wall)


def make_prompts(tokenizer, n: int) -> list[str]:
    prompts = []
    for i in range(n):
        ask = f"Write {1 + i % 4} sentences about {TOPICS[i % len(TOPICS)]}" + " in detail" * (i % 3)
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                     add_generation_prompt=True))
    return prompts


class HFSide:
    def __init__(self, path: str, prompts: list[str], tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.batch = tokenizer(prompts, return_tensors="pt", padding=True)
        self.tokens, self.num_prompts = tokens, len(prompts)
        self.kwargs = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                           pad_token_id=tokenizer.pad_token_id or 0, temperature=None, top_p=None, top_k=None)

    def run(self) -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            out = self.model.generate(**self.batch, **self.kwargs)
            seconds = time.perf_counter() - started
        assert out.shape[1] - self.batch["input_ids"].shape[1] == self.tokens
        return self.num_prompts * self.tokens / seconds


class EngineSide:
    def __init__(self, path: str, prompts: list[str], tokens: int, warm_prefix_cache: bool,
                 cpu_isa: str = "auto") -> None:
        from configs import SamplingParams
        from runner import LLM
        self.llm = LLM(model=path, dtype="float32", device="cpu", kernel_config={"cpu_isa": cpu_isa})
        self.prompts, self.tokens, self.warm = prompts, tokens, warm_prefix_cache
        self.params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def empty_prefix_cache(self) -> None:
        """Equal work: every prompt token computed, as HF does (unless --warm-prefix-cache)."""
        if not self.warm:
            assert self.llm.engine.scheduler.reset_prefix_cache(), "prefix cache still in use"

    def run(self) -> float:
        self.empty_prefix_cache()
        started = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == self.tokens for o in outs)
        return len(self.prompts) * self.tokens / seconds


def lockstep(engine: EngineSide, hf: HFSide, run: int) -> tuple[float, float]:
    """One run of each side, interleaved step by step (see the module docstring) -> (engine tok/s, HF tok/s)."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    llm_engine = engine.llm.engine
    engine.empty_prefix_cache()
    finished = []

    def engine_step() -> float:
        started = time.perf_counter()
        finished.extend(o for o in llm_engine.step() if o.finished)
        return time.perf_counter() - started

    class EngineStepPerToken(StoppingCriteria):
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds   # the engine's clock so far

        def __call__(self, input_ids, scores, **kwargs):
            if llm_engine.has_unfinished_requests():
                self.seconds += engine_step()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    started = time.perf_counter()
    for i, prompt in enumerate(engine.prompts):
        llm_engine.add_request(prompt, engine.params, f"lockstep{run}-{i}")
    hook = EngineStepPerToken(time.perf_counter() - started)
    with torch.inference_mode():
        started = time.perf_counter()
        out = hf.model.generate(**hf.batch, **hf.kwargs, stopping_criteria=StoppingCriteriaList([hook]))
        hf_seconds = time.perf_counter() - started - hook.seconds
    engine_seconds = hook.seconds
    while llm_engine.has_unfinished_requests():  # HF was done first: the engine's remaining steps
        engine_seconds += engine_step()
    assert out.shape[1] - hf.batch["input_ids"].shape[1] == hf.tokens
    assert len(finished) == len(engine.prompts) and all(len(o.outputs[0].token_ids) == engine.tokens for o in finished)
    work = len(engine.prompts) * engine.tokens
    return work / engine_seconds, work / hf_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench cpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side, alternating")
    parser.add_argument("--max-other-load", type=float, default=0.1,
                        help="drop and redo a pair when other processes used more than this many cores meanwhile")
    parser.add_argument("--max-tries", type=int, default=3, help="at most repeats * this many pairs")
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="untimed runs of the whole workload per side before timing (0: none, the first pair pays one-time costs)")
    parser.add_argument("--lockstep-runs", type=int, default=3,
                        help="runs of each side interleaved step by step (0: none), reported beside the pairs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-isa", default="auto", choices=["auto", "avx512", "avx2", "neon", "generic"],
                        help="cap on the instruction set of the engine's C kernels (KernelConfig.cpu_isa)")
    parser.add_argument("--warm-prefix-cache", action="store_true",
                        help="keep the engine's prefix cache between runs (less work than HF)")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    with torch_threads(args.threads):
        return _run(args)


def _run(args) -> int:
    from runner.engine import resolve_model_path
    from transformers import AutoTokenizer
    path = resolve_model_path(args.model)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), args.prompts)
    engine = EngineSide(path, prompts, args.tokens, args.warm_prefix_cache, args.cpu_isa)
    hf = HFSide(path, prompts, args.tokens)
    for _ in range(args.warmup_runs):
        engine.run()
        hf.run()
    engine_runs, hf_runs, others, dropped = [], [], [], []
    for _ in range(args.repeats * args.max_tries):
        if len(engine_runs) == args.repeats:
            break
        (engine_tps, engine_load), (hf_tps, hf_load) = timed(engine.run), timed(hf.run)
        if max(engine_load or 0.0, hf_load or 0.0) > args.max_other_load:
            dropped.append((engine_tps, hf_tps, engine_load, hf_load))
            print(f"dropped a pair (other processes' load {engine_load:.2f} / {hf_load:.2f} cores): "
                  f"{engine_tps:.1f} / {hf_tps:.1f} tok/s", flush=True)
            continue
        engine_runs.append(engine_tps)
        hf_runs.append(hf_tps)
        others += [engine_load, hf_load]
    if not engine_runs:
        print("WARNING: every pair had other load beside it; reporting the dropped pairs")
        for engine_tps, hf_tps, engine_load, hf_load in dropped:
            engine_runs.append(engine_tps)
            hf_runs.append(hf_tps)
            others += [engine_load, hf_load]
    engine_tps, hf_tps = statistics.median(engine_runs), statistics.median(hf_runs)
    steps = [lockstep(engine, hf, run) for run in range(args.lockstep_runs)]
    step_ratios = [e / h for e, h in steps]
    from launch import native_build
    isa = native_build.cpu_isa(args.cpu_isa)
    result = {"prompts": args.prompts, "tokens": args.tokens, "threads": torch.get_num_threads(),
              "cpu_isa": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "warm_prefix_cache": args.warm_prefix_cache, "engine_runs": [round(x, 1) for x in engine_runs],
              "hf_runs": [round(x, 1) for x in hf_runs], "engine_tok_s": round(engine_tps, 1),
              "hf_tok_s": round(hf_tps, 1), "ratio": round(engine_tps / hf_tps, 2),
              "other_load_cores": [None if x is None else round(x, 2) for x in others], "dropped_pairs": len(dropped),
              "lockstep_runs": [[round(e, 1), round(h, 1)] for e, h in steps],
              "lockstep_ratio": round(statistics.median(step_ratios), 2) if steps else None}
    write_json(args.out, "cpu.json", result)
    load = [("?" if x is None else f"{x:.2f}") for x in others]
    print("runs, engine / HF tok/s (ratio) [other processes' load in cores, engine / HF]: " + ", ".join(
        f"{e:.1f} / {h:.1f} ({e / h:.2f}x) [{load[2 * i]} / {load[2 * i + 1]}]"
        for i, (e, h) in enumerate(zip(engine_runs, hf_runs))))
    if steps:
        print("lockstep runs, engine / HF tok/s (ratio): " + ", ".join(f"{e:.1f} / {h:.1f} ({e / h:.2f}x)"
                                                                      for e, h in steps))
    cache = "warm" if args.warm_prefix_cache else "emptied before each run"
    print(f"C kernels' instruction set: {isa} (--cpu-isa {args.cpu_isa}); torch's CPU kernels: "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| method | engine tok/s | HF generate tok/s | ratio | threads | prefix cache |\n|---|---|---|---|---|---|")
    print(f"| whole runs, alternating | {engine_tps:.1f} | {hf_tps:.1f} | {engine_tps / hf_tps:.2f}x | "
          f"{torch.get_num_threads()} | {cache} |")
    if steps:
        print(f"| lockstep (median ratio) | {statistics.median(e for e, _ in steps):.1f} | "
              f"{statistics.median(h for _, h in steps):.1f} | {statistics.median(step_ratios):.2f}x | "
              f"{torch.get_num_threads()} | {cache} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
