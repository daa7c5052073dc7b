"""Async scheduling: step n+1 is scheduled and launched before step n's tokens are known.

Scheduler level (FakeRunner from test_scheduler plays the model through a simulated KV cache,
so a wrong slot, a wrong placeholder row or a stale prefix-cache hash changes the tokens):
the in-flight and placeholder accounting, the length-limit skip, dropped work of requests that
stopped, drains instead of preemption, cancel_step, and random workloads equal to the reference.

Engine level, on the real embedded SmolLM2 (fp32, CPU; `async_scheduling=True` forces the async
path on a CPU): token-for-token the same outputs (tokens, text, finish reason, logprobs) as the
synchronous engine, for greedy, seeded sampling, stop strings/ids/EOS, max/min tokens, aborts of
a request in flight, chunked prefill, prefix caching, preemption and requests added between steps.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import event, given, settings, strategies as st

import runner.kv_cache_manager as kv_cache_manager
from configs import EngineConfig, SamplingParams
from runner.request import RequestStatus
from runner.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler
from test_scheduler import BS, EOS, FakeRunner, assert_attention_counts, make_request, reference


def make_async_scheduler(num_blocks=64, budget=64, max_seqs=8, caching=True, max_model_len=64):
    from configs import CacheConfig, SchedulerConfig
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, async_scheduling=True),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks, max_model_len, {EOS})


class AsyncDriver:
    """The async engine loop over a FakeRunner: schedule n+1, "launch" it (placeholders filled from
    step n's sampled rows, as the runner gathers them on the device), then apply step n."""

    def __init__(self, sched: Scheduler, runner: FakeRunner | None = None) -> None:
        self.sched, self.runner = sched, runner or FakeRunner(sched.kv.num_blocks)
        self.in_flight: tuple[dict[str, int], list[int]] | None = None
        self.outputs, self.drains = [], 0

    def launch(self, out) -> tuple[dict[str, int], list[int]]:
        _, prev_rows = self.in_flight if self.in_flight is not None else ({}, [])
        token_rows, placeholders = [], []
        offset = 0
        for s in out.scheduled:
            if PLACEHOLDER_TOKEN_ID in s.token_ids:
                assert s.token_ids == [PLACEHOLDER_TOKEN_ID] and s.sample
                token_rows.append(offset)
                placeholders.append(s)
            offset += len(s.token_ids)
        assert token_rows == out.prev_token_rows and len(out.prev_sample_rows) == len(token_rows)
        for s, row in zip(placeholders, out.prev_sample_rows):
            s.token_ids = [prev_rows[row]]
        sampled = self.runner.execute(out)
        return sampled, [sampled[s.request_id] for s in out.scheduled if s.sample]

    def step(self) -> None:
        sched = self.sched
        out = sched.schedule()
        if out is None:
            assert self.in_flight is not None
            self.drains += 1
            sched.update(self.in_flight[0])
            self.in_flight = None
            out = sched.schedule()
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        self.outputs.append(out)
        launched = self.launch(out) if out.scheduled else None
        if self.in_flight is not None:
            sched.update(self.in_flight[0])
        self.in_flight = launched

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests() and self.in_flight is None:
                return
            self.step()
        raise AssertionError("requests did not finish")


# ---- scheduler -------------------------------------------------------------------------------------
def test_placeholder_and_in_flight_accounting():
    sched = make_async_scheduler()
    a = make_request("a", [5, 6, 7, 8, 9], max_tokens=4)   # 5 tokens: the placeholder opens block 2
    b = make_request("b", [3, 4], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    assert [s.token_ids for s in first.scheduled] == [[5, 6, 7, 8, 9], [3, 4]] and first.prev_token_rows == []
    assert (a.num_inflight_tokens, a.num_output_placeholders, a.placeholder_row) == (5, 1, 0)
    assert (b.num_inflight_tokens, b.num_output_placeholders, b.placeholder_row) == (2, 1, 1)
    assert a.num_computed_tokens == 0 and a.num_output_tokens == 0

    second = sched.schedule()  # step 1 in flight: both decode their placeholder
    sa, sb = second.scheduled
    assert (sa.token_ids, sa.num_computed_tokens, sa.output_token_count) == ([-1], 5, 1)
    assert (sb.token_ids, sb.num_computed_tokens) == ([-1], 2)
    assert (second.prev_token_rows, second.prev_sample_rows) == ([0, 1], [0, 1])
    assert second.num_scheduled_tokens == 2
    assert len(a.block_ids) == 2  # position 5 (the placeholder's) is in the second block of 4
    assert (a.num_inflight_tokens, a.num_output_placeholders) == (6, 2)
    with pytest.raises(RuntimeError, match="one step in flight"):
        sched.schedule()

    assert sched.update({"a": 11, "b": 12}) == [a, b]  # step 1 applied; step 2 still in flight
    assert a.output_token_ids == [11] and a.num_computed_tokens == 5
    assert (a.num_inflight_tokens, a.num_output_placeholders) == (1, 1)
    third = sched.schedule()
    assert third.prev_sample_rows == [0, 1]  # rows of step 2's sampled tokens
    assert [s.num_computed_tokens for s in third.scheduled] == [6, 3]
    sched.update({"a": 13, "b": 14})
    sched.update({"a": 15, "b": 16})
    assert a.output_token_ids == [11, 13, 15] and a.num_computed_tokens == 7 and a.num_inflight_tokens == 0
    assert sched.num_steps_pending == 0


def test_rows_follow_the_order_of_sampling_requests():
    """A non-final prefill chunk samples nothing, so it has no row; rows count sampling requests only."""
    sched = make_async_scheduler(budget=6)
    a, b, c = make_request("a", [3]), make_request("b", [4] * 9), make_request("c", [5])
    for r in (a, b):
        sched.add_request(r)
    first = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in first.scheduled] == [("a", 1, True), ("b", 5, False)]
    sched.add_request(c)
    second = sched.schedule()  # a decodes its placeholder, b's prefill goes on (known tokens), c is admitted
    assert [(s.request_id, s.token_ids) for s in second.scheduled] == [("a", [-1]), ("b", [4] * 4), ("c", [5])]
    assert (second.prev_token_rows, second.prev_sample_rows) == ([0], [0])
    assert (a.placeholder_row, b.placeholder_row, c.placeholder_row) == (0, 1, 2)


def test_length_limit_in_flight_is_not_scheduled():
    sched = make_async_scheduler()
    one, two = make_request("one", [3, 4], max_tokens=1), make_request("two", [5, 6], max_tokens=2)
    sched.add_request(one)
    sched.add_request(two)
    sched.schedule()
    second = sched.schedule()
    assert [s.request_id for s in second.scheduled] == ["two"]  # one's token in flight is its last
    sched.update({"one": 9, "two": 9})
    assert one.finish_reason == "length" and two.status is RequestStatus.RUNNING
    assert sched.schedule().scheduled == []  # two's token in flight is its last as well
    sched.update({"two": 9})
    assert two.finish_reason == "length" and not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("how", ["stop token", "abort", "stop string"])
def test_work_of_a_request_that_stopped_is_dropped(how):
    sched = make_async_scheduler()
    a, b = make_request("a", [3, 4], max_tokens=8, stop_token_ids=[7]), make_request("b", [5, 6], max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    sched.schedule()  # both decode their placeholders in step 2
    if how == "abort":
        sched.abort_request("a")
    updated = sched.update({"a": 7 if how == "stop token" else 8, "b": 9})
    if how == "stop string":  # the engine's detokenizer finds it after the update
        sched.finish_request("a", "stop", stop_reason="x")
    assert a.is_finished and a.block_ids == []
    assert updated == ([b] if how == "abort" else [a, b])
    assert sched.update({"a": 10, "b": 11}) == [b]  # a's step-2 token is dropped
    assert a.output_token_ids == ([] if how == "abort" else [7 if how == "stop token" else 8])
    assert b.output_token_ids == [9, 11]
    assert sched.schedule().finished_ids == ["a"]


def test_preemption_with_a_step_in_flight_drains():
    # 6 blocks of 4: two requests growing to 6 + 12 tokens cannot both stay.
    sched = make_async_scheduler(num_blocks=6, max_model_len=24, caching=False)
    a, b = make_request("a", [7] * 6, max_tokens=12), make_request("b", [8] * 6, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    driver = AsyncDriver(sched)
    while True:
        before = [(r.num_inflight_tokens, r.num_output_placeholders, r.placeholder_row, len(r.block_ids)) for r in (a, b)]
        out = sched.schedule()
        if out is None:
            break
        driver.outputs.append(out)
        launched = driver.launch(out)
        if driver.in_flight is not None:
            sched.update(driver.in_flight[0])
        driver.in_flight = launched
    # Nothing preempted and the accounting as before the refused schedule (blocks may have grown).
    after = [(r.num_inflight_tokens, r.num_output_placeholders, r.placeholder_row) for r in (a, b)]
    assert after == [x[:3] for x in before] and sched.num_drains == 1 and sched.num_preemptions == 0
    sched.update(driver.in_flight[0])
    driver.in_flight = None
    out = sched.schedule()  # nothing in flight: preempts as the synchronous scheduler does
    assert out.preempted_ids == ["b"] and sched.num_preemptions == 1
    driver.outputs.append(out)
    driver.in_flight = driver.launch(out)
    driver.run()
    for r in (a, b):
        assert r.output_token_ids == reference(r.prompt_token_ids, 12) and r.finish_reason == "length"
    assert sched.kv.num_free_blocks == 6


def test_cancel_step_forgets_the_newest_step():
    sched = make_async_scheduler()
    a = make_request("a", [3, 4, 5], max_tokens=6)
    sched.add_request(a)
    runner = FakeRunner(64)
    first = sched.schedule()
    sampled = runner.execute(first)
    second = sched.schedule()
    sched.cancel_step()  # the launch of step 2 failed
    assert (a.num_inflight_tokens, a.num_output_placeholders, a.placeholder_row) == (3, 1, 0)
    again = sched.schedule()
    assert [(s.token_ids, s.num_computed_tokens) for s in again.scheduled] == [
        (s.token_ids, s.num_computed_tokens) for s in second.scheduled]
    assert (again.prev_token_rows, again.prev_sample_rows) == (second.prev_token_rows, second.prev_sample_rows)
    sched.cancel_step()
    sched.cancel_step()  # and step 1's tokens were lost as well: back to nothing scheduled
    assert (a.num_inflight_tokens, a.num_output_placeholders, a.num_computed_tokens) == (0, 0, 0)
    assert sched.schedule().scheduled[0].token_ids == [3, 4, 5]
    del sampled


def test_hashes_see_only_real_tokens(monkeypatch):
    seen = []
    real = kv_cache_manager.hash_block

    def checked(parent, token_ids):
        assert PLACEHOLDER_TOKEN_ID not in token_ids
        seen.append(tuple(token_ids))
        return real(parent, token_ids)

    monkeypatch.setattr(kv_cache_manager, "hash_block", checked)
    sched = make_async_scheduler()
    shared = list(range(20, 29))
    a = make_request("a", shared + [1], max_tokens=9)
    sched.add_request(a)
    AsyncDriver(sched).run()
    assert a.output_token_ids == reference(a.prompt_token_ids, 9)
    full = a.all_token_ids
    assert seen and all(block == tuple(full[i * BS:(i + 1) * BS]) for i, block in enumerate(seen))
    b = make_request("b", full[:17])  # prompt + outputs of a: every full block is a hit
    sched.add_request(b)
    (s,) = sched.schedule().scheduled
    assert s.num_computed_tokens == 16 == b.num_cached_tokens and s.token_ids == full[16:17]


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.sampled_from([(), (1, 2, 3, 4, 5), (6,) * 8]),
                                  st.lists(st.integers(10, 40), min_size=1, max_size=10),
                                  st.integers(1, 16)), min_size=1, max_size=6),
       num_blocks=st.integers(8, 12), budget=st.integers(1, 24), max_seqs=st.integers(1, 4),
       caching=st.booleans(), add_late=st.integers(0, 3))
