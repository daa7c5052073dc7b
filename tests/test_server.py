"""`graphrunner serve default` driven by the official `openai` client, as a user would: greedy
outputs equal to the offline `LLM` token for token, streaming, n, stop strings, logprobs, bad
input, concurrency and a client that drops mid-stream. One server (and one offline LLM) per
module; every request asks for a few tokens."""

from __future__ import annotations

import asyncio
import http.client
import json
from urllib.parse import urlparse

import pytest

from configs import SamplingParams
from server_helpers import ServerProcess, metrics, wait_for

openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 512
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And three fruits?"}]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(["default", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64"])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    from runner import LLM
    with LLM("default", max_model_len=MAX_MODEL_LEN) as offline:
        yield offline


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_models_health_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["default"]
    tokens = _post(server.url, "/tokenize", {"prompt": "Hello world"})
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert _post(server.url, "/detokenize", {"tokens": tokens["tokens"]})["prompt"] == "Hello world"


def test_completion_greedy_equals_llm_generate(client, llm):
    for prompt in PROMPTS:
        reference = llm.generate(prompt, greedy(max_tokens=12), use_tqdm=False)[0]
        response = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0.0,
                                             extra_body={"return_token_ids": True})
        choice = response.choices[0]
        assert choice.token_ids == reference.outputs[0].token_ids, prompt
        assert choice.text == reference.outputs[0].text
        assert choice.finish_reason == reference.outputs[0].finish_reason
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert response.usage.completion_tokens == len(choice.token_ids)
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completion_prompt_forms(client, llm):
    """A list of strings, token ids and a list of token-id lists: one choice per prompt, in order."""
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    expected = llm.generate(PROMPTS[0], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].text
    for prompt in ([PROMPTS[0], PROMPTS[1]], ids, [ids, ids]):
        response = client.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0.0)
        assert [c.index for c in response.choices] == list(range(len(response.choices)))
        assert response.choices[0].text == expected
    assert len(client.completions.create(model="default", prompt=[ids, ids], max_tokens=2).choices) == 2


def test_chat_greedy_equals_llm_chat(client, llm):
    reference = llm.chat(CHAT, greedy(max_tokens=16), use_tqdm=False)[0]
    response = client.chat.completions.create(model="default", messages=CHAT, max_completion_tokens=16,
                                              temperature=0.0, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.token_ids == reference.outputs[0].token_ids
    assert choice.message.content == reference.outputs[0].text
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_streamed_deltas_concatenate_to_the_whole_text(client):
    whole = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=20, temperature=0.0)
    stream = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=20, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    whole = client.chat.completions.create(model="default", messages=CHAT, max_tokens=20, temperature=0.0)
    chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=20, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_strings(client, llm):
    reference = llm.generate(PROMPTS[1], greedy(max_tokens=30, stop=["\n"]), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=30, temperature=0.0,
                                         stop=["\n"])
    choice = response.choices[0]
    assert choice.text == reference.text and "\n" not in choice.text
    assert choice.finish_reason == "stop" == reference.finish_reason
    assert choice.model_extra["stop_reason"] == "\n"


def test_logprobs(client, llm):
    reference = llm.generate(PROMPTS[0], greedy(max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=5, temperature=0.0,
                                         logprobs=3)
    logprobs = response.choices[0].logprobs
    expected = [next(iter(entry.values())) for entry in reference.logprobs]
    assert logprobs.tokens == [lp.decoded_token for lp in expected]
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(lp) for top, lp
               in zip(logprobs.top_logprobs, logprobs.token_logprobs))  # greedy: the sampled token is the top one
    assert logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(model="default", messages=CHAT, max_tokens=4, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token for entry in content)


def test_n_completions(client):
    response = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=8, temperature=1.0,
                                         n=2, seed=1, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason is not None for c in response.choices)
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in response.choices)
    chat = client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=1.0, n=2, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=1.0, n=2,
                                                 seed=1, stream=True))
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in chat.choices}  # same seed, same completions


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
def test_penalties_equal_llm_generate(client, llm, field):
    value = 1.3 if field == "repetition_penalty" else 1.5
    reference = llm.generate(PROMPTS[2], greedy(max_tokens=16, **{field: value}), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=16, temperature=0.0,
                                         extra_body={field: value, "return_token_ids": True})
    assert response.choices[0].token_ids == reference.token_ids


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids", "bad_words"])
def test_logit_controls_equal_llm_generate(client, llm, field):
    """OpenAI's logit_bias (token ids as string keys) and vLLM's allowed_token_ids and bad_words reach
    the sampler as the offline LLM's SamplingParams do."""
    plain = llm.generate(PROMPTS[0], greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    first = plain.token_ids[0]
    value = {"logit_bias": {first: -100.0, first + 1: 100.0}, "allowed_token_ids": [first + 1, first + 2, 13],
             "bad_words": [plain.text.split()[0]]}[field]
    reference = llm.generate(PROMPTS[0], greedy(max_tokens=8, **{field: value}), use_tqdm=False)[0].outputs[0]
    assert reference.token_ids != plain.token_ids   # the control changed the greedy output
    sent = {str(t): b for t, b in value.items()} if field == "logit_bias" else value
    response = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                         extra_body={field: sent, "return_token_ids": True})
    assert response.choices[0].token_ids == reference.token_ids


