"""`graphrunner generate ...` and `graphrunner bench ...`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from configs import SamplingParams
    from runner.llm import LLM

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as handle:
            for line_no, line in enumerate(handle, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or "prompt" not in record:
                        raise SystemExit(f"{args.prompts_file}:{line_no}: expected an object with a 'prompt' field")
                    prompts.append(record["prompt"])
    if not prompts:
        prompts = ["What is the capital of France?"]
    options = {"device": args.device, "dtype": args.dtype, "seed": args.seed, "cudagraph_mode": args.cudagraph_mode}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.pipeline_parallel_size > 1:
        options["pipeline_parallel_size"] = args.pipeline_parallel_size
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    with LLM(model=args.model, **options) as llm:
        started = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason, "error": output.error}))
        else:
            print(f"### {prompt}\n{completion.text if output.error is None else 'ERROR: ' + output.error}"
                  f"\n[{completion.finish_reason}, {len(completion.token_ids)} tokens]\n")
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"{len(outputs)} requests, {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s)",
          file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib
    import runpy
    from pathlib import Path
    try:  # an installed benchmark module first: works from a plain `pip install .`
        module = importlib.import_module(f"runner.benchmarks.{args.which}")
    except ModuleNotFoundError as error:
        if error.name != f"runner.benchmarks.{args.which}":
            raise
    else:
        return module.main(args.rest)
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    script = scripts / f"bench_{args.which}.py"
    if not script.is_file():
        raise SystemExit(f"no benchmark {args.which!r} (looked for {script})")
    sys.argv = [str(script)] + args.rest
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("--model", default="default", help="HF checkpoint folder, or 'default' (embedded SmolLM2)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="JSONL file of {\"prompt\": ...} objects")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    gen.add_argument("--max-model-len", type=int)
    gen.add_argument("--pipeline-parallel-size", type=int, default=1, help="processes, each with a slice of layers")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="run a benchmark (runner/benchmarks/<which>.py or scripts/bench_<which>.py)")
    bench.add_argument("which", choices=["cpu", "decode", "throughput", "attention", "sampler"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
