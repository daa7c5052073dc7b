"""Structured output under async scheduling: step n+1 is launched with step n in flight, and its
bitmask is filled (after n's tokens reach the matchers, `LLMEngine._accept_early`) while n+1's
forward runs. Proof that it changes nothing but the overlap: the same tokens, texts and finish
reasons as the synchronous engine, on a tiny random checkpoint with a byte-level tokenizer, for
JSON, regex, choice and EBNF constraints, greedy and seeded, beside free requests; that the fill
really happens with a step in flight (no drain) and that step is applied while the rows fill;
and that a row whose grammar the token in flight completed gets a mask without touching its
terminated matcher."""

from __future__ import annotations

import json
import re

import pytest

from configs import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from checkpoints import make_tiny_checkpoint
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")
    return path


def requests():
    constraints = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                   StructuredOutputsParams(regex="[a-z]{2,5}-[0-9]{1,3}"),
                   StructuredOutputsParams(choice=["yes", "no", "maybe"]),
                   StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("," [0-9]+)* ")"')]
    prompts, params = [], []
    for i, constraint in enumerate(constraints):
        for temperature in (0.0, 0.9):
            prompts.append(f"prompt {i} {temperature}")
            params.append(SamplingParams(temperature=temperature, seed=11 + i, max_tokens=24,
                                         structured_outputs=constraint))
    prompts += ["free greedy", "free sampled"]
    params += [SamplingParams(temperature=0.0, max_tokens=16),
               SamplingParams(temperature=0.8, seed=3, max_tokens=16, repetition_penalty=1.3)]
    return prompts, params


def generate(path, async_scheduling: bool, watch=None):
    from runner import LLM
    prompts, params = requests()
    with LLM(model=str(path), seed=0, async_scheduling=async_scheduling, max_num_seqs=6) as llm:
        assert llm.engine.async_scheduling == async_scheduling
        if watch is not None:
            watch(llm.engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.error) for o in outputs]


def test_async_structured_output_equals_synchronous(tiny):
    fills = []

    def watch(engine):
        manager = engine.structured_output
        fill = manager.token_bitmask

        def recording(reqs, rows):
            # The step launched before this one is still in flight (no drain) whenever it exists,
            # and the fill first advances the matchers by its tokens (`before_fill`).
            in_flight, hook = engine._in_flight is not None, manager.before_fill
            fills.append((in_flight, hook is not None))
            return fill(reqs, rows)

        engine.model_runner.token_bitmask_provider = recording

    expected = generate(tiny, False)
    got = generate(tiny, True, watch)
    assert got == expected
    assert any(in_flight for in_flight, _ in fills)
    assert all(hook == in_flight for in_flight, hook in fills)
    texts = [text for _, text, _, error in got[:8]]
    assert all(error is None for *_, error in got)
    for text in texts[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(re.fullmatch("[a-z]{2,5}-[0-9]{1,3}", t) for t in texts[2:4])
    assert all(t in ("yes", "no", "maybe") for t in texts[4:6])
    assert all(re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", t) or len(tokens) == 24
               for (tokens, *_), t in zip(got[6:8], texts[6:8]))


def test_a_terminated_matcher_gets_a_full_row(tiny):
    """The token in flight completed the grammar: the next step's row (discarded when the token is
    applied) is all ones, and the other rows are filled as usual."""
    import torch

    from runner import LLM
    from runner.structured_output.bitmask import unpack_bitmask
    with LLM(model=str(tiny), seed=0) as llm:
        manager = llm.engine.structured_output
        eos = sorted(llm.engine.scheduler.eos_token_ids)
        for request_id in ("done", "open"):
            state = manager.add_request(request_id, StructuredOutputsParams(choice=["ab"]))
            state.stop_token_ids = eos
            state.future.result(timeout=60)
        for token in (ord("a"), ord("b"), eos[0]):
            assert manager.accept({"done": token}) == {}
        assert manager.is_terminated("done")

        class Row:
            def __init__(self, request_id):
                self.request_id = request_id

        mask = unpack_bitmask(manager.token_bitmask([Row("done"), Row("open")], [0, 1]).bitmask, 256)
        assert mask[0].all()
        assert mask[1].nonzero().flatten().tolist() == [ord("a")]
        assert torch.equal(manager.token_bitmask([Row("open")], [0]).bitmask[0], manager._host()[0])
