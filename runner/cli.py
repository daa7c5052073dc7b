"""graphrunner: generate text with an LLM from the command line, or run a benchmark.

Errors print as one line (`graphrunner: error: ...`; `--verbose` adds the traceback). Exit
status: 0 when every prompt completed, 1 when any prompt failed or the engine could not start,
2 for bad usage (an unknown option or an invalid value).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback

from configs.graph_mode import CUDAGraphMode


def _one_line(error: BaseException) -> str:
    """`Type: message` on one line (multi-line messages, e.g. pydantic's, joined with '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {'; '.join(lines)}" if lines else type(error).__name__


def _usage_line(error: BaseException, parser: argparse.ArgumentParser) -> str:
    """A bad option value in one line naming what the user set: each of pydantic's errors as
    `--field-name: message (got value)` where the field is one of `parser`'s flags (the configs'
    field names are the flags' names with dashes), else as `Config.field: ...` (a field inside a
    JSON option such as --kernel-config); anything else as `_one_line`."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return _one_line(error)
    flags = set(parser._option_string_actions)
    for action in parser._actions:   # and every subcommand's flags
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.update(sub._option_string_actions)
    parts = []
    for item in errors():
        fields = [part for part in item.get("loc", ()) if isinstance(part, str)]
        got = f" (got {item['input']!r})" if "input" in item and not isinstance(item["input"], dict) else ""
        message = f"{item['msg']}{got}"
        if fields:
            flag = f"--{fields[-1].replace('_', '-')}"
            where = flag if flag in flags else ".".join([getattr(error, "title", "config"), *fields])
            message = f"{where}: {message}"
        parts.append(message)
    return "; ".join(parts)


def _read_prompts(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The `prompt` fields of a JSONL file; a missing file or a bad line is a usage error."""
    prompts = []
    try:
        with open(path) as handle:
            lines = list(handle)
    except OSError as error:
        parser.error(f"--prompts-file: cannot read {path!r}: {error.strerror}")
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            parser.error(f"--prompts-file {path}:{line_no}: not JSON ({error})")
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            parser.error(f"--prompts-file {path}:{line_no}: expected an object with a string 'prompt' field")
        prompts.append(record["prompt"])
    return prompts


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Options any command that builds an engine takes: whole sub-configs as JSON (vLLM's
    `--compilation-config` form), so every switch of configs/ is reachable without new flags."""
    parser.add_argument("--kernel-config", type=json.loads, metavar="JSON",
                        help='KernelConfig fields (configs/kernel_config.py), e.g. \'{"pdl": false}\'')
    parser.add_argument("--compilation-config", type=json.loads, metavar="JSON",
                        help='CompilationConfig fields, e.g. \'{"step_graph": false, "compile_threads": 0}\'')
    parser.add_argument("--download-dir", help="where model 'default' builds its checkpoint (ModelConfig.download_dir)")


def config_options(args: argparse.Namespace) -> dict:
    """The `LLM(...)` keyword arguments of `add_config_arguments`' options that were given."""
    options = {}
    for name in ("kernel_config", "compilation_config", "download_dir"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return options


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pydantic import ValidationError

    from configs import EngineConfig, SamplingParams
    from runner.llm import LLM

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += _read_prompts(parser, args.prompts_file)
    if not prompts:
        prompts = ["What is the capital of France?"]
    options = {"device": args.device, "dtype": args.dtype, "seed": args.seed, "cudagraph_mode": args.cudagraph_mode,
               "check_finite_weights": args.check_finite_weights}
    for name in ("max_model_len", "max_num_seqs", "kv_cache_memory", "threads"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.pipeline_parallel_size != 1:  # 0 or less: the config says which field is wrong
        options["pipeline_parallel_size"] = args.pipeline_parallel_size
    if args.tensor_parallel_size != 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    options.update(config_options(args))
    try:  # invalid option values are usage errors (exit 2), named by their field
        EngineConfig.from_kwargs(model=args.model, **options)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    except (ValidationError, ValueError, TypeError) as error:
        parser.error(_usage_line(error, parser))
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
    failed = [o for o in outputs if o.error is not None or any(c.finish_reason == "abort" for c in o.outputs)]
    if failed:
        print(f"graphrunner: error: {len(failed)} of {len(outputs)} prompts failed", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pydantic import ValidationError

    from runner.server.api_server import configs_from_args, serve
    try:  # invalid option values are usage errors (exit 2), named by their flag
        configs = configs_from_args(args)
    except (ValidationError, ValueError, TypeError) as error:
        parser.error(_usage_line(error, parser))
    return serve(args, configs)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Import runner.benchmarks.<which> from the installed package and call its main(rest)."""
    import importlib

    from runner.benchmarks import available
    names = available()
    if args.which not in names:
        parser.error(f"no benchmark {args.which!r}; available: {', '.join(names)}")
    module = importlib.import_module(f"runner.benchmarks.{args.which}")
    return module.main(list(args.rest)) or 0


def _bench_list() -> str:
    from runner.benchmarks import available
    lines = ["benchmarks (runner/benchmarks/NAME.py; `graphrunner bench NAME --help` for each one's options):"]
    lines += [f"  {name:<16} {summary}" for name, summary in available().items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphrunner", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1])
    verbose_help = "log progress, and print the traceback of an error"
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    gen = sub.add_parser("generate", help="generate text for prompts",
                         description="Generate text for each prompt and print it with its finish reason.")
    gen.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    gen.add_argument("--model", default="default", help="HF checkpoint folder, or 'default' (embedded SmolLM2)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="JSONL file of {\"prompt\": ...} objects")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=0, help="random seed of the engine and of sampling")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="weights and activations; auto: the checkpoint's")
    gen.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE", type=str.upper,
                     choices=[m.name for m in CUDAGraphMode], help="CUDA graph mode (NONE on a CPU)")
    gen.add_argument("--max-model-len", type=int, help="longest prompt plus output; default: the model's")
    gen.add_argument("--max-num-seqs", type=int, help="most sequences in one step (SchedulerConfig.max_num_seqs)")
    gen.add_argument("--kv-cache-memory", metavar="BYTES",
                     help="CPU KV cache size, e.g. 2GiB or 512MB (CacheConfig.kv_cache_memory); default: what "
                          "max-num-seqs sequences of max-model-len tokens use, at most 4 GiB")
    gen.add_argument("--threads", type=int, help="CPU threads of torch's operators (ParallelConfig.threads); "
                                                 "default: one per core")
    gen.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="processes, each with a slice of the layers")
    gen.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="processes, each with a 1/N slice of every layer (x pipeline-parallel-size in all)")
    gen.add_argument("--check-finite-weights", action=argparse.BooleanOptionalAction, default=True,
                     help="fail at load when a weight is NaN or Inf")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_config_arguments(gen)
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    from runner.server.api_server import add_serve_args
    add_serve_args(serve)
    serve.set_defaults(func=_serve)
    bench = sub.add_parser("bench", help="run a benchmark of runner/benchmarks/ (raw results go to --out DIR)",
                           description="graphrunner bench NAME [ARGS...]: run the benchmark NAME with its own "
                                       "arguments (most take --out DIR for their raw results).",
                           epilog=_bench_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("which", metavar="NAME", help="a benchmark listed below")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args, parser)
    except KeyboardInterrupt:
        print("graphrunner: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # one line for users; the traceback with --verbose
        if args.verbose:
            traceback.print_exc()
        print(f"graphrunner: error: {_one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
