"""KV-cache manager: block accounting invariants under random workloads, and prefix-cache rules.

The state machine also simulates the cache's contents (which token each slot holds) so it can
check the property that matters: a prefix-cache hit hands a request blocks that really hold its
tokens, and no step writes into a block another request is reading.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from configs import SamplingParams
from runner.kv_cache_manager import KVCacheManager, cdiv
from runner.request import Request

BS = 4
PARAMS = SamplingParams()


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=PARAMS)


def run_prefill(kv: KVCacheManager, request: Request) -> bool:
    """Schedule a new request whole and pretend the step ran."""
    hits, cached = kv.get_computed_blocks(request)
    if not kv.allocate_slots(request, request.num_tokens - cached, hits):
        return False
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return True


def check_accounting(kv: KVCacheManager, requests: list[Request]) -> None:
    pool = kv.pool
    holders = Counter(b for r in requests for b in r.block_ids)
    for r in requests:
        assert len(set(r.block_ids)) == len(r.block_ids), "a table holds a block twice"
    for block_id, ref_count in enumerate(pool.ref_counts):
        assert ref_count == holders.get(block_id, 0), f"block {block_id} ref count"
        if ref_count > 1:
            assert pool.block_hashes[block_id] is not None, "a block is shared without being a cached block"
    assert sum(pool.ref_counts) == sum(len(r.block_ids) for r in requests)
    in_use = sum(1 for ref_count in pool.ref_counts if ref_count > 0)
    assert kv.num_free_blocks + in_use == pool.num_blocks
    assert set(pool.free_block_ids()) == {b for b, ref_count in enumerate(pool.ref_counts) if ref_count == 0}
    for block_hash, block_id in pool.cached_block_ids().items():
        assert pool.block_hashes[block_id] == block_hash


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
        self.requests: list[Request] = []
        self.pending: dict[str, int] = {}   # tokens allocated for the step in flight
        self.content: dict[int, dict[int, int]] = {}  # block id -> {offset: token written}
        self.count = 0

    def _schedule(self, request: Request, chunk: int) -> bool:
        """Allocate the next chunk; on success the request has a step in flight."""
        hits, cached = self.kv.get_computed_blocks(request) if not request.block_ids else ([], 0)
        tokens = request.all_token_ids
        if hits:
            event("prefix-cache hit")
        for i, block_id in enumerate(hits):  # a hit must hold exactly this request's tokens
            assert self.content.get(block_id) == {o: tokens[i * BS + o] for o in range(BS)}
        assert cached < request.num_tokens, "a hit covered the whole sequence"
        chunk = min(chunk, request.num_tokens - request.num_computed_tokens - cached)
        num_old = len(request.block_ids)
        if not self.kv.allocate_slots(request, chunk, hits):
            return False
        for block_id in request.block_ids[num_old + len(hits):]:
            self.content.pop(block_id, None)  # freshly handed out: the old contents are gone
        request.num_computed_tokens += cached
        assert len(request.block_ids) == cdiv(request.num_computed_tokens + chunk, BS)
        self.pending[request.request_id] = chunk
        return True

    def _pick(self, index: int) -> Request | None:
        return self.requests[index % len(self.requests)] if self.requests else None

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9,) * 6]),
          suffix=st.lists(st.integers(0, 9), max_size=6), chunk=st.integers(1, 12))
    def add(self, prefix, suffix, chunk):
        tokens = list(prefix) + suffix or [0]
        self.count += 1
        request = make_request(f"r{self.count}", tokens)
        if self._schedule(request, chunk):
            self.requests.append(request)
        else:
            assert request.block_ids == []

    @rule(index=st.integers(0, 15), chunk=st.integers(1, 12), token=st.integers(0, 9))
    def step(self, index, chunk, token):
        """Run the in-flight step (write KV, advance, cache), sample if done, allocate the next."""
        request = self._pick(index)
        if request is None:
            return
        start, n = request.num_computed_tokens, self.pending.pop(request.request_id)
        tokens = request.all_token_ids
        for pos in range(start, start + n):
            block_id = request.block_ids[pos // BS]
            assert self.kv.pool.ref_counts[block_id] == 1, "writing into a shared block"
            self.content.setdefault(block_id, {})[pos % BS] = tokens[pos]
        request.num_computed_tokens += n
        self.kv.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(token)
        if not self._schedule(request, chunk):
            self._preempt(request)

    def _preempt(self, request):
        event("preempted")
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.pending.pop(request.request_id, None)
        if not self._schedule(request, request.num_tokens):  # re-admit (prefix hits apply)
            self.requests.remove(request)

    @rule(index=st.integers(0, 15))
    def finish(self, index):
        request = self._pick(index)
        if request is not None:
            self.kv.free(request)
            self.requests.remove(request)
            assert request.block_ids == []

    @rule(index=st.integers(0, 15))
    def preempt(self, index):
        request = self._pick(index)
        if request is not None:
            self._preempt(request)

    @rule()
    def reset_cache(self):
        num_cached = self.kv.pool.num_cached_blocks
        if self.requests:  # refused while blocks are in use
            assert self.kv.reset_prefix_cache() is False and self.kv.pool.num_cached_blocks == num_cached
        else:
            assert self.kv.reset_prefix_cache() is True and self.kv.pool.num_cached_blocks == 0

    @invariant()
    def accounting(self):
        if hasattr(self, "kv"):
            check_accounting(self.kv, self.requests)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


@settings(max_examples=40, deadline=None)
@given(shared=st.lists(st.integers(0, 50), min_size=BS, max_size=3 * BS),
       tails=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=2, max_size=4))
def test_shared_full_block_prefix_hits(shared, tails):
    kv = KVCacheManager(64, BS)
    requests = [make_request(f"r{i}", shared + tail) for i, tail in enumerate(tails)]
    for request in requests:
        assert run_prefill(kv, request)
    check_accounting(kv, requests)
    assert kv.prefix_cache_hits >= (len(requests) - 1) * (len(shared) // BS) * BS
    assert kv.prefix_cache_hit_rate > 0
    # Every request beyond the first shares the first one's prefix blocks.
    num_shared = len(shared) // BS
    assert all(r.block_ids[:num_shared] == requests[0].block_ids[:num_shared] for r in requests)
    for request in requests:
        kv.free(request)
    check_accounting(kv, [])


def test_no_hits_without_prefix_caching():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert run_prefill(kv, a) and run_prefill(kv, b)
    assert set(a.block_ids).isdisjoint(b.block_ids)
    assert kv.prefix_cache_hit_rate == 0.0 and kv.pool.num_cached_blocks == 0


def test_never_the_whole_prompt():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(2 * BS)))
    assert run_prefill(kv, a)
    b = make_request("b", list(range(2 * BS)))  # every full block is cached
    hits, cached = kv.get_computed_blocks(b)
    assert hits == a.block_ids[:1] and cached == BS  # the last hit block is dropped
    c = make_request("c", list(range(2 * BS)) + [99])
    assert kv.get_computed_blocks(c) == (a.block_ids, 2 * BS)


def test_freed_cached_blocks_are_reused_last_and_evicted_lru():
    kv = KVCacheManager(6, BS)
    a = make_request("a", list(range(2 * BS)) + [7])  # 2 full blocks + 1 partial
    assert run_prefill(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    assert kv.num_free_blocks == 6 and kv.usage == 0.0
    # Never-used blocks go first, then a's blocks tail first (its prefix survives longest).
    free_order = kv.pool.free_block_ids()
    assert free_order[:3] == [3, 4, 5] and free_order[3:] == a_blocks[::-1]
    b = make_request("b", [50] * (3 * BS))
    hits, _ = kv.get_computed_blocks(b)
    assert hits == [] and kv.allocate_slots(b, b.num_tokens)
    assert b.block_ids == [3, 4, 5] and kv.pool.num_cached_blocks == 2  # a's hashes survive
    # The next allocation takes a's unhashed partial block, then evicts the chain's tail.
    d = make_request("d", [60] * (BS + 1))
    assert kv.allocate_slots(d, d.num_tokens) and d.block_ids == a_blocks[:0:-1]
    assert kv.pool.block_hashes[a_blocks[1]] is None and kv.pool.num_cached_blocks == 1
    again = make_request("a2", list(range(2 * BS)) + [8])
    hits, cached = kv.get_computed_blocks(again)
    assert hits == a_blocks[:1] and cached == BS  # the head survived
    assert kv.allocate_slots(again, again.num_tokens - cached, hits) is False  # 0 free besides the hit
    assert kv.pool.ref_counts[a_blocks[0]] == 0
    check_accounting(kv, [b, d])
    kv.free(d)
    assert kv.allocate_slots(again, again.num_tokens - cached, hits)
    assert again.block_ids[0] == a_blocks[0] and kv.pool.ref_counts[a_blocks[0]] == 1
    check_accounting(kv, [b, again])


def test_allocate_is_all_or_nothing_and_counts_free_hits():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(BS)) + [1])
    assert run_prefill(kv, a)
    kv.free(a)  # block 0 cached and free, 3 free blocks
    b = make_request("b", list(range(BS)) + [2] * (2 * BS))  # 3 blocks: 1 hit + 2 new
    hits, cached = kv.get_computed_blocks(b)
    assert cached == BS
    assert kv.allocate_slots(b, b.num_tokens - cached, hits)
    c = make_request("c", list(range(BS)) + [3] * (2 * BS))
    hits, cached = kv.get_computed_blocks(c)
    before = list(kv.pool.ref_counts)
    assert not kv.allocate_slots(c, c.num_tokens - cached, hits)
    assert kv.pool.ref_counts == before and c.block_ids == []


def test_reset_prefix_cache_forgets_hashes():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(2 * BS)) + [1])
    assert run_prefill(kv, a)
    assert kv.reset_prefix_cache() is False  # a still holds blocks
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(2 * BS)) + [1])) == ([], 0)


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1])
def test_allocate_grows_table_to_fit(n):
    kv = KVCacheManager(8, BS)
    r = make_request("r", list(range(n)))
    assert kv.allocate_slots(r, n) and len(r.block_ids) == cdiv(n, BS)
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, 1) and len(r.block_ids) == cdiv(n + 1, BS)
