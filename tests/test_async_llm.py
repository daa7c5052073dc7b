"""AsyncLLM on a tiny random checkpoint: outputs equal the synchronous engine's, every output kind,
a refused request fails alone, leaving the loop early aborts and frees the KV blocks, and a failing
step ends the requests it hit while the engine goes on serving."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from checkpoints import make_tiny_checkpoint

from configs import EngineConfig, RequestOutputKind, SamplingParams
from runner.async_llm import AsyncLLM, EngineLoopError, merge_delta
from runner.engine import InvalidRequestError, LLMEngine
from runner.engine_process import decode_output, encode_outputs
from runner.llm import LLM
from runner.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23, 9, 40)]


def _engine(checkpoint: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=checkpoint, dtype="float32", device="cpu", num_kv_blocks=64))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_outputs_equal_the_engine_in_every_kind(checkpoint, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        reference = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    async def run():
        engine = AsyncLLM(_engine(checkpoint))
        engine.start()

        async def one(prompt, kind):
            outs = [o async for o in engine.generate(prompt, params.model_copy(update={"output_kind": kind}))]
            return kind, outs

        try:
            jobs = [one(p, kind) for p in prompts for kind in RequestOutputKind]
            return await asyncio.gather(*jobs)
        finally:
            engine.shutdown()

    results = _run(run())
    for index, (kind, outs) in enumerate(results):
        expected = reference[index // len(RequestOutputKind)]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        if kind is RequestOutputKind.DELTA:
            assert [t for o in outs for t in o.outputs[0].token_ids] == expected.token_ids
            assert [lp for o in outs for lp in o.outputs[0].logprobs] == expected.logprobs
            assert 0 < len(outs) <= len(expected.token_ids)  # a caller behind the engine gets merged deltas
        elif kind is RequestOutputKind.CUMULATIVE:
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert lengths == sorted(set(lengths)) and lengths[-1] == len(expected.token_ids)
            assert all(o.outputs[0].token_ids == expected.token_ids[:len(o.outputs[0].token_ids)] for o in outs)
            assert outs[-1].outputs[0].token_ids == expected.token_ids
        else:
            assert len(outs) == 1 and outs[0].outputs[0].token_ids == expected.token_ids
        assert outs[-1].outputs[0].finish_reason == "length"


def test_refused_request_fails_alone_and_early_exit_frees_blocks(checkpoint, prompts):
    async def run():
        engine = AsyncLLM(_engine(checkpoint))
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

        async def good(prompt):
            return [o async for o in engine.generate(prompt, params)][-1]

        async def bad():
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                async for _ in engine.generate([10 ** 6], params):
                    pass

        async def leaves_early():
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            async for out in engine.generate(prompts[3], long, "early"):
                assert engine.engine.scheduler.kv.usage > 0
                break

        try:
            finished = await asyncio.gather(good(prompts[0]), bad(), good(prompts[1]), leaves_early())
            for _ in range(100):  # the abort reaches the engine thread before its next step
                if engine.engine.scheduler.kv.usage == 0 and not engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            return finished, engine.engine.scheduler.kv.usage, engine.engine.has_unfinished_requests()
        finally:
            engine.shutdown()

    finished, usage, unfinished = _run(run())
    assert finished[0].finished and finished[2].finished
    assert usage == 0 and not unfinished


def test_abort_ends_the_stream_with_abort(checkpoint, prompts):
    async def run():
        engine = AsyncLLM(_engine(checkpoint))
        engine.start()
        try:
            outs = []
            async for out in engine.generate(prompts[0], SamplingParams(max_tokens=500, ignore_eos=True), "a"):
                outs.append(out)
                if len(outs) == 2:
                    engine.abort("a")
            return outs
        finally:
            engine.shutdown()

    outs = _run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and len(outs) < 500


def test_failing_step_ends_its_requests_and_the_engine_serves_on(checkpoint, prompts):
    async def run():
        engine = AsyncLLM(_engine(checkpoint))
        real_step, calls = engine.engine.step, []

        def failing_once():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected step failure")
            return real_step()

        engine.engine.step = failing_once
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        try:
            with pytest.raises(EngineLoopError, match="injected step failure"):
                async for _ in engine.generate(prompts[0], params):
                    pass
            after = [o async for o in engine.generate(prompts[1], params)]
            return after, engine.engine.scheduler.kv.usage
        finally:
            engine.shutdown()

    after, usage = _run(run())
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 6 and usage == 0


def test_a_slow_caller_gets_every_token_in_fewer_merged_deltas(checkpoint, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    with LLM(checkpoint, dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        expected = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0]

    async def run():
        engine = AsyncLLM(_engine(checkpoint))
        engine.start()
        try:
            outs = []
            async for out in engine.generate(prompts[1], params.model_copy(
                    update={"output_kind": RequestOutputKind.DELTA})):
                outs.append(out)
                time.sleep(0.05)  # blocks the event loop: the engine thread steps on meanwhile
            return outs
        finally:
            engine.shutdown()

    outs = _run(run())
    assert [t for o in outs for t in o.outputs[0].token_ids] == expected.token_ids
    assert [lp for o in outs for lp in o.outputs[0].logprobs] == expected.logprobs
    assert "".join(o.outputs[0].text for o in outs) == expected.text
    assert len(outs) < len(expected.token_ids) and outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_merge_delta_joins_completions_by_index():
    first = RequestOutput("r", None, [1], None, [CompletionOutput(0, "a", [5], -1.0, [{5: Logprob(-1.0, 1)}])], False)
    second = RequestOutput("r", None, [1], None, [CompletionOutput(1, "x", [9]),
                                                 CompletionOutput(0, "b", [6], -3.0, [{6: Logprob(-2.0, 1)}],
                                                                  "length")], True, RequestMetrics(0.0), None)
    merge_delta(first, second)
    assert [c.index for c in first.outputs] == [0, 1] and first.finished and first.metrics == RequestMetrics(0.0)
    assert first.outputs[0] == CompletionOutput(0, "ab", [5, 6], -3.0, [{5: Logprob(-1.0, 1)}, {6: Logprob(-2.0, 1)}],
                                                "length")
    assert first.outputs[1] == CompletionOutput(1, "x", [9])


def test_engine_process_wire_format_round_trips():
    """The prompt crosses once (first output), metrics with the last; the rest is rebuilt as sent."""
    sent: set[str] = set()
    outs = [RequestOutput("r", "hi", [1, 2], [None, {2: Logprob(-0.5, 1, "x")}],
                          [CompletionOutput(0, "a", [3, 4], None, None)], False, RequestMetrics(1.0), None),
            RequestOutput("r", "hi", [1, 2], [None, {2: Logprob(-0.5, 1, "x")}],
                          [CompletionOutput(0, "b", [5], None, None, "stop", "b")], True, RequestMetrics(1.0, 2.0),
                          "boom")]
    first, last = encode_outputs([("r", outs[0])], sent), encode_outputs([("r", outs[1]), ("q", ValueError("no"))],
                                                                         sent)
    assert first[0][4] is not None and last[0][4] is None and not sent
    prompt = first[0][4]
    decoded = [decode_output(first[0], prompt), decode_output(last[0], prompt)]
    assert decoded[0] == RequestOutput("r", "hi", [1, 2], outs[0].prompt_logprobs, outs[0].outputs, False, None)
    assert decoded[1] == outs[1]
    assert isinstance(last[1][1], ValueError)


def test_wire_outputs_decode_to_the_engines_delta_outputs(checkpoint, prompts):
    """`LLMEngine.wire_outputs` (the engine process): a DELTA request without a parent comes out as
    the wire tuple, which decodes to what the engine returns as objects; n > 1 stays objects. Same
    requests through one engine each way (prompt once, text deltas, logprobs, stop, n=2)."""
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=1,
                             output_kind=RequestOutputKind.DELTA),
              SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=6, output_kind=RequestOutputKind.DELTA),
              SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[17], output_kind=RequestOutputKind.DELTA)]

    def run(wire: bool) -> list:
        engine = _engine(checkpoint)
        engine.wire_outputs = wire
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(prompt, p, f"r{i}")
        got, sent, prompt_of, num_tuples = [], set(), {}, 0
        while engine.has_unfinished_requests():
            step = engine.step()
            num_tuples += sum(o.__class__ is tuple for o in step)
            for entry in encode_outputs([(o[0] if o.__class__ is tuple else o.request_id, o) for o in step], sent):
                if entry[4] is not None:
                    prompt_of[entry[0]] = entry[4]
                out = decode_output(entry, prompt_of.get(entry[0]))
                got.append((out.request_id, out.prompt_token_ids, out.outputs, out.finished, out.error))
        assert (num_tuples > 0) == wire
        return got

    objects, wired = run(False), run(True)
    assert wired == objects
    assert {rid for rid, *_ in wired} == {"r0", "r1", "r2"} and any(len(o[2]) == 1 and o[0] == "r1" for o in wired)