def test_truncate_prompt_tokens_keeps_the_prompts_tail(client, llm):
    """A prompt over max_model_len is served with vLLM's truncate_prompt_tokens (the last k tokens),
    as the offline LLM truncates it; usage counts the truncated prompt."""
    prompt = "one two three four five six seven. " * 100   # ~800 tokens > MAX_MODEL_LEN
    for k, max_tokens in ((40, 4), (-1, 1)):   # -1 leaves room for one token
        reference = llm.generate(prompt, greedy(max_tokens=max_tokens, truncate_prompt_tokens=k), use_tqdm=False)[0]
        response = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             extra_body={"truncate_prompt_tokens": k, "return_token_ids": True})
        assert response.choices[0].token_ids == reference.outputs[0].token_ids
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids) == (k if k > 0 else MAX_MODEL_LEN - 1)
    echoed = client.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0.0, echo=True,
                                       extra_body={"truncate_prompt_tokens": 8})
    tokenizer = llm.get_tokenizer()
    assert echoed.choices[0].text.startswith(tokenizer.decode(tokenizer.encode(prompt)[-8:]))   # what was served


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0.0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(response.choices[0].message.content)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    response = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give a JSON object."}], max_tokens=200,
        temperature=0.0, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"  # the grammar ended it: a complete object
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_prompt_logprobs_equal_llm_generate(client, llm):
    reference = llm.generate(PROMPTS[0], greedy(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    response = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=2, temperature=0.0,
                                         extra_body={"prompt_logprobs": 2})
    served = response.choices[0].model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(reference.prompt_token_ids)
    for entry, expected in zip(served[1:], reference.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(
            {t: lp.logprob for t, lp in expected.items()}, abs=1e-4)


def test_include_stop_str_in_output(client):
    response = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=30, temperature=0.0,
                                         stop=["\n"], extra_body={"include_stop_str_in_output": True})
    assert response.choices[0].text.endswith("\n")


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 * MAX_MODEL_LEN}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"prompt": "hello " * (MAX_MODEL_LEN + 10)}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_completion_input_is_400_naming_the_field(client, body, param):
    request = {"model": "default", "prompt": "Hi", "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{k: v for k, v in request.items() if k in ("model", "prompt", "max_tokens")},
                                  extra_body={k: v for k, v in request.items()
                                              if k not in ("model", "prompt", "max_tokens")})
    error = caught.value.body
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"] or param == "prompt"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_constraint_that_does_not_parse_is_400_naming_the_field(client, stream):
    """Refused before any stream starts: a 400, not an error event inside a 200 stream."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=4, stream=stream,
                                       extra_body={"structured_outputs": {"regex": "(("}})
    assert caught.value.body["param"] == "structured_outputs" and "regular expression" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="default", prompt="Hi", max_tokens=4, stream=stream, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert caught.value.body["param"] == "response_format" and "JSON schema" in caught.value.body["message"]


def test_a_body_that_is_not_json_is_400(server):
    url = urlparse(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("POST", "/v1/completions", body=b'{"prompt": "Hi",', headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
    finally:
        connection.close()
    assert response.status == 400 and error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON")


def test_bad_chat_input_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=[], max_tokens=4)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=[{"role": "wizard", "content": "x"}], max_tokens=4)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x " * MAX_MODEL_LEN}])
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-7", messages=CHAT, max_tokens=4)
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-7", prompt="Hi", max_tokens=4)
    # ...and the server goes on serving
    assert client.completions.create(model="default", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_32_concurrent_streams_all_complete(server):
    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, str | None]:
            stream = await aclient.completions.create(model="default", prompt=f"{PROMPTS[i % 3]} {i}", max_tokens=6,
                                                      temperature=0.0, stream=True)
            text, reason = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 240)
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 32 and all(reason in ("length", "stop") for _, reason in results)
    assert sum(bool(text) for text, _ in results) >= 30  # a few tokens each (EOS at once is possible, not likely)


def test_client_dropped_mid_stream_frees_its_kv_blocks(server):
    before = metrics(server.url)
    url = urlparse(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = json.dumps({"model": "default", "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0.0,
                       "ignore_eos": True, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the request is running and streaming
    assert metrics(server.url)["graphrunner:kv_cache_usage_perc"] > 0
    connection.sock.close()
    connection.close()
    assert wait_for(lambda: metrics(server.url)["graphrunner:kv_cache_usage_perc"] == 0.0, timeout=10)
    after = metrics(server.url)
    assert after["graphrunner:num_requests_running"] == 0
    aborted = 'graphrunner:request_success_total{finished_reason="abort",model_name="default"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert after["graphrunner:generation_tokens_total"] - before["graphrunner:generation_tokens_total"] < 400


def test_metrics(server, client):
    client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, temperature=0.0)
    values = metrics(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "engine_steps_total"):
        assert "graphrunner:" + name in values, name
    assert values["graphrunner:generation_tokens_total"] >= 4
    assert values["graphrunner:time_to_first_token_seconds_count"] >= 1
    assert values['graphrunner:engine_steps_total{mode="NONE",model_name="default"}'] >= 4  # eager on a CPU


def _post(base: str, path: str, body: dict) -> dict:
    url = urlparse(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    data = json.loads(response.read())
    connection.close()
    assert response.status == 200, data
    return data


def test_bench_serve_against_the_server(server, tmp_path):
    """`graphrunner bench serve --url` drives the running server: every request completes with its
    output length (ignore_eos), and the raw results land in --out."""
    from runner.benchmarks.serve import main
    assert main(["--url", server.url, "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                 "--max-concurrency", "2", "--request-rate", "50", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["server"]["completed"] == 4 and report["server"]["output_tokens"] == 16
    assert all(len(r["itl"]) == 3 and r["ttft"] > 0 for r in report["server_requests"])
