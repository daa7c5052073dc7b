"""Host cost per token of the engine's outputs, as offline generation and the server make them.

    graphrunner bench outputs [--requests 256] [--steps 200] [--rounds 2] [--out DIR]

Why: at saturation the server's two processes each spend about as much CPU per output token as the
whole offline engine does (docs/PERFORMANCE.md, "Serving"), and what the server adds is this path:
a DELTA output per request per step, its wire tuple and pickle in the engine process, then the
unpickle and `decode_output` in the API process. Offline generation (FINAL_ONLY) builds nothing
until a request finishes. Three paths: offline's; the engine in the server's thread (DELTA
RequestOutputs: `completion_fields` -> `completion_output` + `request_output`); the engine in its
own process (`LLMEngine.wire_outputs`: `wire_output` straight from the fields, passed through
`encode_outputs`). This times each stage on the CPU it runs on, without a model or a GPU.

Setup: --requests running requests (256-token prompts, no tokenizer, so no text), each getting one
token per step for --steps steps; prints microseconds per token for each stage, best of --rounds.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time

from runner.benchmarks.results import add_out_argument, write_json


def _states(requests: int, kind):
    from configs import SamplingParams
    from runner.outputs import RequestMetrics
    from runner.request import Request, RequestStatus
    from runner.request_state import RequestState
    params = SamplingParams(max_tokens=1 << 20, output_kind=kind)
    states = []
    for i in range(requests):
        request = Request(f"cmpl-{i:08d}-0", list(range(256)), params, prompt="hello " * 40)
        request.status = RequestStatus.RUNNING
        states.append(RequestState(request, None, None, RequestMetrics(0.0)))
    return states


def time_stages(requests: int, steps: int, kind, wire: bool) -> dict[str, float]:
    """Seconds per token of each stage over `steps` steps of `requests` requests: the outputs as
    RequestOutputs, or (`wire`) as the engine process makes and sends them."""
    from runner.engine_process import decode_output, encode_outputs
    from runner.request_state import completion_fields, completion_output, request_output, wire_output
    states = _states(requests, kind)
    totals = dict.fromkeys(("outputs", "encode", "pickle", "unpickle", "decode_output") if wire else ("outputs",), 0.0)
    sent: set[str] = set()
    prompts: dict[str, tuple] = {}
    for step in range(steps):
        for state in states:
            state.request.output_token_ids.append(step)
        t0 = time.perf_counter()
        if wire:
            outputs = [wire_output(s, f) for s, f in ((s, completion_fields(s, False)) for s in states) if f is not None]
        else:
            outputs = [o for o in (request_output(s, completion_output(s, False)) for s in states) if o is not None]
        t1 = time.perf_counter()
        totals["outputs"] += t1 - t0
        if not wire:
            continue
        encoded = encode_outputs([(o[0], o) for o in outputs], sent)
        t2 = time.perf_counter()
        blob = pickle.dumps(("out", encoded, 0, None), protocol=pickle.HIGHEST_PROTOCOL)
        t3 = time.perf_counter()
        message = pickle.loads(blob)
        t4 = time.perf_counter()
        for entry in message[1]:
            if entry[4] is not None:
                prompts[entry[0]] = entry[4]
            decode_output(entry, prompts.get(entry[0]))
        t5 = time.perf_counter()
        totals["encode"] += t2 - t1
        totals["pickle"] += t3 - t2
        totals["unpickle"] += t4 - t3
        totals["decode_output"] += t5 - t4
    return {stage: seconds / (requests * steps) for stage, seconds in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench outputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    from configs import RequestOutputKind
    results = {}
    for name, kind, wire in (("offline (FINAL_ONLY)", RequestOutputKind.FINAL_ONLY, False),
                             ("engine thread (DELTA)", RequestOutputKind.DELTA, False),
                             ("engine process (DELTA, wire)", RequestOutputKind.DELTA, True)):
        rounds = [time_stages(args.requests, args.steps, kind, wire) for _ in range(args.rounds)]
        results[name] = {stage: min(r[stage] for r in rounds) * 1e6 for stage in rounds[0]}
    print(f"{args.requests} requests, {args.steps} steps, best of {args.rounds}; microseconds per token:")
    print("| path | outputs | encode | pickle | unpickle | decode_output | engine process | API process |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, us in results.items():
        engine = us["outputs"] + us.get("encode", 0.0) + us.get("pickle", 0.0)
        api = us.get("unpickle", 0.0) + us.get("decode_output", 0.0)
        cells = " | ".join(f"{us[s]:.2f}" if s in us else "-" for s in ("outputs", "encode", "pickle", "unpickle",
                                                                        "decode_output"))
        print(f"| {name} | {cells} | {engine:.2f} | {api:.2f} |")
    write_json(args.out, "outputs.json", dict(requests=args.requests, steps=args.steps, us_per_token=results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
