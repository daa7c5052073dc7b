"""The server's request mapping (OpenAI / vLLM fields -> SamplingParams, errors naming the field)
and the engine flags generated from EngineConfig, without starting a server."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")

from configs import EngineConfig, RequestOutputKind, SamplingParams  # noqa: E402
from configs.engine_config import (CacheConfig, CompilationConfig, ModelConfig, ParallelConfig,  # noqa: E402
                                   SchedulerConfig)
from runner.engine_args import add_engine_args, engine_kwargs  # noqa: E402
from runner.server.protocol import APIError, ChatCompletionRequest, CompletionRequest  # noqa: E402


def test_completion_fields_map_to_sampling_params():
    request = CompletionRequest(prompt="x", temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, stop="\n",
                                stop_token_ids=[3], ignore_eos=True, min_tokens=2, logprobs=3,
                                skip_special_tokens=False, max_tokens=9)
    params = request.sampling_params(9, request.logprobs, stream=False)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.5, 0.9, 5, 0.1, 7)
    assert params.stop == ["\n"] and params.stop_token_ids == [3] and params.ignore_eos and params.min_tokens == 2
    assert params.logprobs == 3 and params.max_tokens == 9 and not params.skip_special_tokens
    assert params.output_kind is RequestOutputKind.DELTA


def test_neutral_values_of_optional_features_are_not_passed():
    request = CompletionRequest(prompt="x", n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    request.sampling_params(4, None, stream=False)  # no error whichever of these SamplingParams has


@pytest.mark.parametrize("field, value", [("n", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                                          ("repetition_penalty", 1.2), ("include_stop_str_in_output", True),
                                          ("prompt_logprobs", 2)])
def test_optional_features_map_by_name_or_are_refused_naming_the_field(field, value):
    request = CompletionRequest(prompt="x", **{field: value})
    if field in SamplingParams.model_fields:
        assert getattr(request.sampling_params(4, None, False), field) == value
    else:
        with pytest.raises(APIError) as caught:
            request.sampling_params(4, None, False)
        assert caught.value.param == field and field in caught.value.message and caught.value.status == 400


def test_logit_controls_map_to_sampling_params():
    request = CompletionRequest(prompt="x", logit_bias={"5": 2.0, "7": -300.0}, allowed_token_ids=[5, 7],
                                bad_words=["no"])
    params = request.sampling_params(4, None, False)
    assert params.logit_bias == {5: 2.0, 7: -100.0}   # clamped to [-100, 100], as vLLM does
    assert params.allowed_token_ids == [5, 7] and params.bad_words == ["no"]
    assert params.token_ids_outside(6) == {"logit_bias": [7], "allowed_token_ids": [7]}
    assert params.vocabulary_error(6) == ("logit_bias", "logit_bias has token id(s) [7] outside the vocabulary [0, 6)")
    assert params.vocabulary_error(8) is None
    with pytest.raises(APIError) as caught:
        CompletionRequest(prompt="x", logit_bias={"five": 1.0}).sampling_params(4, None, False)
    assert caught.value.param == "logit_bias" and "'five'" in caught.value.message


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("logits_processors", ["my.module:fn"]),
                                          ("prompt_embeds", "AAAA")])
def test_vllm_extras_not_built_are_refused_naming_the_field(field, value):
    with pytest.raises(APIError) as caught:
        CompletionRequest(prompt="x", **{field: value}).sampling_params(4, None, False)
    assert caught.value.param == field and field in caught.value.message
    CompletionRequest(prompt="x", use_beam_search=False).sampling_params(4, None, False)   # the neutral value is fine


def test_stream_options_need_stream():
    """vLLM's rule: stream_options without stream=true is a 400 naming it."""
    with pytest.raises(APIError) as caught:
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).sampling_params(4, None, False)
    assert caught.value.param == "stream_options"
    CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}).sampling_params(4, None, True)


