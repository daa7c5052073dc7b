"""Continuous batching: which requests run this step, how many tokens each, and when they stop.

Every step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running requests go first in arrival order (a decode adds one token; a chunked prefill adds
as much of the rest as the budget allows), then waiting requests in FCFS order. When the KV
cache is full, the latest-arrived running request is preempted by recompute: its blocks are
freed and it goes back to the front of the queue to recompute prompt + outputs later.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass

from configs import CacheConfig, SamplingParams, SchedulerConfig
from runner.kv_cache_manager import KVCacheManager, cdiv
from runner.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:           # one request's share of a step
    request_id: str
    token_ids: list[int]          # tokens fed this step (prompt chunk, or the last sampled token)
    num_computed_tokens: int      # tokens already in the KV cache before this step (= first position)
    block_ids: list[int]          # the request's whole block table: its live list, not a copy (read it this step)
    sample: bool                  # True when this step yields the request's next token
    sampling_params: SamplingParams
    output_token_count: int       # tokens generated so far (for per-request seeded generators)
    block_table_id: int = -1      # Request.block_table_id: same id, same table (grown at most); -1 = unknown


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int     # >= len(scheduled): every scheduled request feeds at least one token
    preempted_ids: list[str]
    finished_ids: list[str]       # freed this step (abort / finished last step)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, eos_token_ids: set[int]) -> None:
        needed = cdiv(max_model_len, cache_config.block_size)
        if needed > num_blocks:
            raise ValueError(
                f"the KV cache has num_blocks={num_blocks} blocks of {cache_config.block_size} tokens "
                f"({num_blocks * cache_config.block_size} tokens), but max_model_len={max_model_len} "
                f"needs {needed} blocks for one request; lower max_model_len or give the cache more memory")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Kept in arrival order: scheduled first, preempted last."""
        self.num_preemptions = 0
        self._arrival = itertools.count()
        self._priority: dict[str, int] = {}
        self._step: list[tuple[Request, int, bool]] = []
        """(request, tokens scheduled, samples) of the last schedule(), consumed by update()."""
        self._step_sampling: set[str] = set()
        """Ids of the requests the last schedule() expects a token from."""
        self._finished_ids: list[str] = []
        """Freed since the last schedule(); reported once so the runner drops their state."""

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid, num_prompt = request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if num_prompt > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens is longer than "
                             f"max_model_len={self.max_model_len}")
        if not self.config.enable_chunked_prefill and num_prompt > self.config.max_num_batched_tokens:
            raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens exceeds max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} and chunked prefill is disabled")
        params = request.sampling_params
        request.stop_token_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)
        request.max_output_tokens = min(params.max_tokens, self.max_model_len - num_prompt)
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self._priority[rid] = next(self._arrival)
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish with "abort" and free its blocks now; unknown or finished ids are a no-op."""
        return self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, reason: FinishReason,
                       stop_reason: str | int | None = None) -> Request | None:
        """Finish a request from outside (the engine's stop-string check, aborts)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason, stop_reason)
        return request

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._priority[request.request_id]
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._step:
            raise RuntimeError("schedule() called again before update() consumed the previous step")
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        running, kv, index = self.running, self.kv, 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_tokens = request.num_tokens
            num_new = num_tokens - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            while not kv.allocate_slots(request, num_new):
                if len(running) == 1:  # unreachable given the constructor's check
                    raise RuntimeError(f"request {request.request_id!r} does not fit in an empty KV cache")
                victim = running.pop()  # the latest arrival
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._entry(request, num_new, num_tokens))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: nothing after it is left in `running`

        # Admitting new work right after preempting would only thrash the cache.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_ids, num_cached = self.kv.get_computed_blocks(request)
            num_tokens = request.num_tokens
            num_new = num_tokens - num_cached
            if num_new > budget:
                # Chunking disabled: wait for a budget the whole prompt fits, except a preempted
                # request grown past the budget, which recomputes in chunks or it would never run.
                if not self.config.enable_chunked_prefill and num_new <= self.config.max_num_batched_tokens:
                    break
                num_new = budget
            if not self.kv.allocate_slots(request, num_new, hit_ids):
                break
            self.waiting.popleft()
            request.num_computed_tokens = request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: self._priority[r.request_id])
            scheduled.append(self._entry(request, num_new, num_tokens))
            budget -= num_new

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
                               preempted_ids=preempted, finished_ids=finished)

    def _entry(self, request: Request, num_new: int, num_tokens: int) -> ScheduledRequest:
        """The request's share of the step, remembered for update()."""
        start = request.num_computed_tokens
        sample = start + num_new == num_tokens
        self._step.append((request, num_new, sample))
        if sample:
            self._step_sampling.add(request.request_id)
        return ScheduledRequest(request.request_id, request.token_ids_slice(start, start + num_new), start,
                                request.block_ids, sample, request.sampling_params,
                                len(request.output_token_ids), request.block_table_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def cancel_step(self) -> None:
        """The last scheduled step failed before producing results: forget it. Nothing advanced
        (num_computed_tokens moves only in update), blocks stay with their requests, so the
        next schedule() hands out the same work again."""
        self._step, self._step_sampling = [], set()

    def update(self, sampled) -> list[Request]:
        """Apply a step's results: `sampled` is {request id: token} or a ModelRunnerOutput.

        Every request scheduled last step advances by its scheduled tokens (non-final prefill
        chunks too); those that sampled get the token and a stop check, and finished ones free
        their blocks now. Requests finished or aborted from outside since schedule() are skipped.
        Returns the requests that got a token, finished or not.
        """
        sampled = getattr(sampled, "sampled", sampled)
        if sampled.keys() != self._step_sampling:
            self._check_sampled(sampled)
        step, self._step, self._step_sampling = self._step, [], set()
        block_size, caching = self.kv.block_size, self.kv.enable_prefix_caching
        updated: list[Request] = []
        for request, num_new, sample in step:
            if request.status is not RequestStatus.RUNNING:
                continue
            start = request.num_computed_tokens
            request.num_computed_tokens = start + num_new
            if caching and (start + num_new) // block_size != start // block_size:
                self.kv.cache_full_blocks(request)  # a block filled up: blocks fill only at a boundary
            if not sample:
                continue
            token = sampled[request.request_id]
            outputs = request.output_token_ids
            outputs.append(token)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if token in request.stop_token_ids or len(outputs) >= request.max_output_tokens:
                stop = self._stop(request, token)
                if stop is not None:
                    self.running.remove(request)
                    self._finish(request, *stop)
            updated.append(request)
        return updated

    def _check_sampled(self, sampled: dict[str, int]) -> None:
        """The runner's tokens must be exactly those the live requests of the step expect; tokens
        of requests finished or aborted since schedule() may be there or not."""
        live = {request.request_id for request, _, _ in self._step if request.status is RequestStatus.RUNNING}
        expected = self._step_sampling & live
        gone = {request.request_id for request, _, _ in self._step} - live
        missing, unexpected = expected - sampled.keys(), sampled.keys() - expected - gone
        if missing or unexpected:
            raise RuntimeError(f"sampled tokens do not match the schedule: missing "
                               f"{sorted(missing)}, not expected {sorted(unexpected)}")

    def _stop(self, request: Request, token: int) -> tuple[FinishReason, int | None] | None:
        """Why the request ends with this token, if it does.

        A stop token or EOS counts only after `min_tokens` other tokens (the sampler masks
        them before that, as vLLM does; this check keeps the rule if it did not).
        `update` asks only when the token is in `request.stop_token_ids` or the length limit
        is reached, which is when this can return a reason.
        """
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output > params.min_tokens and token in request.stop_token_ids:
            return "stop", (token if token in params.stop_token_ids else None)
        if num_output >= request.max_output_tokens:
            return "length", None
        return None

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while any request holds blocks."""
        return self.kv.reset_prefix_cache()

    def stats(self) -> dict[str, float | int]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": self.kv.usage, "prefix_cache_hit_rate": self.kv.prefix_cache_hit_rate,
                "prefix_cache_queries": self.kv.prefix_cache_queries,
                "prefix_cache_hits": self.kv.prefix_cache_hits, "num_preemptions": self.num_preemptions}
