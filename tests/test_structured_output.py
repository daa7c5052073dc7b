"""Structured output (runner/structured_output, xgrammar): parameters, grammar validation, the
bitmask kernel, the matchers' stop rule, and end-to-end on the embedded SmolLM2: 50 random JSON
schemas (greedy and sampled), regexes, choices, an EBNF grammar, json_object, a bad schema, mixed
batches, a refused token, a slow compile and async scheduling."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from configs import SamplingParams, StructuredOutputsParams
from random_schemas import random_schemas

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")


# ---- parameters and validation (no model) -------------------------------------------------------
def test_params_take_exactly_one_constraint():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert SamplingParams(structured_outputs={"choice": ["x", "y"]}).structured_outputs.choice == ["x", "y"]
    for bad in ({}, {"json": "{}", "regex": "a"}, {"choice": []}, {"json_object": False}):
        with pytest.raises(ValueError, match="structured_outputs|choice|json_object"):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ")


def test_cache_key_is_the_constraint():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).cache_key()


@pytest.mark.parametrize("params, field", [
    ({"json": {"type": "nope"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
])
def test_bad_constraints_name_the_field(params, field):
    from runner.structured_output.grammar import InvalidGrammarError, parse_grammar
    with pytest.raises(InvalidGrammarError, match=re.escape(field)):
        parse_grammar(StructuredOutputsParams(**params))


def test_choice_grammar_escapes_quotes():
    from runner.structured_output.grammar import choice_as_ebnf
    xgr.Grammar.from_ebnf(choice_as_ebnf(['say "hi"', "back\\slash", "naïve"]))


def test_bitmask_kernel_masks_only_the_indexed_rows():
    from runner.structured_output.bitmask import TokenBitmask, unpack_bitmask
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = [1, 3]
    expected = logits.clone()
    allowed = unpack_bitmask(bitmask, vocab)
    expected[rows] = expected[rows].masked_fill(~allowed[rows], float("-inf"))
    TokenBitmask(bitmask, torch.tensor(rows, dtype=torch.int32), vocab).apply(logits)
    assert torch.equal(logits, expected)


def test_structured_greedy_step_masks_then_takes_the_argmax():
    """A greedy step with a constrained row skips the sampler's metadata but not the mask: the
    tokens equal the sampler's (the full path) and the fast greedy path is never asked."""
    from runner.sampling import Sampler, SamplingMetadata, SamplingStage
    from runner.scheduler import ScheduledRequest
    from runner.structured_output.bitmask import TokenBitmask, unpack_bitmask
    gen = torch.Generator().manual_seed(1)
    vocab, rows = 300, 6
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    constrained = torch.tensor([0, 2, 5], dtype=torch.int32)
    params = SamplingParams(temperature=0.0)
    reqs = [ScheduledRequest(f"r{i}", [0], 0, [], True, params, 0, -1, frozenset({2}), [5], None, False)
            for i in range(rows)]

    def never():
        raise AssertionError("the fast greedy path ignores the mask")

    stage = SamplingStage(vocab, torch.device("cpu"))
    got = stage.launch(reqs, lambda: logits.clone(), never,
                       token_bitmask=TokenBitmask(bitmask, constrained, vocab)).resolve().sampled
    metadata = SamplingMetadata.from_params([params] * rows, {}, "cpu")
    metadata.token_bitmask = TokenBitmask(bitmask, constrained, vocab)
    expected = Sampler()(logits.clone(), metadata).sampled_token_ids.tolist()
    assert [got[f"r{i}"] for i in range(rows)] == expected
    allowed = unpack_bitmask(bitmask, vocab)
    for row in constrained.tolist():
        assert allowed[row, expected[row]]
    assert expected[1] == int(logits[1].argmax())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_ids_past_the_tokenizer_are_never_allowed(tmp_path, device):
    """A model vocabulary larger than the tokenizer's: xgrammar sees the tokenizer's (so it never
    pays for the padding ids), the device bitmask covers the model's, and the ids past the
    tokenizer's stay disallowed even where their logits are the largest."""
    from checkpoints import make_tiny_checkpoint
    from runner.structured_output import StructuredOutputManager
    from runner.structured_output.bitmask import unpack_bitmask
    from runner.tokenizer import load_tokenizer
    path, _ = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    tokenizer = load_tokenizer(str(path))          # 256 byte tokens
    model_vocab = 1000
    manager = StructuredOutputManager(tokenizer, model_vocab, 4, torch.device(device))
    try:
        assert manager.compilers.grammar_vocab_size == 256
        manager.add_request("r", StructuredOutputsParams(regex="[a-z]+")).future.result(timeout=60)

        class Row:
            request_id = "r"

        mask = manager.token_bitmask([Row()], [0])
        assert mask.bitmask.shape == (1, -(-model_vocab // 32))
        allowed = unpack_bitmask(mask.bitmask.cpu(), model_vocab)[0]
        assert allowed.nonzero().flatten().tolist() == list(range(ord("a"), ord("z") + 1))
        logits = torch.zeros(1, model_vocab, device=device)
        logits[0, 256:] = 10.0
        logits[0, ord("q")] = 1.0
        mask.apply(logits)
        assert int(logits.argmax()) == ord("q")
    finally:
        manager.shutdown()


# ---- the embedded SmolLM2 -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from runner import LLM
    llm = LLM(model="default", seed=0)
    yield llm
    llm.shutdown()


def chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)


def test_eos_only_where_the_grammar_may_end(llm):
    from runner.structured_output.bitmask import unpack_bitmask
    manager = llm.engine.structured_output
    tokenizer, vocab = llm.tokenizer, llm.engine.spec.vocab_size
    eos = sorted(llm.engine.scheduler.eos_token_ids)
    state = manager.add_request("eos-check", StructuredOutputsParams(regex="[0-9]{2}"))
    state.stop_token_ids = eos
    try:
        state.future.result(timeout=60)

        class Row:
            request_id = "eos-check"

        def allowed() -> torch.Tensor:
            return unpack_bitmask(manager.token_bitmask([Row()], [0]).bitmask, vocab)[0]

        one = tokenizer.convert_tokens_to_ids("1")
        assert allowed()[one] and not allowed()[eos].any()
        assert manager.accept({"eos-check": one}) == {}
        assert manager.accept({"eos-check": one}) == {}
        mask = allowed()
        assert mask[eos].all() and int(mask.sum()) == len(eos)   # complete: only EOS
        assert "eos-check" in manager.accept({"eos-check": one})     # a third digit is refused
        assert manager.accept({"eos-check": eos[0]}) == {} and manager.is_terminated("eos-check")
    finally:
        manager.remove("eos-check")


@pytest.mark.slow
def test_one_steps_accepts_fail_only_the_refused_rows(llm):
    """`accept` takes a whole step's tokens: each matcher advances by its own token, only the
    refused rows get an error, requests without a grammar are skipped."""
    manager, tokenizer = llm.engine.structured_output, llm.tokenizer
    ids = ["digits-a", "digits-b", "digits-c"]
    for request_id in ids:
        manager.add_request(request_id, StructuredOutputsParams(regex="[0-9]{2}")).future.result(timeout=60)
    try:
        one, letter = tokenizer.convert_tokens_to_ids("1"), tokenizer.convert_tokens_to_ids("a")
        errors = manager.accept({"digits-a": one, "free": letter, "digits-b": letter, "digits-c": one})
        assert list(errors) == ["digits-b"] and "sampled token" in errors["digits-b"]
        assert manager.accept({"digits-a": one, "digits-c": one}) == {}          # both advanced by one digit
        assert set(manager.accept({"digits-a": one, "digits-c": one})) == {"digits-a", "digits-c"}  # a third
    finally:
        for request_id in ids:
            manager.remove(request_id)


def test_fifty_random_json_schemas_greedy_and_sampled(llm):
    schemas = random_schemas(50, seed=0)
    prompts = [chat(llm, "Reply with JSON matching this schema: " + json.dumps(s)) for s in schemas]
    # disable_any_whitespace: compact JSON. With free whitespace this small model sometimes emits
    # newlines until max_tokens (valid under the grammar, but never finished).
    greedy = [SamplingParams(temperature=0.0, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for s in schemas]
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=160,
                              structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
               for i, s in enumerate(schemas)]
    outputs = llm.generate(prompts * 2, greedy + sampled, use_tqdm=False)
    for output, schema in zip(outputs, schemas * 2):
        completion = output.outputs[0]
        assert output.error is None and completion.finish_reason == "stop", (completion.text, schema)
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    regexes = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no), because [a-z ]{1,20}\.", r"[A-Z][a-z]{1,8} [0-9]{1,2}"]
    choices = [["Paris", "London", "Berlin"], ["positive", "negative", "neutral"]]
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    cases = ([("Give an example.", {"regex": r}) for r in regexes]
             + [("What is the capital of France?", {"choice": c}) for c in choices]
             + [("Write an arithmetic expression.", {"grammar": grammar}),
                ('Reply with a JSON object like {"name": "Tom"} naming a cat.',
                 {"json_object": True, "disable_any_whitespace": True})])
    prompts, params = [], []
    for question, constraint in cases:
        for temperature in (0.0, 0.8):
            prompts.append(chat(llm, question))
            params.append(SamplingParams(temperature=temperature, seed=7, max_tokens=80,
                                         structured_outputs=StructuredOutputsParams(**constraint)))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, p in zip(outputs, params):
        text, so = output.outputs[0].text, p.structured_outputs
        assert output.error is None and output.outputs[0].finish_reason == "stop", (text, so)
        if so.regex is not None:
            assert re.fullmatch(so.regex, text), (text, so.regex)
        elif so.choice is not None:
            assert text in so.choice
        elif so.grammar is not None:
            assert re.fullmatch(r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)", text), text
        else:
            assert isinstance(json.loads(text), dict)


