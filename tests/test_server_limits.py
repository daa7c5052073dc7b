"""`graphrunner serve` with a bound on waiting requests: a request over the bound gets 503 with an
OpenAI error body while the running and waiting requests finish, and the server serves on."""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlparse

import pytest
from server_helpers import ServerProcess, metrics, wait_for

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(["default", "--max-model-len", "256", "--max-num-seqs", "1",
                             "--max-waiting-requests", "1"])
    yield process
    process.stop()


def test_over_the_waiting_bound_is_503_and_the_others_finish(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    url = urlparse(server.url)
    running = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    running.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 200,
                                                           "ignore_eos": True, "stream": True}),
                    {"Content-Type": "application/json"})
    response = running.getresponse()
    assert response.readline().startswith(b"data: ")  # it holds the one running slot

    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(
        result=client.completions.create(model="default", prompt="Hello", max_tokens=3, temperature=0.0)))
    thread.start()
    assert wait_for(lambda: metrics(server.url)["graphrunner:num_requests_waiting"] == 1, timeout=30)

    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="default", prompt="Hello", max_tokens=3)
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "server_overloaded" and "max-waiting-requests" in caught.value.body["message"]

    # the running request streams to its end, the waiting one is served after it
    lines = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    running.close()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    thread.join(timeout=60)
    assert waiting["result"].choices[0].finish_reason in ("length", "stop")
    assert client.completions.create(model="default", prompt="Hi", max_tokens=2).choices[0].finish_reason