def test_random_async_workloads_match_reference(prompts, num_blocks, budget, max_seqs, caching, add_late):
    sched = make_async_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, caching=caching,
                                 max_model_len=32)
    reqs = [make_request(f"r{i}", list(p) + s, max_tokens=n) for i, (p, s, n) in enumerate(prompts)]
    driver = AsyncDriver(sched)
    for i, r in enumerate(reqs):
        sched.add_request(r)
        if i < add_late:  # some requests arrive while a step is in flight
            driver.step()
    driver.run()
    event(f"drained: {driver.drains > 0}")
    event(f"pipelined: {any(o.prev_token_rows for o in driver.outputs)}")
    assert driver.drains == sched.num_drains
    for r in reqs:
        expected = reference(r.prompt_token_ids, min(r.sampling_params.max_tokens, 32 - r.num_prompt_tokens))
        assert r.output_token_ids == expected
        assert r.num_inflight_tokens == 0 or r.is_finished
    assert sched.kv.num_free_blocks == num_blocks and sched.kv.usage == 0.0
    assert_attention_counts(sched, driver.outputs)


def test_input_batch_fills_placeholders_from_the_previous_tokens():
    """Decode batch and mixed batch: placeholder rows take the previous step's sampled tokens (on the
    device, here the CPU), the other rows keep their host-built ids; the guard is inert on a CPU."""
    from runner.input_batch import InputBatch
    batch = InputBatch(16, 4, 4, BS, torch.device("cpu"), guard_uploads=True)
    assert not batch.guard_uploads
    prev = torch.tensor([70, 71, 72])
    batch.prepare([[-1], [-1], [5]], [3, 6, 2], [[0, 1], [2, 3], [1]], 3, 3, placeholders=([0, 1], [2, 0], prev))
    assert batch.input_ids.np[:3].tolist() == [72, 70, 5]
    batch.prepare([[8, 9, 10], [-1], [-1]], [0, 4, 7], [[0], [1, 2], [3, 0]], 5, 3,
                  placeholders=([3, 4], [1, 2], prev))
    assert batch.input_ids.np[:5].tolist() == [8, 9, 10, 71, 72]
    assert batch.positions.np[:5].tolist() == [0, 1, 2, 4, 7]


