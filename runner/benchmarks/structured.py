"""What structured output costs: decode throughput at batch B with and without a constraint.

    graphrunner bench structured --out DIR [--model DIR | --shape llama-3.2-1b] [--batch 32]
        [--steps 256] [--constraint json-string|any-text] [--tokenizer PATH]
    graphrunner bench structured --out DIR --cpu-small      # CPU smoke run (a 2-layer SmolLM2)

Dummy weights of the model's shape (load_format="dummy"), so the text is noise and only the
per-step cost is meaningful. Both runs feed the same B prompts and generate greedily with
ignore_eos; the constrained run adds one constraint to every request. The constraint must keep
the batch whole for the run: `json-string` (default) is the JSON schema
{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}, whose
string value admits nearly every token, so the matchers fill real JSON-grammar masks each step
and the noise rarely closes the object; `any-text` is the regex `(.|\\n)*`. A request whose
grammar ends (the string closed, then EOS) leaves the batch early; the run reports how many did,
and throughput counts the tokens each step really produced.

The engine is driven step by step (`LLMEngine.step`): the first steps (prefill) are excluded;
decode throughput = decode tokens / decode seconds. The figure compared is the ratio of the two
decode throughputs; the overhead includes everything structured output adds per step: filling
the bitmask rows on the host (overlapping the forward), the copy, the masking kernel, the
argmax of the masked logits instead of the graph's greedy tokens, and the matchers' accept
(under async scheduling, of the step in flight's tokens, just before the next step's fill).

The tokenizer defaults to the embedded SmolLM2's (a dummy checkpoint has none); with a larger
model vocabulary the bitmask covers the model's vocabulary and ids past the tokenizer's are
never allowed. Raw per-step times go to DIR/structured.json. `--host-profile` then prints the host
functions of one more constrained run (cProfile), to see what the step's host chain spends.
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
    return {"step_seconds": step_seconds, "step_tokens": step_tokens, "ended_early": early,
            "decode_seconds": decode_seconds, "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
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
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
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
            _run(engine, prompts[:2], free.model_copy(update={"max_tokens": 4}))           # warm-up
            _run(engine, prompts[:2], constrained.model_copy(update={"max_tokens": 4}))    # compiles the grammar
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
    best = {name: max(results, key=lambda r: r["decode_tok_s"]) for name, results in runs.items()}
    ratio = best["structured"]["decode_tok_s"] / best["free"]["decode_tok_s"] if best["free"]["decode_tok_s"] else 0.0
    summary = {"model": args.shape or args.model or "smollm2-135m (embedded config)", "num_layers": args.num_layers,
               "device": device_name, "dtype": args.dtype, "cudagraph_mode": graph_mode,
               "async_scheduling": async_scheduling, "batch": args.batch, "steps": args.steps,
               "prompt_len": args.prompt_len, "constraint": args.constraint,
               "free_decode_tok_s": best["free"]["decode_tok_s"],
               "structured_decode_tok_s": best["structured"]["decode_tok_s"],
               "free_median_step_ms": best["free"]["median_step_ms"],
               "structured_median_step_ms": best["structured"]["median_step_ms"],
               "throughput_ratio": ratio, "overhead_percent": 100 * (1 - ratio),
               "structured_ended_early": best["structured"]["ended_early"], "torch": torch.__version__}
    print(f"{summary['model']} ({device_name}, {args.dtype}, {graph_mode}, async={async_scheduling}), batch "
          f"{args.batch}, {args.steps} steps, {args.constraint}: free {summary['free_decode_tok_s']:.0f} tok/s "
          f"({summary['free_median_step_ms']:.2f} ms/step), structured {summary['structured_decode_tok_s']:.0f} tok/s "
          f"({summary['structured_median_step_ms']:.2f} ms/step): ratio {ratio:.3f}, overhead "
          f"{summary['overhead_percent']:.1f}% ({summary['structured_ended_early']} requests ended early)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
