"""Scheduler: budgets, chunked prefill, FCFS, preemption by recompute, aborts, stop conditions.

`FakeRunner` plays the model: it writes each scheduled token into a simulated KV cache at the
slot its block table gives, and "samples" a token that depends on the whole context it reads
back through the block table. So any scheduling or block-table mistake (a wrong chunk, a wrong
prefix-cache hit, a bad recompute after preemption) changes the generated tokens, and the
tests compare against a reference generated without any scheduler.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings, strategies as st

from configs import CacheConfig, SamplingParams, SchedulerConfig
from runner.request import Request, RequestStatus
from runner.scheduler import Scheduler, SchedulerOutput

BS = 4
EOS = 2


def next_token(context: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(context)) % 89) + 10  # never EOS


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    def __init__(self, num_blocks: int) -> None:
        self.slots: list[int | None] = [None] * (num_blocks * BS)

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // BS] * BS + pos % BS

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for s in out.scheduled:
            for i, token in enumerate(s.token_ids):
                self.slots[self._slot(s.block_ids, s.num_computed_tokens + i)] = token
        for s in out.scheduled:
            if s.sample:
                end = s.num_computed_tokens + len(s.token_ids)
                sampled[s.request_id] = next_token([self.slots[self._slot(s.block_ids, p)] for p in range(end)])
        return sampled


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, chunked=True, caching=True, max_model_len=64):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks, max_model_len, {EOS})


def make_request(rid, prompt, **params) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(**params))


def run_all(sched: Scheduler, runner: FakeRunner | None = None, max_steps: int = 500) -> list[SchedulerOutput]:
    """Drive to completion, checking the per-step limits; returns every step's output."""
    runner = runner or FakeRunner(sched.kv.num_blocks)
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs and len(sched.running) <= sched.config.max_num_seqs
        outputs.append(out)
        sched.update(runner.execute(out))
    raise AssertionError("requests did not finish")