def test_config_auto_and_pipeline_parallel():
    config = EngineConfig.from_kwargs(model="m")
    assert config.scheduler.async_scheduling is None
    assert config.resolve_async_scheduling("cuda") and not config.resolve_async_scheduling("cpu")
    assert EngineConfig.from_kwargs(model="m", async_scheduling=True).resolve_async_scheduling("cpu")
    assert not EngineConfig.from_kwargs(model="m", async_scheduling=False).resolve_async_scheduling("cuda")
    assert not EngineConfig.from_kwargs(model="m", pipeline_parallel_size=2).resolve_async_scheduling("cuda")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        EngineConfig.from_kwargs(model="m", async_scheduling=True, pipeline_parallel_size=2)


# ---- engine, on the real SmolLM2 -------------------------------------------------------------------
QUESTIONS = ["What is the capital of France?", "Hi", "Write a short poem about the sea.", "What is 12 times 7?",
             "List three fruits."]
NUM_BLOCKS = 20
"""A small KV cache (320 tokens, max_model_len 256): the preemption test overfills it."""


@pytest.fixture(scope="module")
def smollm2_engines():
    """One engine per mode, the same configuration otherwise (sync first: the reference)."""
    from models.embedded import EmbeddedModelError, ensure_smollm2
    from runner import LLM
    try:
        path = ensure_smollm2()
    except EmbeddedModelError as error:
        pytest.skip(str(error))
    engines = {mode: LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=NUM_BLOCKS,
                         max_model_len=256, max_num_batched_tokens=128, async_scheduling=mode)
               for mode in (False, True)}
    assert not engines[False].engine.async_scheduling and engines[True].engine.async_scheduling
    tokenizer = engines[False].tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    return engines, prompts


