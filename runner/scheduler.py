"""Continuous batching: which requests run this step, how many tokens each, and when they stop.

Why one file of ~410 lines: the synchronous and the async accounting (placeholders, in-flight
tokens, drains), preemption and the sharing of a prompt's blocks by `n` completions all change
the same running/waiting lists and KV-cache calls in `schedule` and `update`; split apart, the
invariants between them could no longer be read in one place.

Every step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running requests go first in arrival order (a decode adds one token; a chunked prefill adds
as much of the rest as the budget allows: beside other requests at most
`long_prefill_token_threshold`, leaving one token to each running request after it, so a long
prompt never starves the decodes), then waiting requests in FCFS order. When the KV
cache is full, the latest-arrived running request is preempted by recompute: its blocks are
freed and it goes back to the front of the queue to recompute prompt + outputs later.

Async scheduling: `schedule()` may plan step n+1 while step n is in flight (scheduled, not yet
`update`d; at most one). A request then counts `num_computed_tokens + num_inflight_tokens` as
computed and, when step n samples it, one placeholder token past its known ones: a decode that
feeds it is scheduled with `token_ids=[PLACEHOLDER_TOKEN_ID]`, and `SchedulerOutput` names its
token row and its row in step n's sampled tokens, which the runner gathers on the device. A request whose placeholder
certainly ends it (the length limit) is not scheduled; one that turns out to have stopped at
step n (stop token, stop string, abort) is finished by then and `update` skips its step n+1
work. A step that would need to preempt returns None instead: the caller applies step n first
and schedules again (a drain), so no request loses blocks that a step in flight writes.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

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
    output_token_count: int       # tokens generated so far, placeholders included
    block_table_id: int = -1      # Request.block_table_id: same id, same table (grown at most); -1 = unknown
    stop_token_ids: frozenset[int] = frozenset()  # Request.stop_token_ids: masked by the sampler before min_tokens
    prompt_token_ids: list[int] | None = None     # the prompt (a reference), where the sampler needs it:
    #                                               repetition_penalty and prompt_logprobs; None otherwise
    bad_words_token_ids: list[list[int]] | None = None  # Request.bad_words_token_ids (a reference)
    logits_processors: bool = False                     # Request.logits_processors
    # Async scheduling: token_ids == [PLACEHOLDER_TOKEN_ID] marks a decode of the token in flight; the
    # SchedulerOutput's prev_* rows say where it comes from (no field here: the synchronous hot path
    # builds one of these per request per step).


PLACEHOLDER_TOKEN_ID = -1
"""Stands for a token the step in flight has not returned yet; never reaches the model (the
runner overwrites it on the device) and is out of every vocabulary, so a slip fails loudly."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int     # >= len(scheduled): every scheduled request feeds at least one token
    preempted_ids: list[str]
    finished_ids: list[str]       # freed this step (abort / finished last step)
    prev_token_rows: list[int] = field(default_factory=list)
    """Token rows of this step whose input is a placeholder (async), in schedule order..."""
    prev_sample_rows: list[int] = field(default_factory=list)
    """...and the rows of the previous step's sampled tokens that fill them (`Request.placeholder_row`)."""


