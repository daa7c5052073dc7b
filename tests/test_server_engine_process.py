"""`graphrunner serve --engine-process` (the engine core in its own process) against the default
engine thread, on a tiny random checkpoint with a byte tokenizer: the same completions, streamed
and whole, token for token, the same /v1/models and /metrics (the thread's server on asyncio's loop
and h11, the process's on the defaults, uvloop and httptools where installed); and killing the engine process
ends the request in flight with an error, makes /health answer 503 and new requests 503."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
from checkpoints import make_tiny_checkpoint
from server_helpers import ServerProcess, metrics, wait_for

openai = pytest.importorskip("openai")

ARGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "64"]
PROMPTS = ["Hello world", "The quick brown fox", "abc"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return str(path)


@pytest.fixture(scope="module")
def servers(checkpoint):
    started = {}
    try:
        started["thread"] = ServerProcess([checkpoint, *ARGS, "--loop", "asyncio", "--http", "h11"])
        started["process"] = ServerProcess([checkpoint, *ARGS, "--engine-process"])
        yield started
    finally:
        for server in started.values():
            server.stop()


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _served(server, model: str) -> dict:
    """Whole and streamed completions of PROMPTS (greedy, and n=2 seeded sampling)."""
    client = _client(server)
    whole = client.completions.create(model=model, prompt=PROMPTS, max_tokens=10, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    sampled = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, n=2, temperature=1.0,
                                        seed=7, extra_body={"ignore_eos": True, "return_token_ids": True})
    streamed = []
    for prompt in PROMPTS:
        text, tokens, reasons = "", [], []
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True,
                                                                        "return_token_ids": True}):
            for choice in chunk.choices:
                text += choice.text
                tokens += getattr(choice, "token_ids", None) or []
                reasons.append(choice.finish_reason)
        streamed.append((text, tokens, [r for r in reasons if r is not None]))
    return {"whole": [(c.index, c.text, c.token_ids, c.finish_reason) for c in whole.choices],
            "usage": whole.usage.completion_tokens,
            "sampled": [(c.index, c.text, c.token_ids) for c in sampled.choices],
            "streamed": streamed,
            "models": [(m.id, m.max_model_len) for m in client.models.list().data]}


def test_engine_process_serves_what_the_engine_thread_serves(servers, checkpoint):
    results = {kind: _served(server, checkpoint) for kind, server in servers.items()}
    thread, process = results["thread"], results["process"]
    assert process == thread
    assert [len(tokens) for _, _, tokens, _ in thread["whole"]] == [10, 10, 10]
    assert [text for _, text, _, _ in thread["whole"]] == [text for text, _, _ in thread["streamed"]]
    assert all(reasons == ["length"] for _, _, reasons in thread["streamed"])
    assert thread["models"] == [(checkpoint, 128)]
    for server in servers.values():  # the engine process reports its state to /metrics when idle
        assert wait_for(lambda: metrics(server.url)["graphrunner:kv_cache_usage_perc"] == 0.0, timeout=30)
        values = metrics(server.url)
        assert values["graphrunner:engine_steps_total"] > 0 and values["graphrunner:num_requests_running"] == 0


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_killing_the_engine_process_fails_requests_and_health(checkpoint):
    server = ServerProcess([checkpoint, *ARGS[:4], "--max-model-len", "256", "--engine-process"])
    try:
        found = re.search(r"engine process pid (\d+)", server.tail())
        assert found, server.tail()
        url = urlparse(server.url)
        streaming = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        streaming.request("POST", "/v1/completions", json.dumps({
            "model": checkpoint, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        response = streaming.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")

        os.kill(int(found.group(1)), signal.SIGKILL)
        rest = response.read().decode()  # the stream ends: an error event, then [DONE]
        streaming.close()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
        assert errors and "engine" in errors[0]["message"], rest[-500:]
        assert events[-1] == "[DONE]"

        assert wait_for(lambda: _health(server.url) == 503, timeout=30)
        with pytest.raises(openai.APIStatusError) as caught:
            _client(server).completions.create(model=checkpoint, prompt="Hi", max_tokens=2)
        assert caught.value.status_code == 503 and "engine" in caught.value.body["message"]
    finally:
        server.stop()


def test_bench_serve_starts_an_engine_process_server_and_compares_offline(tmp_path):
    """`graphrunner bench serve --engine-process --offline`: every request completes, and the
    ratios (throughput, host CPU per token from the server's processes) and the client's CPU are
    reported. The
    benchmark's random token ids reach 10000: a vocabulary that holds them, no tokenizer."""
    from runner.benchmarks.serve import main
    checkpoint, _ = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa", with_tokenizer=False, vocab_size=10240)
    assert main(["--model", str(checkpoint), "--engine-process", "--offline", "--num-prompts", "4", "--input-len", "8",
                 "--output-len", "4", "--single-stream-requests", "1", "--dtype", "float32", "--device", "cpu",
                 "--max-model-len", "128", "--num-kv-blocks", "64", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["server"]["completed"] == 4 and report["server"]["output_tokens"] == 16
    assert report["server"]["cpu_seconds"] > 0 and report["offline"]["output_tokens"] == 16
    by_process = report["server"]["cpu_seconds_by_process"]   # the engine's steps run in the child
    # /proc counts CPU in clock ticks (10 ms): the API process's share of 4 short requests may round to 0
    assert by_process["api"] >= 0 and by_process["engine"] > 0 and report["server"]["client_cpu_seconds"] > 0
    assert report["ratios"]["server_over_offline_tokens_per_s"] > 0
    assert report["ratios"]["server_over_offline_cpu_per_token"] > 0


@pytest.mark.parametrize("choice, device, expected", [(None, "cpu", False), (None, "auto", None), (True, "cpu", True),
                                                      (False, "auto", False)])
def test_engine_placement_defaults_to_a_process_on_a_gpu(choice, device, expected):
    """--engine-process / --no-engine-process decide; without either, a process where the engine
    runs on a GPU ("auto" resolves to one when torch sees one) and a thread on a CPU."""
    import torch

    from configs import EngineConfig, ServerConfig
    from runner.server.api_server import engine_in_own_process
    if expected is None:
        expected = torch.cuda.is_available()
    engine_config = EngineConfig.from_kwargs(model="default", device=device)
    assert engine_in_own_process(ServerConfig(engine_process=choice), engine_config) is expected


def test_event_loop_choice(monkeypatch):
    """--loop asyncio: asyncio.run; auto: uvloop.run where uvloop is installed, else asyncio.run;
    --loop uvloop without uvloop: an error naming the package, before any engine starts."""
    import asyncio
    import builtins
    import sys

    from runner.server.api_server import event_loop_runner
    assert event_loop_runner("asyncio") is asyncio.run
    uvloop = pytest.importorskip("uvloop") if sys.platform != "win32" else None
    assert event_loop_runner("auto") is (uvloop.run if uvloop is not None else asyncio.run)
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("no uvloop")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert event_loop_runner("auto") is asyncio.run
    with pytest.raises(RuntimeError, match="--loop uvloop: uvloop is not installed"):
        event_loop_runner("uvloop")


def test_the_engine_process_freezes_its_heap_after_warm_up_and_before_it_reports_ready(monkeypatch):
    """run_engine_process, with the engine and its warm-up faked: the order is build, warm up,
    quiet the collector (gc.freeze: no full collection of the start-up heap stalls a step), then
    "ready" on the outputs pipe; a "stop" command ends the loop and shuts the engine down."""
    import multiprocessing
    import signal
    from types import SimpleNamespace

    import runner.collector
    import runner.engine
    import runner.engine_core
    from runner import engine_process
    events = []

    class FakeEngine:
        max_model_len, model_path = 128, "fake"
        spec = SimpleNamespace(vocab_size=10, architecture="Fake")
        device = "cpu"
        executor = SimpleNamespace(num_blocks=4)
        model_runner = SimpleNamespace(cuda_graph_ready=False, cudagraph_mode=SimpleNamespace(name="NONE"))
        scheduler = SimpleNamespace(stats=lambda: {})

        def __init__(self, config):
            events.append("built")

        def has_unfinished_requests(self):
            return False

        def shutdown(self):
            events.append("shut down")

    monkeypatch.setattr(runner.engine, "LLMEngine", FakeEngine)
    monkeypatch.setattr(runner.engine_core, "warm_up", lambda engine: events.append("warmed up"))
    monkeypatch.setattr(runner.collector, "quiet_garbage_collector", lambda: events.append("collector quieted"))
    commands_out, commands_in = multiprocessing.Pipe(duplex=False)
    outputs_out, outputs_in = multiprocessing.Pipe(duplex=False)
    commands_in.send([("stop", None)])
    previous = signal.getsignal(signal.SIGINT)
    try:
        engine_process.run_engine_process(None, commands_out, outputs_in, 30)
    finally:
        signal.signal(signal.SIGINT, previous)
    ready = outputs_out.recv()
    assert ready[0] == "ready" and ready[1]["architecture"] == "Fake"
    assert events == ["built", "warmed up", "collector quieted", "shut down"]