def _view(out):
    return out.outputs[0].token_ids, out.outputs[0].text, out.finished, out.outputs[0].finish_reason, out.outputs[0].stop_reason, out.outputs[0].logprobs


def generate_both(engines, prompts, params):
    """generate() on both engines; the async outputs must equal the sync ones field by field."""
    results = {mode: llm.generate(prompts, params, use_tqdm=False) for mode, llm in engines.items()}
    assert [_view(o) for o in results[True]] == [_view(o) for o in results[False]]
    for llm in engines.values():
        engine = llm.engine
        assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage == 0.0
        assert engine.scheduler.num_steps_pending == 0
    return results[True]


@contextlib.contextmanager
def token_budget(engines, budget: int):
    """A smaller max_num_batched_tokens for a while (the runner's buffers are sized for more)."""
    configs = [llm.engine.scheduler.config for llm in engines.values()]
    old = [c.max_num_batched_tokens for c in configs]
    for c in configs:
        c.max_num_batched_tokens = budget
    try:
        yield
    finally:
        for c, value in zip(configs, old):
            c.max_num_batched_tokens = value


def test_greedy_mixed_lengths_and_logprobs(smollm2_engines):
    engines, prompts = smollm2_engines
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 7, 16, 3, 12)]
    params[2] = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    outs = generate_both(engines, prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 7, 16, 3, 12]
    assert len(outs[2].outputs[0].logprobs) == 16 and all(len(entry) >= 3 for entry in outs[2].outputs[0].logprobs)
    assert all(o.outputs[0].finish_reason == "length" and o.metrics.first_token_latency > 0 for o in outs)