def test_bad_schema_is_refused_at_add_request(llm):
    from runner.engine import InvalidRequestError
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object",
                                                                         "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.json: the JSON schema is not valid"):
        llm.engine.add_request(chat(llm, "Hi"), bad)
    assert not llm.engine.has_unfinished_requests()
    good = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate([chat(llm, "Hi"), chat(llm, "Hi")], [bad, good], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "abort" and "structured_outputs.json" in outputs[0].error
    assert outputs[1].error is None and outputs[1].outputs[0].token_ids


def _free_requests(llm):
    prompts = [chat(llm, "What is the capital of France?"), chat(llm, "List three fruits.")]
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    return prompts, params


def test_mixed_batch_free_requests_equal_their_unconstrained_output(llm):
    prompts, params = _free_requests(llm)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    structured = [SamplingParams(temperature=t, seed=1, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
                  for t in (0.0, 0.8)]
    outputs = llm.generate([prompts[0], prompts[0], prompts[0], prompts[1]],
                           [structured[0], params[0], structured[1], params[1]], use_tqdm=False)
    assert [outputs[1].outputs[0].token_ids, outputs[3].outputs[0].token_ids] == alone
    for output in (outputs[0], outputs[2]):
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_a_refused_token_fails_that_request_alone(llm):
    engine = llm.engine
    manager = engine.structured_output
    prompts, params = _free_requests(llm)
    alone = llm.generate(prompts[:1], params[:1], use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.0, max_tokens=10,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    engine.model_runner.token_bitmask_provider = lambda reqs, rows: None   # no mask: the model's own choice
    try:
        outputs = llm.generate([prompts[0], prompts[0]], [constrained, params[0]], use_tqdm=False)
    finally:
        engine.model_runner.token_bitmask_provider = manager.token_bitmask
    assert outputs[0].outputs[0].finish_reason == "abort"
    assert "does not accept the sampled token" in outputs[0].error
    assert outputs[1].error is None and outputs[1].outputs[0].token_ids == alone
    assert not manager.states and not engine.has_unfinished_requests()


def test_a_request_waits_for_its_compile_while_others_run(llm, monkeypatch):
    from runner.structured_output.grammar import GrammarCompilerService
    compile_grammar = GrammarCompilerService._compile

    def slow_compile(self, grammar):
        time.sleep(1.0)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(GrammarCompilerService, "_compile", slow_compile)
    prompts, params = _free_requests(llm)
    structured = SamplingParams(temperature=0.0, max_tokens=10,
                                structured_outputs=StructuredOutputsParams(regex="[a-z]{1,4}-(slow|compile)"))
    outputs = llm.generate([prompts[0], prompts[0]], [structured, params[0]], use_tqdm=False)
    assert re.fullmatch("[a-z]{1,4}-(slow|compile)", outputs[0].outputs[0].text)
    assert outputs[1].metrics.first_token_time < outputs[0].metrics.first_token_time


@pytest.mark.slow
def test_async_scheduling_gives_the_synchronous_outputs(llm):
    from runner import LLM
    prompts, free = _free_requests(llm)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    params = [SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}!")), *free]
    prompts = [prompts[0], prompts[1], *prompts]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model="default", seed=0, async_scheduling=True) as async_llm:
        assert async_llm.engine.async_scheduling
        got = [o.outputs[0].token_ids for o in async_llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_benchmark_cpu_smoke(tmp_path, capsys):
    from runner.benchmarks.structured import main
    assert main(["--out", str(tmp_path), "--cpu-small", "--host-profile"]) == 0
    printed = capsys.readouterr().out
    assert "host profile of one structured run" in printed and "token_bitmask" in printed
    result = json.loads((tmp_path / "structured.json").read_text())
    summary = result["summary"]
    assert summary["free_decode_tok_s"] > 0 and summary["structured_decode_tok_s"] > 0
    assert len(result["runs"]["structured"][0]["step_seconds"]) >= summary["steps"]


def test_benchmark_xgrammar_only_times_accepts_and_fills(tmp_path, capsys):
    from runner.benchmarks.structured import main
    assert main(["--out", str(tmp_path), "--xgrammar-only", "--rows", "4"]) == 0
    assert "4 matchers" in capsys.readouterr().out
    (costs,) = json.loads((tmp_path / "xgrammar.json").read_text())
    assert costs["rows"] == 4 and costs["accept_per_matcher_ms"] > 0 and costs["accept_batched_ms"] > 0
    assert set(costs["fill_ms_by_threads"]) == {"1", "2", "4", "8", "16"}


def test_fill_threads_grow_with_the_rows():
    from runner.structured_output.manager import MAX_FILL_THREADS, fill_threads
    assert fill_threads(1) == fill_threads(32) == fill_threads(63) == 1
    assert fill_threads(64) == min(2, MAX_FILL_THREADS)
    assert fill_threads(10_000) == MAX_FILL_THREADS


# ---- GPU (cuda marker: skipped without one) -----------------------------------------------------
@pytest.mark.cuda
def test_bitmask_kernel_on_the_gpu_matches_the_reference():
    from runner.structured_output.bitmask import TokenBitmask, unpack_bitmask
    gen = torch.Generator().manual_seed(1)
    vocab = 128256
    logits = torch.randn(32, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (32, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = [0, 5, 31]
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~unpack_bitmask(bitmask, vocab)[rows], float("-inf"))
    got = logits.cuda()
    TokenBitmask(bitmask.cuda(), torch.tensor(rows, dtype=torch.int32, device="cuda"), vocab).apply(got)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constraints_hold_with_cuda_graphs_and_dummy_weights(async_scheduling, tmp_path):
    """Whatever the weights, the output matches the constraint; free greedy rows sharing the steps
    (graph replays, FULL_AND_PIECEWISE) equal their output alone. A tiny checkpoint with the
    one-byte-per-token test tokenizer: it needs nothing but what the tests build."""
    from checkpoints import make_tiny_checkpoint

    from runner import LLM
    path = str(make_tiny_checkpoint(tmp_path / "tiny", "llama_gqa")[0])
    prompts = [[3 + (i * 31 + j) % 200 for j in range(12)] for i in range(6)]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = [SamplingParams(temperature=t, seed=2, max_tokens=24,
                                  structured_outputs=StructuredOutputsParams(**c))
                   for t in (0.0, 0.8) for c in ({"regex": "[0-9]{3}-[a-z]{2}"}, {"choice": ["alpha", "beta"]})]
    with LLM(model=path, load_format="dummy", dtype="bfloat16", device="cuda", async_scheduling=async_scheduling,
             max_model_len=256) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], free, use_tqdm=False)]
        outputs = llm.generate(prompts, [free, free, *constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:2]] == alone
    for output, p in zip(outputs[2:], constrained):
        so, text = p.structured_outputs, output.outputs[0].text
        assert output.error is None
        assert (re.fullmatch(so.regex, text) if so.regex else text in so.choice), text