def test_truncate_prompt_tokens_is_checked_with_the_request():
    from pydantic import ValidationError
    from configs.sampling_params import truncate_prompt
    assert CompletionRequest(prompt="x", truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    with pytest.raises(ValidationError, match="truncate_prompt_tokens"):
        CompletionRequest(prompt="x", truncate_prompt_tokens=0)
    assert truncate_prompt([1, 2, 3, 4], 2, 10) == [3, 4] and truncate_prompt([1, 2, 3, 4], -1, 3) == [3, 4]
    assert truncate_prompt([1, 2, 3], None, 2) == [1, 2, 3]


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
    ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"response_format": {"type": "text"}}, None),
])
def test_response_format_maps_to_structured_outputs(body, expected):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body)
    assert request._structured_outputs() == expected
    if expected is not None and "structured_outputs" not in SamplingParams.model_fields:
        with pytest.raises(APIError) as caught:
            request.sampling_params(4, None, False)
        assert caught.value.param in ("response_format", "structured_outputs")


def test_invalid_value_names_the_field():
    with pytest.raises(APIError) as caught:
        CompletionRequest(prompt="x", top_p=3.0).sampling_params(4, None, False)
    assert caught.value.param == "top_p" and "top_p" in caught.value.message
    assert caught.value.body() == {"error": {"message": caught.value.message, "type": "invalid_request_error",
                                             "param": "top_p", "code": None}}


def test_every_engine_option_is_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {action.dest for action in parser._actions}
    fields = {f for sub in (ModelConfig, CacheConfig, SchedulerConfig, CompilationConfig, ParallelConfig)
              for f in sub.model_fields} - {"model"}
    assert fields | {"device", "seed"} <= flags
    args = parser.parse_args(["--block-size", "32", "--enable-prefix-caching", "false", "--async-scheduling",
                              "--cudagraph-mode", "full", "--cudagraph-capture-sizes", "1", "4", "--max-num-seqs", "8",
                              "--gpu-memory-utilization", "0.5", "--device", "cpu", "--dtype", "float32"])
    kwargs = engine_kwargs(args)
    assert kwargs == {"block_size": 32, "enable_prefix_caching": False, "async_scheduling": True,
                      "cudagraph_mode": "full", "cudagraph_capture_sizes": [1, 4], "max_num_seqs": 8,
                      "gpu_memory_utilization": 0.5, "device": "cpu", "dtype": "float32"}
    config = EngineConfig.from_kwargs(model="default", **kwargs)
    assert config.cache.block_size == 32 and config.compilation.cudagraph_capture_sizes == [1, 4]
    assert engine_kwargs(parser.parse_args([])) == {}  # defaults stay in configs/


@pytest.mark.parametrize("text", ["", "a", ' "quoted" \n', "é😀\u2028", "\x00text\x00", "\\", "</script>"])
@pytest.mark.parametrize("with_ids", [False, True])
def test_text_chunk_template_is_byte_for_byte_json_dumps(text, with_ids):
    """Streams render plain chunks from a template (runner/server/serving.py TextChunks), with the
    token ids when the request asked for them: the line must be exactly what encoding the whole
    body gives, for any text."""
    import json

    from runner.server.serving import TextChunks, sse

    def body(t, ids):
        choice = {"index": 2, "text": t, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if with_ids:
            choice["token_ids"] = ids
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": 'odd "model" \\u0000',
                "choices": [choice]}
    for ids in ([], [5], [0, 49151, 7]):
        assert TextChunks(body)(text, ids) == sse(json.dumps(body(text, ids)))


def test_the_serving_process_freezes_its_start_up_heap_and_collects_in_larger_batches():
    import gc

    from runner.collector import GC_THRESHOLD, quiet_garbage_collector
    before = gc.get_threshold()
    try:
        quiet_garbage_collector()
        assert gc.get_threshold() == GC_THRESHOLD and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_streaming_backend_is_imported_at_start_up():
    """anyio's asyncio backend (Starlette's streamed responses run in its task groups) is imported
    before the server serves, not inside the first streamed response."""
    import subprocess
    import sys
    code = ("import sys; from runner.server.api_server import import_streaming_backend; "
            "assert 'anyio._backends._asyncio' not in sys.modules; import_streaming_backend(); "
            "assert 'anyio._backends._asyncio' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