@dataclass(slots=True)
class _Step:
    """A scheduled step until `update` applies it (or `cancel_step` forgets it)."""
    entries: list[tuple[Request, int, bool, int]]
    """(request, tokens scheduled, samples, its placeholder_row before this step) in schedule order."""
    sampling: set[str]
    """Ids of the requests the step yields a token for."""


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, eos_token_ids: set[int], async_scheduling: bool | None = None) -> None:
        needed = cdiv(max_model_len, cache_config.block_size)
        if needed > num_blocks:
            raise ValueError(
                f"the KV cache has num_blocks={num_blocks} blocks of {cache_config.block_size} tokens "
                f"({num_blocks * cache_config.block_size} tokens), but max_model_len={max_model_len} "
                f"needs {needed} blocks for one request; lower max_model_len or give the cache more memory")
        self.config = scheduler_config
        self.async_scheduling = bool(scheduler_config.async_scheduling if async_scheduling is None
                                     else async_scheduling)
        """May schedule a step while the previous one is in flight (the engine resolves auto)."""
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Kept in arrival order: scheduled first, preempted last."""
        self.num_preemptions = 0
        self.num_drains = 0
        """schedule() calls that returned None: a preemption waited for the step in flight."""
        self.num_scheduled_steps = 0
        self.num_kv_tokens_attended = 0
        """Summed over scheduled steps: the KV entries its attention reads (every scheduled
        request's context after the step, its new tokens included). With num_scheduled_steps it
        gives a workload's memory-bandwidth bound (`graphrunner bench throughput`); two integer
        additions per request, no device work."""
        self._arrival = itertools.count()
        self._priority: dict[str, int] = {}
        self._steps: deque[_Step] = deque()
        """Scheduled steps not yet applied, oldest first: one, or two while one is in flight."""
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

    @property
    def num_steps_pending(self) -> int:
        """Scheduled steps whose results `update` has not applied yet."""
        return len(self._steps)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """Plan the next step. With async scheduling one step may be in flight (scheduled, not yet
        updated); then this returns None when the step would have to preempt: apply the step in
        flight first (`update`) and call again."""
        steps = self._steps
        if steps and (len(steps) > 1 or not self.async_scheduling):
            raise RuntimeError("schedule() called again before update() consumed the previous step"
                               + (" (async scheduling allows one step in flight)" if self.async_scheduling else ""))
        in_flight = bool(steps)
        budget = self.config.max_num_batched_tokens
        long_prefill = self.config.long_prefill_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        step = _Step([], set())
        prev_token_rows: list[int] = []
        prev_sample_rows: list[int] = []

        running, kv, index, async_scheduling = self.running, self.kv, 0, self.async_scheduling
        make_entry = self._entry_async if async_scheduling else self._entry
        placeholders = num_inflight = attended = 0
        while index < len(running) and budget > 0:
            request = running[index]
            if async_scheduling:
                placeholders = request.num_output_placeholders
                if placeholders and request.num_output_tokens + placeholders >= request.max_output_tokens:
                    index += 1  # the token in flight reaches the length limit: nothing left to compute
                    continue
                num_inflight = request.num_inflight_tokens
                num_tokens = request.num_tokens + placeholders
                num_new = num_tokens - request.num_computed_tokens - num_inflight
            else:
                num_tokens = request.num_tokens
                num_new = num_tokens - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new > 1 and len(running) > 1:   # a prompt's chunk beside other requests
                num_new = min(num_new, long_prefill, budget - (len(running) - index - 1))
                if num_new < 1:   # the budget left is the later requests' one token each
                    index += 1
                    continue
            while not kv.allocate_slots(request, num_inflight + num_new):  # in flight: not yet computed, must fit
                if in_flight:  # preempting would free blocks the step in flight writes: drain first
                    self._undo(step)
                    self.num_drains += 1
                    return None
                if len(running) == 1:  # unreachable given the constructor's check
                    raise RuntimeError(f"request {request.request_id!r} does not fit in an empty KV cache")
                victim = running.pop()  # the latest arrival
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                if placeholders:  # a decode of the token in flight: the runner fills it in on the device
                    prev_token_rows.append(self.config.max_num_batched_tokens - budget)
                    prev_sample_rows.append(request.placeholder_row)
                scheduled.append(make_entry(step, request, num_new, num_tokens, placeholders))
                attended += request.num_computed_tokens + num_inflight + num_new
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: nothing after it is left in `running`

        # Admitting new work right after preempting would only thrash the cache.
        compiling: list[Request] = []  # structured output: requests whose grammar is still compiling
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.grammar is not None and not request.grammar.ready:  # STRUCTURED OUTPUT: wait, keep order
                compiling.append(self.waiting.popleft())
                continue
            source = request.prompt_source
            if source is not None:  # another completion of the same prompt (n > 1) computes it once
                if source.status is RequestStatus.FINISHED:
                    request.prompt_source = None  # gone before sharing: compute the prompt here
                elif source.status is not RequestStatus.RUNNING or source.num_computed_tokens < source.num_prompt_tokens:
                    break  # wait (in order) until the source's prompt is in the cache, then share its blocks
            hit_ids, num_cached = self.kv.get_computed_blocks(request)
            num_tokens = request.num_tokens
            num_new = num_tokens - num_cached
            if self.running and num_new > long_prefill and self.config.enable_chunked_prefill:
                num_new = long_prefill
            if num_new > budget:
                # Chunking disabled: wait for a budget the whole prompt fits, except a preempted
                # request grown past the budget, which recomputes in chunks or it would never run.
                if not self.config.enable_chunked_prefill and num_new <= self.config.max_num_batched_tokens:
                    break
                num_new = budget
            if not self.kv.allocate_slots(request, num_new, hit_ids):
                break
            self.waiting.popleft()
            request.prompt_source = None  # shared once; a preempted request recomputes on its own
            request.num_computed_tokens = request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: self._priority[r.request_id])
            scheduled.append(make_entry(step, request, num_new, num_tokens, 0))
            attended += num_cached + num_new
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

        if scheduled:
            steps.append(step)
            self.num_scheduled_steps += 1
            self.num_kv_tokens_attended += attended
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, preempted, finished,
                               prev_token_rows, prev_sample_rows)

    @staticmethod
    def _entry(step: _Step, request: Request, num_new: int, num_tokens: int, placeholders: int) -> ScheduledRequest:
        """The request's share of the step, remembered for update() (synchronous: nothing in
        flight, no placeholders, and no in-flight accounting; the per-request hot path stays short)."""
        start = request.num_computed_tokens
        sample = start + num_new == num_tokens
        step.entries.append((request, num_new, sample, -1))
        if sample:
            step.sampling.add(request.request_id)
        params = request.sampling_params
        return ScheduledRequest(request.request_id, request.token_ids_slice(start, start + num_new), start,
                                request.block_ids, sample, params,
                                len(request.output_token_ids), request.block_table_id, request.stop_token_ids,
                                request.prompt_token_ids if request.sampler_needs_prompt else None,
                                request.bad_words_token_ids, request.logits_processors)

    @staticmethod
    def _entry_async(step: _Step, request: Request, num_new: int, num_tokens: int,
                     placeholders: int) -> ScheduledRequest:
        """`_entry` with the in-flight accounting. `num_tokens` counts the request's placeholder,
        if any (then the step feeds just that one token)."""
        start = request.num_computed_tokens + request.num_inflight_tokens
        sample = start + num_new == num_tokens
        row = request.placeholder_row
        step.entries.append((request, num_new, sample, row))
        request.num_inflight_tokens += num_new
        token_ids = [PLACEHOLDER_TOKEN_ID] if placeholders else request.token_ids_slice(start, start + num_new)
        if sample:
            request.num_output_placeholders += 1
            request.placeholder_row = len(step.sampling)  # the order of the step's sampled tokens
            step.sampling.add(request.request_id)
        return ScheduledRequest(request.request_id, token_ids, start, request.block_ids, sample,
                                request.sampling_params, len(request.output_token_ids) + placeholders,
                                request.block_table_id, request.stop_token_ids,
                                request.prompt_token_ids if request.sampler_needs_prompt else None,
                                request.bad_words_token_ids, request.logits_processors)

    def _undo(self, step: _Step) -> None:
        """Forget a step's in-flight accounting (its blocks stay: the same work comes again)."""
        if not self.async_scheduling:
            return  # the synchronous entries keep none
        for request, num_new, sample, previous_row in reversed(step.entries):
            request.num_inflight_tokens -= num_new
            if sample:
                request.num_output_placeholders -= 1
                request.placeholder_row = previous_row

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def cancel_step(self) -> list[Request]:
        """The last scheduled step failed before producing results: forget it. Nothing advanced
        (num_computed_tokens moves only in update), blocks stay with their requests, so the
        next schedule() hands out the same work again. With a step in flight this forgets the
        newer one; call it again to forget the step in flight too (its results are lost).
        Returns the requests the forgotten step held (the engine fails them)."""
        if not self._steps:
            return []
        step = self._steps.pop()
        self._undo(step)
        return [request for request, *_ in step.entries]

    def update(self, sampled) -> list[Request]:
        """Apply a step's results: `sampled` is {request id: token} or a ModelRunnerOutput.

        Every request scheduled last step advances by its scheduled tokens (non-final prefill
        chunks too); those that sampled get the token and a stop check, and finished ones free
        their blocks now. Requests finished or aborted from outside since schedule() are skipped.
        Returns the requests that got a token, finished or not.
        """
        sampled = getattr(sampled, "sampled", sampled)
        step = self._steps[0] if self._steps else _Step([], set())
        if sampled.keys() != step.sampling:
            self._check_sampled(step, sampled)
        if self._steps:
            self._steps.popleft()
        block_size, caching = self.kv.block_size, self.kv.enable_prefix_caching
        in_flight_accounting = self.async_scheduling
        updated: list[Request] = []
        for request, num_new, sample, _ in step.entries:
            if request.status is not RequestStatus.RUNNING:
                continue  # finished since (a stop, an abort): a later step's work for it is dropped too
            start = request.num_computed_tokens
            request.num_computed_tokens = start + num_new
            if in_flight_accounting:
                request.num_inflight_tokens -= num_new
                if sample:
                    request.num_output_placeholders -= 1
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

    @staticmethod
    def _check_sampled(step: _Step, sampled: dict[str, int]) -> None:
        """The runner's tokens must be exactly those the live requests of the step expect; tokens
        of requests finished or aborted since schedule() may be there or not."""
        live = {request.request_id for request, *_ in step.entries if request.status is RequestStatus.RUNNING}
        expected = step.sampling & live
        gone = {request.request_id for request, *_ in step.entries} - live
        missing, unexpected = expected - sampled.keys(), sampled.keys() - expected - gone
        if missing or unexpected:
            raise RuntimeError(f"sampled tokens do not match the schedule: missing "
                               f"{sorted(missing)}, not expected {sorted(unexpected)}")

    def _stop(self, request: Request, token: int) -> tuple[FinishReason, int | None] | None:
        """Why the request ends with this token, if it does.

        A stop token or EOS counts only after `min_tokens` other tokens. The sampler masks them
        (their logits are -inf for the first `min_tokens` tokens, on every path: graphs, async
        scheduling), so they do not come; this check keeps a token the sampler had no say in (a
        test's or a benchmark's injected tokens) from ending the request early.
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
                "prefix_cache_hits": self.kv.prefix_cache_hits, "num_preemptions": self.num_preemptions,
                "num_drains": self.num_drains, "num_allocated_blocks": self.kv.pool.num_allocated,
                "num_scheduled_steps": self.num_scheduled_steps,
                "num_kv_tokens_attended": self.num_kv_tokens_attended}