def test_seeded_sampling(smollm2_engines):
    engines, prompts = smollm2_engines
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=12, ignore_eos=True)
              for i in range(3)]
    params[1] = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = generate_both(engines, prompts[:3], params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def test_stop_strings_stop_ids_eos_min_and_max_tokens(smollm2_engines):
    engines, prompts = smollm2_engines
    reference = engines[False].generate(prompts, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    assert "Paris" in reference[0].outputs[0].text and any(o.outputs[0].finish_reason == "stop" for o in reference)  # EOS ends some
    stop_id = reference[2].outputs[0].token_ids[4]
    eos = next(i for i in (1, 3) if reference[i].outputs[0].finish_reason == "stop")  # plain params below: EOS
    eos_at = len(reference[eos].outputs[0].token_ids)  # its EOS is the last of these
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=["Paris"]),
              SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.0, max_tokens=5),
              SamplingParams(temperature=0.0, max_tokens=eos_at + 4, min_tokens=eos_at + 2)]
    outs = generate_both(engines, prompts + [prompts[eos]], params)
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == "Paris" and "Paris" not in outs[0].outputs[0].text
    assert outs[eos].outputs[0].token_ids == reference[eos].outputs[0].token_ids and outs[eos].outputs[0].finish_reason == "stop"  # EOS
    assert outs[2].outputs[0].stop_reason == stop_id and outs[2].outputs[0].token_ids[-1] == stop_id
    assert len(outs[4].outputs[0].token_ids) == 5 and outs[4].outputs[0].finish_reason == "length"
    assert len(outs[5].outputs[0].token_ids) >= eos_at + 2  # the EOS within min_tokens did not stop it
    assert outs[5].outputs[0].token_ids[:eos_at - 1] == reference[eos].outputs[0].token_ids[:-1]


def test_chunked_prefill_small_budget(smollm2_engines):
    engines, prompts = smollm2_engines
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with token_budget(engines, 16):
        outs = generate_both(engines, prompts[2:5], params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_prefix_caching_shared_prefixes(smollm2_engines):
    engines, prompts = smollm2_engines
    for llm in engines.values():
        llm.engine.scheduler.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    shared = prompts[2]  # the chat template and a question: several full blocks
    batch = [shared, shared + " Keep it short.", shared + " Make it rhyme."]
    generate_both(engines, batch, params)
    generate_both(engines, batch[1:], params)  # the blocks of the first round are cached now
    for llm in engines.values():
        assert llm.engine.scheduler.stats()["prefix_cache_hit_rate"] > 0


def test_preemption_in_a_small_cache(smollm2_engines):
    engines, prompts = smollm2_engines
    before = {mode: llm.engine.scheduler.num_preemptions for mode, llm in engines.items()}
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = generate_both(engines, prompts, params)  # 5 x (31-39 + 48) tokens > 320, shared system prompt or not
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    for mode, llm in engines.items():
        assert llm.engine.scheduler.num_preemptions > before[mode]
    assert engines[True].engine.scheduler.num_drains > 0


def _step_until(engine, predicate, max_steps=200):
    collected = []
    for _ in range(max_steps):
        if predicate():
            return collected
        collected += engine.step()
    raise AssertionError("condition not reached")


def test_abort_while_in_flight(smollm2_engines):
    engines, prompts = smollm2_engines
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engines[False].generate(prompts[:2], params, use_tqdm=False)]
    engine = engines[True].engine
    engine.add_request(prompts[0], params, request_id="keep")
    engine.add_request(prompts[1], params, request_id="drop")
    assert engine.step() == [] and engine.has_unfinished_requests()  # step 1 launched, nothing applied yet
    drop = engine.scheduler.requests["drop"]
    outs = _step_until(engine, lambda: drop.num_output_tokens >= 3)
    assert drop.num_output_placeholders == 1 and engine._in_flight is not None  # its next token is in flight
    aborted = engine.abort_request("drop")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == expected[1][:3]
    while engine.has_unfinished_requests():
        outs += engine.step()
    keep = [o for o in outs if o.request_id == "keep"]
    assert keep[-1].outputs[0].token_ids == expected[0] and keep[-1].finished
    assert [len(o.outputs[0].token_ids) for o in keep] == list(range(1, 11))  # one output per token, in order
    assert all(len(o.outputs[0].token_ids) <= 3 for o in outs if o.request_id == "drop")
    assert engine.scheduler.kv.usage == 0.0 and not engine.model_runner.generators