def test_budget_max_num_seqs_and_fcfs():
    sched = make_scheduler(budget=10, max_seqs=3, chunked=False)
    reqs = [make_request(f"r{i}", [i + 3] * 4) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    first = sched.schedule()
    assert [s.request_id for s in first.scheduled] == ["r0", "r1"]  # a third 4-token prompt exceeds 10
    runner = FakeRunner(64)
    sched.update(runner.execute(first))
    outputs = run_all(sched, runner)
    order = [s.request_id for out in outputs for s in out.scheduled if s.num_computed_tokens == 0]
    assert order == ["r2", "r3", "r4"]  # FCFS admission
    assert all(r.output_token_ids == reference(r.prompt_token_ids, 4) for r in reqs)


def test_prompt_over_budget_without_chunking_is_rejected():
    sched = make_scheduler(budget=8, chunked=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(make_request("long", list(range(9))))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(budget=128).add_request(make_request("huge", [1] * 65))


def test_chunked_prefill_splits_prompt():
    sched = make_scheduler(budget=8)
    prompt = [5 + i % 7 for i in range(25)]
    sched.add_request(make_request("a", prompt))
    runner, chunks = FakeRunner(64), []
    for _ in range(4):
        out = sched.schedule()
        (s,) = out.scheduled
        assert s.num_computed_tokens == sum(len(c) for c in chunks)
        chunks.append(s.token_ids)
        assert s.sample == (len(chunks) == 4)
        sched.update(runner.execute(out))
    assert [len(c) for c in chunks] == [8, 8, 8, 1] and sum(chunks, []) == prompt
    run_all(sched, runner)


def test_mixed_decode_and_prefill_step():
    sched = make_scheduler(budget=8)
    a, b = make_request("a", [3, 4, 5], max_tokens=5), make_request("b", list(range(10, 30)))
    sched.add_request(a)
    runner = FakeRunner(64)
    sched.update(runner.execute(sched.schedule()))
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.scheduled] == [("a", 1, True), ("b", 7, False)]
    assert out.scheduled[0].token_ids == a.output_token_ids[-1:]
    sched.update(runner.execute(out))
    run_all(sched, runner)
    assert a.output_token_ids == reference(a.prompt_token_ids, 5)
    assert b.output_token_ids == reference(b.prompt_token_ids, 4)


def test_long_prompt_chunks_leave_room_for_the_decodes():
    """A long prompt prefilled beside running requests (one before it, one after it in arrival
    order): each step its chunk takes at most long_prefill_token_threshold tokens and leaves one
    token of the budget to each request after it; alone it takes the whole budget. Tokens still
    match the reference."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=6),
                      CacheConfig(block_size=BS, enable_prefix_caching=False), 64, 64, {EOS})
    runner = FakeRunner(64)
    alone = make_request("alone", [7 + i % 5 for i in range(40)], max_tokens=1)
    sched.add_request(alone)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("alone", 16)]
    sched.update(runner.execute(out))
    run_all(sched, runner)
    first, long, last = (make_request("first", [3, 4], max_tokens=12),
                         make_request("long", [7 + i % 5 for i in range(40)], max_tokens=3),
                         make_request("last", [5, 6], max_tokens=12))
    sched.add_request(first)
    sched.update(runner.execute(sched.schedule()))
    sched.add_request(long)
    sched.add_request(last)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("first", 1), ("long", 6), ("last", 2)]
    sched.update(runner.execute(out))
    for _ in range(5):
        out = sched.schedule()
        assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("first", 1), ("long", 6), ("last", 1)]
        sched.update(runner.execute(out))
    run_all(sched, runner)
    for r in (alone, first, long, last):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens)


def test_long_prompt_threshold_defaults_to_a_quarter_of_the_budget():
    assert SchedulerConfig().long_prefill_tokens == 2048
    assert SchedulerConfig(max_num_batched_tokens=2048).long_prefill_tokens == 512
    assert SchedulerConfig(max_num_batched_tokens=64).long_prefill_tokens == 64   # small budgets: no cap
    assert SchedulerConfig(long_prefill_token_threshold=100).long_prefill_tokens == 100


def test_preemption_recomputes_and_completes():
    # 6 blocks of 4: two requests growing to 6 + 12 tokens (5 blocks each) cannot both stay.
    sched = make_scheduler(num_blocks=6, max_model_len=24, caching=False)
    a, b = make_request("a", [7] * 6, max_tokens=12), make_request("b", [8] * 6, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    outputs = run_all(sched)
    preempted = [rid for out in outputs for rid in out.preempted_ids]
    assert preempted and set(preempted) == {"b"}  # always the latest arrival
    assert b.num_preemptions == len(preempted) == sched.stats()["num_preemptions"]
    recompute = next(s for out in outputs for s in out.scheduled
                     if s.request_id == "b" and s.num_computed_tokens == 0 and s.output_token_count > 0)
    assert recompute.token_ids == b.all_token_ids[:len(recompute.token_ids)]  # prompt + outputs so far
    for r in (a, b):
        assert r.output_token_ids == reference(r.prompt_token_ids, 12) and r.finish_reason == "length"
    assert sched.kv.num_free_blocks == 6


@pytest.mark.parametrize("chunked", [True, False])
def test_preempted_request_recomputes_in_chunks(chunked):
    # Chunking disabled or not, a recompute longer than the budget must go in chunks or never run.
    sched = make_scheduler(num_blocks=4, max_model_len=16, budget=8, chunked=chunked, caching=False)
    a, b = make_request("a", [3], max_tokens=15), make_request("b", [4] * 7, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    outputs = run_all(sched)
    assert b.num_preemptions > 0
    # No admissions in a step that had to preempt (they would only thrash the cache).
    assert all(s.num_computed_tokens > 0 for out in outputs if out.preempted_ids for s in out.scheduled)
    recompute = [s for out in outputs for s in out.scheduled if s.request_id == "b"]
    recompute = recompute[max(i for i, s in enumerate(recompute) if s.num_computed_tokens == 0):]
    assert recompute[0].output_token_count > 0  # prompt + outputs so far, more than the budget
    assert sum((s.token_ids for s in recompute), []) == b.all_token_ids[:-1]  # the last token is never fed
    num_chunks = sum(not s.sample for s in recompute)
    assert num_chunks >= 1 and all(s.sample for s in recompute[num_chunks:])
    assert len(recompute) - num_chunks == b.num_output_tokens - recompute[0].output_token_count
    assert a.output_token_ids == reference(a.prompt_token_ids, 15)
    assert b.output_token_ids == reference(b.prompt_token_ids, 9)


def test_preempted_request_goes_to_front_of_queue():
    sched = make_scheduler(num_blocks=4, max_model_len=16, budget=64, caching=False)
    a, b, c = (make_request(x, [1] * 7, max_tokens=9) for x in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(4)
    while not b.num_preemptions:
        sched.update(runner.execute(sched.schedule()))
    assert b.status is RequestStatus.PREEMPTED and list(sched.waiting)[:2] == [b, c]
    run_all(sched, runner)


def test_prefix_cache_hit_starts_at_cached_tokens():
    sched = make_scheduler()
    shared = list(range(20, 29))  # 2 full blocks + 1
    a, b = make_request("a", shared + [1]), make_request("b", shared + [2, 3])
    runner = FakeRunner(64)
    sched.add_request(a)
    out = sched.schedule()
    a_blocks = out.scheduled[0].block_ids
    sched.update(runner.execute(out))
    run_all(sched, runner)
    sched.add_request(b)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_computed_tokens == 8 == b.num_cached_tokens and s.token_ids == b.prompt_token_ids[8:]
    assert s.block_ids[:2] == a_blocks[:2] and sched.stats()["prefix_cache_hit_rate"] > 0
    sched.update(runner.execute(out))
    run_all(sched, runner)
    assert b.output_token_ids == reference(b.prompt_token_ids, 4)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.sampled_from([(), (1, 2, 3, 4, 5), (6,) * 8]),
                                  st.lists(st.integers(10, 40), min_size=1, max_size=10),
                                  st.integers(1, 16)), min_size=1, max_size=6),
       num_blocks=st.integers(8, 12), budget=st.integers(1, 24), max_seqs=st.integers(1, 4),
       caching=st.booleans())
def test_random_workloads_match_reference(prompts, num_blocks, budget, max_seqs, caching):
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, caching=caching,
                           max_model_len=32)
    reqs = [make_request(f"r{i}", list(p) + s, max_tokens=n) for i, (p, s, n) in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_all(sched, max_steps=2000)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix-cache hits: {sched.kv.prefix_cache_hits > 0}")
    event(f"chunked recompute: {any(s.output_token_count and not s.sample for o in outputs for s in o.scheduled)}")
    for r in reqs:  # the max_model_len of 32 may cut a request short
        expected = reference(r.prompt_token_ids, min(r.sampling_params.max_tokens, 32 - r.num_prompt_tokens))
        assert r.output_token_ids == expected
    assert sched.kv.num_free_blocks == num_blocks and sched.kv.usage == 0.0
    assert_attention_counts(sched, outputs)


def assert_attention_counts(sched: Scheduler, outputs: list[SchedulerOutput]) -> None:
    """The bandwidth-bound counters equal what the steps' attention reads: per step, every scheduled
    request's context after it (first position + tokens fed)."""
    steps = [o for o in outputs if o is not None and o.scheduled]
    assert sched.num_scheduled_steps == sched.stats()["num_scheduled_steps"] == len(steps)
    assert sched.num_kv_tokens_attended == sched.stats()["num_kv_tokens_attended"] == sum(
        s.num_computed_tokens + len(s.token_ids) for o in steps for s in o.scheduled)


def test_attention_counts_by_hand():
    """Prompts of 6 and 3 tokens, budget 4: [a0-3], [a4-5, b0-1], [a decode at 6 -> 7, b2 -> 3],
    then decodes: contexts after each step are summed."""
    sched = make_scheduler(budget=4, caching=False)
    sched.add_request(make_request("a", [11, 12, 13, 14, 15, 16], max_tokens=2))
    sched.add_request(make_request("b", [21, 22, 23], max_tokens=2))
    outputs = run_all(sched)
    per_step = [[s.num_computed_tokens + len(s.token_ids) for s in o.scheduled] for o in outputs]
    assert per_step == [[4], [6, 2], [7, 3], [4]]
    assert sched.num_scheduled_steps == 4 and sched.num_kv_tokens_attended == 4 + 8 + 10 + 4


def test_abort_frees_blocks():
    sched = make_scheduler()
    a, b = make_request("a", list(range(10))), make_request("b", [1, 2])
    sched.add_request(a)
    sched.update(FakeRunner(64).execute(sched.schedule()))
    sched.add_request(b)
    assert sched.abort_request("a") is a and a.finish_reason == "abort" and a.is_finished
    assert a.block_ids == [] and sched.kv.num_free_blocks == 64
    assert sched.abort_request("a") is None and sched.abort_request("nope") is None
    assert sched.abort_request("b") is b  # a waiting request
    out = sched.schedule()
    assert out.scheduled == [] and out.finished_ids == ["a", "b"] and not sched.has_unfinished_requests()


def scripted(sched: Scheduler, request: Request, tokens: list[int]) -> int:
    """Feed `tokens` as the samples; returns how many were consumed when it finished."""
    sched.add_request(request)
    for i, token in enumerate(tokens):
        out = sched.schedule()
        sched.update({s.request_id: token for s in out.scheduled if s.sample})
        if request.is_finished:
            assert request.block_ids == [] and sched.kv.num_free_blocks == sched.kv.num_blocks
            return i + 1
    raise AssertionError("did not finish")


@pytest.mark.parametrize("params, tokens, n, reason, stop_reason", [
    (dict(stop_token_ids=[7]), [5, 7, 5], 2, "stop", 7),
    (dict(), [5, EOS, 5], 2, "stop", None),
    (dict(ignore_eos=True, max_tokens=3), [EOS, EOS, EOS, EOS], 3, "length", None),
    (dict(min_tokens=2, max_tokens=6), [EOS, EOS, 5, EOS, 5], 4, "stop", None),
    (dict(min_tokens=1, stop_token_ids=[7]), [7, 7], 2, "stop", 7),
    (dict(max_tokens=3), [5] * 5, 3, "length", None),
    (dict(max_tokens=70), [5] * 70, 64 - 3, "length", None),  # max_model_len = 64
])
def test_stop_conditions(params, tokens, n, reason, stop_reason):
    request = make_request("r", [1, 3, 4], **params)
    assert scripted(make_scheduler(), request, tokens) == n
    assert (request.finish_reason, request.stop_reason, request.num_output_tokens) == (reason, stop_reason, n)


def test_update_returns_requests_with_new_tokens_and_finished_ids():
    sched = make_scheduler()
    a, b = make_request("a", [1, 3], max_tokens=1), make_request("b", [1, 4], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    got = sched.update({s.request_id: 9 for s in out.scheduled})
    assert got == [a, b] and a.finish_reason == "length" and not b.is_finished
    assert a.first_token_time is not None
    assert sched.schedule().finished_ids == ["a"]


def test_misuse_raises_clear_errors():
    with pytest.raises(ValueError, match=r"num_blocks=3.*max_model_len=64"):
        make_scheduler(num_blocks=3)
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 3]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", [1]))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="missing"):
        sched.update({})
    sched.update({s.request_id: 5 for s in out.scheduled})


def test_finish_request_from_engine():
    sched = make_scheduler()
    r = make_request("r", [1, 3], stop=["x"])
    sched.add_request(r)
    assert sched.schedule().scheduled[0].sample
    sched.update({"r": 5})
    assert sched.finish_request("r", "stop", stop_reason="x") is r
    assert (r.finish_reason, r.stop_reason, r.block_ids) == ("stop", "x", [])
    assert sched.stats()["num_running"] == 0 and sched.num_unfinished == 0


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("budget,num_blocks,max_tokens", [(64, 64, 4), (8, 64, 4), (64, 64, 1), (64, 12, 12)],
                         ids=["plain", "chunked-source", "source-done-in-prefill", "preemption"])
def test_completions_of_one_prompt_share_its_blocks(caching, budget, num_blocks, max_tokens):
    """`n` > 1: children wait until the first completion's prompt is computed, then start with its
    full blocks (ref counts, not copies) and compute only the partial block's tokens; if the source
    is gone first they compute the prompt themselves. Either way the tokens are the reference's."""
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, caching=caching, max_model_len=32)
    prompt = [5 + i % 11 for i in range(18)]  # 4 full blocks of 4 + 2 tokens
    source = make_request("0_p", prompt, max_tokens=max_tokens)
    children = [make_request(f"{i}_p", prompt, max_tokens=max_tokens) for i in (1, 2, 3)]
    sched.add_request(source)
    for child in children:
        child.prompt_source = source
        sched.add_request(child)
    outputs = run_all(sched)
    for request in [source, *children]:
        assert request.output_token_ids == reference(prompt, max_tokens)
    first_chunks = {}
    for out in outputs:
        for s in out.scheduled:
            first_chunks.setdefault(s.request_id, s)
    if max_tokens > 1 and num_blocks == 64:
        per_sequence = -(-(len(prompt) + max_tokens - 1) // BS)  # the last token is never written
        assert sched.kv.pool.num_allocated == per_sequence + 3 * (per_sequence - 4)
        for child in children:
            assert first_chunks[child.request_id].num_computed_tokens == 16  # shared: only 2 tokens computed
    if num_blocks == 12:
        assert sched.num_preemptions > 0
    assert sched.kv.usage == 0.0
