"""`graphrunner serve` on a GPU: decode steps replay CUDA graphs (FULL in /metrics), greedy tokens
equal the offline engine's, and concurrent streams complete with async scheduling on; with the
engine in a thread of the server and in its own process. The model
is a tiny random checkpoint with the one-byte-per-token test tokenizer (nothing to download)."""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import ServerProcess, metrics, wait_for

from configs import SamplingParams

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from checkpoints import make_tiny_checkpoint
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa",
                                    max_position_embeddings=1024)[0])


@pytest.fixture(scope="module", params=["thread", "process"])
def server(checkpoint, request):
    """The engine in a thread of the server (--no-engine-process), and in its own process (the default on a GPU)."""
    placement = [] if request.param == "process" else ["--no-engine-process"]
    process = ServerProcess([checkpoint, "--served-model-name", "default", "--device", "cuda",
                             "--max-model-len", "1024", "--gpu-memory-utilization", "0.4", *placement], timeout=600)
    yield process
    process.stop()


def test_gpu_server_replays_graphs_and_matches_offline(server, checkpoint):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    served = [client.completions.create(model="default", prompt=p, max_tokens=24, temperature=0.0,
                                        extra_body={"return_token_ids": True}).choices[0].token_ids for p in prompts]
    full = 'graphrunner:engine_steps_total{mode="FULL",model_name="default"}'
    assert wait_for(lambda: metrics(server.url)[full] > 0, timeout=10)  # an engine process reports when idle

    async def streams() -> list[int]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> int:
            count = 0
            async for chunk in await aclient.completions.create(model="default", prompt=f"Story {i}:",
                                                                max_tokens=16, stream=True, temperature=0.0,
                                                                extra_body={"ignore_eos": True}):
                count += len(chunk.choices[0].text) > 0
            return count

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    assert all(count > 0 for count in asyncio.run(streams()))
    assert wait_for(lambda: metrics(server.url)["graphrunner:kv_cache_usage_perc"] == 0.0, timeout=10)

    server.stop()  # the offline engine gets the GPU to itself
    from runner import LLM
    with LLM(checkpoint, device="cuda", max_model_len=1024) as llm:
        for prompt, tokens in zip(prompts, served):
            reference = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
            assert tokens == reference.outputs[0].token_ids