def test_requests_added_between_steps(smollm2_engines):
    engines, prompts = smollm2_engines
    finals = {}
    for mode, llm in engines.items():
        engine, done = llm.engine, {}
        for i, prompt in enumerate(prompts[:4]):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=5 + 2 * i), request_id=f"late{i}")
            for _ in range(i + 1):
                done.update((o.request_id, o) for o in engine.step() if o.finished)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        finals[mode] = {rid: _view(o) for rid, o in done.items()}
    assert finals[True] == finals[False] and len(finals[True]) == 4


def test_a_failed_launch_or_resolve_fails_its_requests(smollm2_engines):
    """A launch that raises fails the requests of that step (the step in flight is still
    applied); a step whose tokens never arrive fails its requests and the step launched after it
    is forgotten. No step() raises; every request finishes; the engine then serves the same tokens."""
    engines, prompts = smollm2_engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in engines[False].generate(prompts[:3], params, use_tqdm=False)]
    engine = engines[True].engine
    real, calls = engine.executor.execute_async, []

    class Lost:
        sampled = None

        def resolve(self):
            raise RuntimeError("injected resolve failure")

    def flaky(sched):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected launch failure")
        pending = real(sched)
        return Lost() if len(calls) == 6 else pending

    engine.executor.execute_async = flaky
    done = {}
    try:
        for i in range(2):
            engine.add_request(prompts[i], params, request_id=f"f{i}")
        while engine.has_unfinished_requests():  # launches 1, 2, then 3 fails: f0 and f1 fail
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.add_request(prompts[2], params, request_id="f2")
        while engine.has_unfinished_requests():  # launches 4, 5, then 6 is lost: f2 fails
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        engine.executor.execute_async = real
    assert "injected launch failure" in done["f0"].error and "injected launch failure" in done["f1"].error
    assert "injected resolve failure" in done["f2"].error
    for out in done.values():
        assert out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].token_ids == expected[int(out.request_id[1])][:len(out.outputs[0].token_ids)]
    assert engine.scheduler.kv.usage == 0.0 and engine.scheduler.num_steps_pending == 0
    again = engines[True].generate(prompts[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected


# ---- on a GPU (scripts/gpu_suite.sh) ---------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "NONE"])
def test_cuda_async_matches_sync_and_never_syncs_in_a_launch(tmp_path, mode):
    """With CUDA graphs: auto turns async scheduling on, its outputs equal the synchronous engine's
    (greedy with mixed lengths and stops, seeded sampling with logprobs), and launching a step
    never waits for the GPU (`set_sync_debug_mode("error")` turns torch's implicit syncs into errors:
    a `.tolist()`, an `.item()`, a blocking host-to-device copy; it does not see Event.synchronize,
    which the upload guard uses, nor non-blocking copies from pageable memory, which the runner
    never makes)."""
    from checkpoints import make_tiny_checkpoint
    from runner import LLM
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = make_tiny_checkpoint(tmp_path / "llama", "llama_gqa")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (9,), generator=g)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    params += [SamplingParams(temperature=0.9, top_p=0.8, seed=11 + i, max_tokens=10, ignore_eos=True, logprobs=2)
               for i in range(3)]
    results = {}
    for setting in (False, None):  # sync first: it picks the stop token
        llm = LLM(model=str(path), device="cuda", dtype="float32", cudagraph_mode=mode, max_num_seqs=16,
                  max_num_batched_tokens=64, num_kv_blocks=256, async_scheduling=setting)
        engine = llm.engine
        if setting is False:
            greedy = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
            params[2] = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[greedy[3]])
        assert engine.async_scheduling == (setting is None) == engine.model_runner.input_batch.guard_uploads
        if engine.async_scheduling:
            launch = engine.executor.execute_async

            def no_sync_launch(sched):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return launch(sched)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            engine.executor.execute_async = no_sync_launch
        results[setting] = [_view(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode != "NONE":
            assert engine.model_runner.cuda_graph_ready
        llm.shutdown()
    # Tokens, text and finish exactly; logprobs to rounding (a batch that differs by a dropped row
    # may pick another cuBLAS kernel).
    assert [v[:5] for v in results[None]] == [v[:5] for v in results[False]]
    for got, want in zip(results[None], results[False]):
        if want[5] is not None:
            assert [list(e) for e in got[5]] == [list(e) for e in want[5]]
            flat = [[v for e in lp for v in e.values()] for lp in (got[5], want[5])]
            assert flat[0] == pytest.approx(flat[1], abs=1e-4)
    assert results[None][2][3] == "stop" and len(results[None][2][0]) <= 4
