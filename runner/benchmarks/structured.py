"""What structured output costs: decode throughput at batch B with and without a constraint.

    graphrunner bench structured --out DIR [--model DIR | --shape llama-3.2-1b] [--batch 32]
        [--steps 256] [--constraint json-string|any-text] [--tokenizer PATH]
    graphrunner bench structured --out DIR --cpu-small      # CPU smoke run (a 2-layer SmolLM2)
    graphrunner bench structured --out DIR --xgrammar-only [--tokenizer PATH] [--rows 32 256]

Dummy weights of the model's shape (load_format="dummy"), so the text is noise and only the
per-step cost is meaningful. Both runs feed the same B prompts and generate greedily with
ignore_eos; the constrained run adds one constraint to every request, chosen to keep the batch
whole for most of the run: `json-string` (default) is the JSON schema
{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}, whose
string value admits nearly every token, so the matchers fill real JSON-grammar masks each step
and the noise rarely closes the object; `any-text` is the regex `(.|\\n)*`. A request whose
grammar ends (the string closed, then EOS) leaves the batch early; the run reports how many did.
The figure compared is taken over the decode steps whose outputs cover the whole batch (a step
with fewer rows is not a step at batch B: counting its tokens would charge the smaller batch to
structured output); the ratio over all steps is printed beside it.

The engine is driven step by step (`LLMEngine.step`): the first steps (prefill) are excluded;
decode throughput = decode tokens / decode seconds. The figure compared is the ratio of the two
decode throughputs at batch B; the overhead includes everything structured output adds per
step: the matchers' accepts (under async scheduling, of the step in flight's tokens, just before
the next step's fill), filling the bitmask rows on the host (while the forward runs), the copy,
and the argmax of the masked logits instead of the graph's greedy tokens.

The tokenizer defaults to the embedded SmolLM2's (a dummy checkpoint has none); with a larger
model vocabulary the bitmask covers the model's vocabulary and ids past the tokenizer's are
never allowed. Raw per-step times go to DIR/structured.json. `--host-profile` then prints the host
functions of one more constrained run (cProfile), to see what the step's host chain spends.

`--xgrammar-only` times, without a model, what xgrammar costs the host per step for R matchers
inside the JSON string: the accepts (one `accept_token` call per matcher and xgrammar's
`batch_accept_token`) and the batched fill at 1 to 16 threads; the manager's choices
(runner/structured_output/manager.py) follow these figures. Raw figures go to DIR/xgrammar.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

CONSTRAINTS = {
    "json-string": {"json": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
    "any-text": {"regex": "(.|\\n)*"},
}


def _shape_folder(shape: str, folder: Path, num_layers: int | None) -> Path:
    """A config folder of a named shape (runner/benchmarks/model_shapes.py, or in an older source
    tree scripts/model_shapes.py)."""
    try:
        from runner.benchmarks.model_shapes import write_config
    except ImportError:
        scripts = Path(__file__).resolve().parents[2] / "scripts"
        if not (scripts / "model_shapes.py").is_file():
            raise SystemExit("--shape needs model_shapes.py; pass --model DIR instead") from None
        sys.path.insert(0, str(scripts))
        from model_shapes import write_config
    overrides = {} if num_layers is None else {"num_hidden_layers": num_layers}
    return write_config(shape, folder / shape, **overrides)


def _run(engine, prompts, params) -> dict:
    """Add every request, step until done; per-step seconds and tokens produced."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"bench-{i}")
    step_seconds, step_tokens, finished = [], [], {}
    sync = None
    if engine.device.type == "cuda":
        import torch
        sync = torch.cuda.synchronize
        sync()
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        step_seconds.append(time.perf_counter() - started)
        step_tokens.append(len(outputs))
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
    if sync is not None:
        sync()
    errors = [o.error for o in finished.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    early = sum(len(o.outputs[0].token_ids) < params.max_tokens for o in finished.values())
    skip = 2  # the prefill step (and under async scheduling the step that only launches it)
    decode_seconds, decode_tokens = sum(step_seconds[skip:]), sum(step_tokens[skip:])
    whole = [(seconds, tokens) for seconds, tokens in zip(step_seconds[skip:], step_tokens[skip:])
             if tokens == len(prompts)]
    whole_seconds = sum(seconds for seconds, _ in whole)
    return {"step_seconds": step_seconds, "step_tokens": step_tokens, "ended_early": early,
            "decode_seconds": decode_seconds, "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
            "whole_batch_steps": len(whole),
            "whole_batch_tok_s": sum(tokens for _, tokens in whole) / whole_seconds if whole_seconds else 0.0,
            "median_step_ms": 1e3 * statistics.median(step_seconds[skip:]) if len(step_seconds) > skip else 0.0}


def _print_host_profile(run, top: int = 15) -> None:
    """The host functions of one constrained run, by own time (cProfile; it inflates every Python
    call, so compare the rows with each other, not with the unprofiled step time)."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    result = run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    steps = len(result["step_seconds"])
    print(f"host profile of one structured run ({steps} steps), top {top} by own time:")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-4000:])


def _time_ms(fn, repeats: int = 200) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - started) / repeats


def xgrammar_costs(tokenizer, rows: int, thread_counts=(1, 2, 4, 8, 16)) -> dict:
    """ms per call for `rows` matchers of the `json-string` constraint, each inside the string
    (accepting a word keeps it there, so every repeat sees the same state's work): the accepts one
    call per matcher and batched, and the batched fill per thread count."""
    import torch
    import xgrammar as xgr

    from runner.structured_output.grammar import grammar_vocab_size
    vocab = grammar_vocab_size(tokenizer, 1 << 30)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(CONSTRAINTS["json-string"]["json"]))
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
    for matcher in matchers:
        for token in tokenizer.encode('{"text": "hello', add_special_tokens=False):
            if not matcher.accept_token(token):
                raise RuntimeError("the tokenizer's encoding of the JSON prefix is refused by the grammar")
    word = tokenizer.encode(" world", add_special_tokens=False)[0]
    tokens = [word] * rows
    bitmask = torch.zeros((rows, -(-vocab // 32)), dtype=torch.int32)
    indices = list(range(rows))
    costs = {"rows": rows, "vocab": vocab,
             "accept_per_matcher_ms": _time_ms(lambda: [m.accept_token(t) for m, t in zip(matchers, tokens)]),
             "accept_batched_ms": _time_ms(lambda: xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)),
             "fill_ms_by_threads": {}}
    for threads in thread_counts:
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        costs["fill_ms_by_threads"][threads] = _time_ms(
            lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask, indices))
    return costs


def _xgrammar_only(args) -> int:
    from runner.structured_output.manager import fill_threads
    from runner.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer or _embedded())
    results = []
    for rows in args.rows:
        costs = xgrammar_costs(tokenizer, rows)
        results.append(costs)
        fills = ", ".join(f"{threads}: {ms:.3f}" for threads, ms in costs["fill_ms_by_threads"].items())
        print(f"{rows} matchers (vocab {costs['vocab']}): accept {costs['accept_per_matcher_ms']:.3f} ms one call "
              f"each, {costs['accept_batched_ms']:.3f} ms batched; fill ms by threads {{{fills}}}; the manager "
              f"fills {rows} rows on {fill_threads(rows)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "xgrammar.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _embedded() -> str:
    from models.embedded import ensure_smollm2
    return str(ensure_smollm2())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for structured.json")
    parser.add_argument("--model", help="HF config folder (dummy weights); default: the embedded SmolLM2's")
    parser.add_argument("--shape", help="a model_shapes.py shape (llama-3.2-1b, ...) instead of --model")
    parser.add_argument("--num-layers", type=int, help="override the shape's layer count")
    parser.add_argument("--tokenizer", help="default: the embedded SmolLM2's")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=256, help="max_tokens of every request")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--constraint", choices=sorted(CONSTRAINTS), default="json-string")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=2, help="alternating free/structured runs; best of each")
    parser.add_argument("--cpu-small", action="store_true", help="CPU smoke: 2 layers, batch 4, 8 steps, fp32")
    parser.add_argument("--host-profile", action="store_true",
                        help="after the timed runs, one more structured run under cProfile: its top functions")
    parser.add_argument("--xgrammar-only", action="store_true",
                        help="no model: time xgrammar's accepts and fill for --rows matchers")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256], help="matchers, with --xgrammar-only")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.xgrammar_only:
        return _xgrammar_only(args)
    if args.cpu_small:
        args.device, args.dtype, args.batch, args.steps, args.prompt_len, args.repeats = "cpu", "float32", 4, 8, 8, 1
        args.num_layers = args.num_layers or 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    import tempfile

    import torch

    from configs import SamplingParams, StructuredOutputsParams
    from models.embedded import ensure_smollm2
    from runner.engine import LLMEngine

    # The embedded model is built only where it is needed: no --tokenizer, or no --shape/--model.
    needs_embedded = args.tokenizer is None or not (args.shape or args.model)
    embedded = str(ensure_smollm2()) if needs_embedded else None
    with tempfile.TemporaryDirectory(prefix="bench_structured_") as tmp:
        if args.shape:
            model = str(_shape_folder(args.shape, Path(tmp), args.num_layers))
        elif args.num_layers:
            config = json.loads(Path(args.model or embedded, "config.json").read_text())
            config["num_hidden_layers"] = args.num_layers
            folder = Path(tmp) / "model"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            model = str(folder)
        else:
            model = args.model or embedded
        options = dict(model=model, tokenizer=args.tokenizer or embedded, load_format="dummy", dtype=args.dtype,
                       device=args.device, max_model_len=args.prompt_len + args.steps + 16,
                       max_num_seqs=max(args.batch, 1))
        if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
            options["num_kv_blocks"] = args.batch * (-(-(args.prompt_len + args.steps + 16) // 16)) + 16
        engine = LLMEngine.from_kwargs(**options)
        try:
            vocab = min(engine.spec.vocab_size, 10000)
            prompts = [[(i * 7919 + j * 104729) % vocab for j in range(args.prompt_len)] for i in range(args.batch)]
            free = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps)
            constrained = free.model_copy(update={
                "structured_outputs": StructuredOutputsParams(**CONSTRAINTS[args.constraint])})
            # Warm-up at the timed batch size: the grammar's compile, and the kernels first launched
            # for B rows (the masked argmax's variant for B rows), happen here, not in a timed step.
            _run(engine, prompts, free.model_copy(update={"max_tokens": 4}))
            _run(engine, prompts, constrained.model_copy(update={"max_tokens": 4}))
            runs = {"free": [], "structured": []}
            for _ in range(args.repeats):
                runs["free"].append(_run(engine, prompts, free))
                runs["structured"].append(_run(engine, prompts, constrained))
            if args.host_profile:
                _print_host_profile(lambda: _run(engine, prompts, constrained))
            device = engine.device
            device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            async_scheduling = engine.async_scheduling
            graph_mode = engine.model_runner.cudagraph_mode.name
        finally:
            engine.shutdown()
    best = {name: max(results, key=lambda r: r["whole_batch_tok_s"]) for name, results in runs.items()}
    ratio = (best["structured"]["whole_batch_tok_s"] / best["free"]["whole_batch_tok_s"]
             if best["free"]["whole_batch_tok_s"] else 0.0)
    all_steps = {name: max(r["decode_tok_s"] for r in results) for name, results in runs.items()}
    summary = {"model": args.shape or args.model or "smollm2-135m (embedded config)", "num_layers": args.num_layers,
               "device": device_name, "dtype": args.dtype, "cudagraph_mode": graph_mode,
               "async_scheduling": async_scheduling, "batch": args.batch, "steps": args.steps,
               "prompt_len": args.prompt_len, "constraint": args.constraint,
               "free_decode_tok_s": best["free"]["whole_batch_tok_s"],
               "structured_decode_tok_s": best["structured"]["whole_batch_tok_s"],
               "structured_whole_batch_steps": best["structured"]["whole_batch_steps"],
               "free_median_step_ms": best["free"]["median_step_ms"],
               "structured_median_step_ms": best["structured"]["median_step_ms"],
               "throughput_ratio": ratio, "overhead_percent": 100 * (1 - ratio),
               "all_steps_throughput_ratio": (all_steps["structured"] / all_steps["free"]
                                              if all_steps["free"] else 0.0),
               "structured_ended_early": best["structured"]["ended_early"], "torch": torch.__version__}
    print(f"{summary['model']} ({device_name}, {args.dtype}, {graph_mode}, async={async_scheduling}), batch "
          f"{args.batch}, {args.steps} steps, {args.constraint}: free {summary['free_decode_tok_s']:.0f} tok/s "
          f"({summary['free_median_step_ms']:.2f} ms/step), structured {summary['structured_decode_tok_s']:.0f} tok/s "
          f"({summary['structured_median_step_ms']:.2f} ms/step) over the steps of the whole batch: ratio "
          f"{ratio:.3f}, overhead {summary['overhead_percent']:.1f}%; all steps, with the "
          f"{summary['structured_ended_early']} requests that ended early: ratio "
          f"{summary['all_steps_throughput_ratio']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
