"""`graphrunner bench serve`: load on the OpenAI server, in the manner of vLLM's benchmark_serving.

Requests of random token ids (lengths drawn uniformly in [len*(1-r), len*(1+r)], `--seed`) go to
/v1/completions as streams, arriving as a Poisson process at `--request-rate` (inf: all at once)
and/or capped at `--max-concurrency`. Printed: request throughput, output tokens/s, TTFT and ITL
p50/p90/p99 (ITL: the gap between streamed chunks divided by the tokens they carry).

Without `--url` the benchmark starts `graphrunner serve` itself with the engine options given
here, and stops it afterwards. `--offline` then also runs, in this process after the server has
stopped (so both never share a GPU), the same requests through `LLM.generate`, and a single
stream of `--single-stream-requests` requests (concurrency 1) against the offline batch-1 decode
step, and prints the two goals' ratios: server / offline output tokens/s at saturation and
server single-stream median ITL / offline batch-1 decode step. `--engine-process` /
`--no-engine-process` start the server with its engine in its own process / a thread of the
server (default: the server's own default, a process on a GPU and a thread on a CPU), so the two
placements are compared with the same command.

Random token ids are drawn from [100, 10000): inside any real vocabulary, clear of most special
tokens. Raw per-request results and the summary go to `--out DIR` as JSON.

    graphrunner bench serve --num-prompts 16 --input-len 64 --output-len 32 --offline --device cpu --out /tmp/serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from runner.engine_args import add_engine_args, engine_kwargs

TOKEN_RANGE = (100, 10000)
_SKIP = ("seed",)
"""Engine options this benchmark does not take: its --seed seeds the requests."""


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def make_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def draw(length: int) -> int:
        low, high = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
        return rng.randint(low, high)

    return [([rng.randrange(*TOKEN_RANGE) for _ in range(draw(input_len))], draw(output_len)) for _ in range(num)]


# ---- a minimal HTTP/1.1 streaming client (no dependency; chunked SSE from uvicorn) -------------
async def _stream_completion(host: str, port: int, model: str, prompt: list[int], max_tokens: int,
                             result: RequestResult) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
    result.start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (host.encode(), len(body), body))
        await writer.drain()
        status = (await reader.readline()).split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(status) < 2 or status[1] != b"200":
            result.error = f"HTTP {status[1:2]}: {(await reader.read())[:300]!r}"
            return
        chunked = headers.get("transfer-encoding") == "chunked"
        buffer, last = b"", None
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                buffer += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return
                tokens = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                if not tokens:
                    continue
                if last is None:
                    result.ttft = now - result.start
                else:
                    result.itl.extend([(now - last) / tokens] * tokens)
                last = now
                result.output_tokens += tokens
        result.e2e = time.perf_counter() - result.start
        result.ok = result.output_tokens > 0
    finally:
        writer.close()


async def run_load(url: str, model: str, requests: list[tuple[list[int], int]], request_rate: float,
                   max_concurrency: int | None, seed: int) -> tuple[list[RequestResult], float]:
    parsed = urlparse(url)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed + 1)
    results = [RequestResult(len(p), n) for p, n in requests]

    async def one(index: int) -> None:
        prompt, max_tokens = requests[index]
        try:
            if limit is None:
                await _stream_completion(parsed.hostname, parsed.port, model, prompt, max_tokens, results[index])
            else:
                async with limit:
                    await _stream_completion(parsed.hostname, parsed.port, model, prompt, max_tokens, results[index])
        except (OSError, ValueError, asyncio.IncompleteReadError) as error:
            results[index].error = f"{type(error).__name__}: {error}"

    started = time.perf_counter()
    tasks = []
    for index in range(len(requests)):
        tasks.append(asyncio.create_task(one(index)))
        if not math.isinf(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered), "p90": at(0.9), "p99": at(0.99)}


def summarize(results: list[RequestResult], seconds: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {"requests": len(results), "completed": len(done), "failed": len(results) - len(done),
            "seconds": seconds, "request_throughput": len(done) / seconds, "output_tokens_per_s": tokens / seconds,
            "output_tokens": tokens, "ttft_s": percentiles([r.ttft for r in done]),
            "itl_s": percentiles([x for r in done for x in r.itl]), "e2e_s": percentiles([r.e2e for r in done])}


def print_summary(title: str, summary: dict) -> None:
    print(f"== {title}")
    print(f"  requests {summary['completed']}/{summary['requests']} in {summary['seconds']:.2f} s: "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s")
    for name in ("ttft_s", "itl_s", "e2e_s"):
        p = summary[name]
        print(f"  {name[:-2].upper():4s} ms: mean {p['mean'] * 1e3:8.2f}  p50 {p['p50'] * 1e3:8.2f}  "
              f"p90 {p['p90'] * 1e3:8.2f}  p99 {p['p99'] * 1e3:8.2f}")
    failed = summary["failed"]
    if failed:
        print(f"  {failed} requests FAILED")


# ---- offline reference (same requests through LLM.generate) ---------------------------------
def run_offline(model: str, options: dict, requests: list[tuple[list[int], int]],
                single: list[tuple[list[int], int]]) -> dict:
    from configs import SamplingParams
    from runner.llm import LLM

    with LLM(model, **options) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        llm.generate([{"prompt_token_ids": p} for p, _ in requests[:2]], params[:2], use_tqdm=False)  # warm
        started, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        steps = []
        engine = llm.engine
        for index, (prompt, n) in enumerate(single):  # batch 1: time each decode step (after the prefill)
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), f"b1-{index}")
            engine.step()
            while engine.has_unfinished_requests():
                started_step = time.perf_counter()
                if engine.step():
                    steps.append(time.perf_counter() - started_step)
    return {"seconds": seconds, "cpu_seconds": cpu, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "batch1_decode_step_s": percentiles(steps)}


def server_cpu_seconds(proc) -> dict[str, float] | None:
    """CPU seconds (user + system, all threads) of the started server: {"api": the server process
    itself (HTTP, SSE, outputs), "engine": its child processes (the engine process, if any)}, from
    /proc; None without a started server or on a system without /proc. On a shared host this is the
    figure that load from other processes does not distort; the split shows which process paces
    the server."""
    if proc is None:
        return None
    try:
        pids = [proc.pid]
        for pid in pids:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            pids.extend(int(child) for child in children)
        ticks = {}
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        per_s = os.sysconf("SC_CLK_TCK")
        api = ticks.pop(proc.pid)
        return {"api": api / per_s, "engine": sum(ticks.values()) / per_s}
    except (OSError, ValueError, IndexError):
        return None


def _server_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name, value in engine_kwargs(args, _SKIP).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _start_server(args: argparse.Namespace):
    import re
    import subprocess
    import threading
    command = [sys.executable, "-m", "runner.cli", "serve", args.model, "--host", "127.0.0.1", "--port", "0",
               *({True: ["--engine-process"], False: ["--no-engine-process"]}.get(args.engine_process, [])),
               "--loop", args.loop, "--http", args.http,
               *_server_flags(args)]
    print("starting:", " ".join(command), flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    found, url = threading.Event(), []

    def read() -> None:
        for line in proc.stdout:
            match = re.search(r"graphrunner: serving \S+ at (http://\S+)", line)
            if match and not url:
                url.append(match.group(1))
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + args.server_timeout
    while not found.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start")
    return proc, url[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (http://host:port); default: start one")
    parser.add_argument("--model", default="default", help="model to serve/name in requests")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offline", action="store_true", help="also run LLM.generate and print the goal ratios")
    parser.add_argument("--single-stream-requests", type=int, default=4,
                        help="requests of the concurrency-1 phase (--offline)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="the started server runs its engine in its own process / a thread of the server "
                             "(serve --[no-]engine-process; default: the server's)")
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                        help="the started server's event loop (serve --loop)")
    parser.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                        help="the started server's HTTP protocol (serve --http)")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds for a started server to be ready")
    parser.add_argument("--out", help="folder for results.json")
    add_engine_args(parser, skip=_SKIP)
    args = parser.parse_args(argv)

    requests = make_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    single = make_requests(args.single_stream_requests, args.input_len, args.output_len, 0.0, args.seed + 7)
    proc, url = (None, args.url) if args.url else _start_server(args)
    report: dict = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}
    try:
        cpu, client_cpu = server_cpu_seconds(proc), time.process_time()
        results, seconds = asyncio.run(run_load(url, args.model, requests, args.request_rate, args.max_concurrency,
                                                args.seed))
        after, client_cpu = server_cpu_seconds(proc), time.process_time() - client_cpu
        report["server"] = summarize(results, seconds)
        report["server"]["client_cpu_seconds"] = client_cpu   # this process: the load's HTTP client
        if cpu is not None and after is not None:
            report["server"]["cpu_seconds_by_process"] = {key: after[key] - cpu[key] for key in after}
            report["server"]["cpu_seconds"] = sum(report["server"]["cpu_seconds_by_process"].values())
        else:
            report["server"]["cpu_seconds"] = None
        report["server_requests"] = [asdict(r) for r in results]
        print_summary(f"server: {len(requests)} requests, rate {args.request_rate}, "
                      f"max concurrency {args.max_concurrency}", report["server"])
        if args.offline:
            single_results, single_seconds = asyncio.run(run_load(url, args.model, single, float("inf"), 1, args.seed))
            report["server_single_stream"] = summarize(single_results, single_seconds)
            print_summary("server: single stream (concurrency 1)", report["server_single_stream"])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    if args.offline:
        offline = report["offline"] = run_offline(args.model, engine_kwargs(args, _SKIP), requests, single)
        step = offline["batch1_decode_step_s"]["p50"]
        itl = report["server_single_stream"]["itl_s"]["p50"]
        ratio = report["server"]["output_tokens_per_s"] / offline["output_tokens_per_s"]
        report["ratios"] = {"server_over_offline_tokens_per_s": ratio, "single_stream_itl_over_batch1_step": itl / step}
        print(f"== offline LLM.generate: {offline['output_tokens']} tokens in {offline['seconds']:.2f} s, "
              f"{offline['output_tokens_per_s']:.1f} output tok/s; batch-1 decode step p50 {step * 1e3:.2f} ms")
        print(f"   server/offline output tok/s: {ratio:.3f} (goal >= 0.9 at saturation on the GPU)")
        server_cpu = report["server"]["cpu_seconds"]
        if server_cpu is not None:
            per_token = server_cpu / max(1, report["server"]["output_tokens"]) * 1e3
            offline_per_token = offline["cpu_seconds"] / max(1, offline["output_tokens"]) * 1e3
            report["ratios"]["server_over_offline_cpu_per_token"] = per_token / offline_per_token
            by_process = {key: seconds / max(1, report["server"]["output_tokens"]) * 1e3
                          for key, seconds in report["server"]["cpu_seconds_by_process"].items()}
            client = report["server"]["client_cpu_seconds"] / max(1, report["server"]["output_tokens"]) * 1e3
            print(f"   host CPU ms per output token: server {per_token:.3f} (API process {by_process['api']:.3f}, "
                  f"engine process {by_process['engine']:.3f}), offline {offline_per_token:.3f}: "
                  f"{per_token / offline_per_token:.2f}x; the benchmark's client {client:.3f}")
        print(f"   single-stream ITL p50 / batch-1 step p50: {itl / step:.3f} (goal <= 1.15)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"raw results in {out / 'results.json'}")
    return 1 if report["server"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
