"""AsyncLLM: the engine behind an asyncio front end (the OpenAI server).

`async for out in engine.generate(prompt, params, request_id)` yields RequestOutputs as the
engine makes them. The engine's step loop runs in its own thread, so an HTTP request, a
tokenization or a slow client never delays a step, and a step never blocks the event loop:

    event loop  --(commands: add / abort, a SimpleQueue)-->  engine thread: add, abort, step()
    event loop  <--(one call_soon_threadsafe per step: every output of the step)--  engine thread

A thread, not a process: the step's host work (scheduling, input preparation, detokenization)
and the forward are torch/C code that releases the GIL for most of their time, and outputs
cross to the event loop as Python objects with no pickling. vLLM runs its engine core in a
separate process, which pays a serialisation per step; `graphrunner bench serve --offline`
measures what this design costs against the offline engine (the ratio it prints).

The engine is always asked for DELTA outputs (only what is new), so a step hands the event
loop O(new tokens) per request; the caller's `output_kind` is rebuilt here (CUMULATIVE joins
the deltas, FINAL_ONLY yields once). A request whose caller stops iterating (a client that
disconnected) is aborted at once, which frees its KV blocks in the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from configs import EngineConfig, RequestOutputKind, SamplingParams
from runner.engine import InvalidRequestError, LLMEngine
from runner.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


class EngineLoopError(RuntimeError):
    """The engine failed while serving a request: the request ends with this error."""


@dataclass
class _Stream:
    """One request's output queue on the event loop side."""
    queue: asyncio.Queue
    kind: RequestOutputKind
    arrival: float
    num_prompt_tokens: int = 0
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    """CUMULATIVE/FINAL_ONLY callers: the deltas joined so far, by completion index."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False


class AsyncLLM:
    """An LLMEngine stepped by a background thread; asyncio callers add, stream and abort requests.

    `stats_listener(kind, request_id, stamp, **fields)` (optional) is called on the event loop
    for each request event ("first_token", "tokens", "finished"), which is how the server's
    metrics see time to first token, inter-token latency and end-to-end latency."""

    def __init__(self, engine: LLMEngine, stats_listener=None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stats_listener = stats_listener
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_submitted = 0
        """Adds queued by the event loop (written there only)..."""
        self._num_taken = 0
        """...and taken by the engine thread (written there only): their difference is the backlog."""
        self.dead_error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> "AsyncLLM":
        return cls(LLMEngine(config), **kwargs)

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread, delivering outputs to `loop` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="graphrunner-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread (after its current step) and release the engine."""
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_pending_adds(self) -> int:
        """Requests handed to the engine thread that it has not added yet (they count as waiting)."""
        return max(0, self._num_submitted - self._num_taken)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine thread, or in the scheduler's waiting queue."""
        return self.num_pending_adds + len(self.engine.scheduler.waiting)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its outputs in the caller's `output_kind`. A request the engine
        refuses raises InvalidRequestError from the first iteration; leaving the loop early (or
        the task being cancelled) aborts the request and frees its KV blocks."""
        if self.dead_error is not None:
            raise EngineLoopError(f"the engine has stopped: {self.dead_error}")
        if self._thread is None:
            self.start()
        params = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        engine_params = params if params.output_kind is RequestOutputKind.DELTA else \
            params.model_copy(update={"output_kind": RequestOutputKind.DELTA})
        stream = _Stream(asyncio.Queue(), params.output_kind, time.monotonic())
        self._streams[request_id] = stream
        self._num_submitted += 1
        self._commands.put(("add", (request_id, prompt, engine_params)))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                out = self._in_callers_kind(stream, item)
                if out is not None:
                    yield out
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self._commands.put(("abort", request_id))
                if self.stats_listener is not None:
                    now = time.monotonic()
                    self.stats_listener("finished", request_id, now, e2e=now - stream.arrival, finish_reason="abort")

    def abort(self, request_id: str) -> None:
        """Abort a request: the engine thread frees its blocks before its next step, and its
        generate() ends with a last output whose finish_reason is "abort"."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._commands.put(("abort", request_id))

    def _in_callers_kind(self, stream: _Stream, out: RequestOutput) -> RequestOutput | None:
        if stream.kind is RequestOutputKind.DELTA:
            return out
        for delta in out.outputs:
            joined = stream.completions.get(delta.index)
            if joined is None:
                joined = stream.completions[delta.index] = CompletionOutput(
                    delta.index, "", [], None, [] if delta.logprobs is not None else None)
            joined.text += delta.text
            joined.token_ids = joined.token_ids + delta.token_ids
            if delta.logprobs is not None:
                joined.logprobs = (joined.logprobs or []) + list(delta.logprobs)
            joined.cumulative_logprob = delta.cumulative_logprob
            joined.finish_reason, joined.stop_reason = delta.finish_reason, delta.stop_reason
        if stream.kind is RequestOutputKind.FINAL_ONLY and not out.finished:
            return None
        completions = [_copy(c) for _, c in sorted(stream.completions.items())]
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs, completions,
                             out.finished, out.metrics, out.error)

    # ---- the event loop side of a step ---------------------------------------------------------
    def _deliver(self, items: list[tuple[str, object]], stamp: float) -> None:
        """On the event loop: hand each request its output (or error) from one engine step."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None or stream.finished:
                continue
            if isinstance(item, BaseException):
                stream.finished = True
                stream.queue.put_nowait(item)
                continue
            self._observe(request_id, stream, item, stamp)
            if item.finished:
                stream.finished = True
            stream.queue.put_nowait(item)

    def _observe(self, request_id: str, stream: _Stream, out: RequestOutput, stamp: float) -> None:
        num_new = sum(len(c.token_ids) for c in out.outputs)
        listener = self.stats_listener
        if num_new:
            if stream.first_token_time is None:
                stream.first_token_time = stamp
                stream.num_prompt_tokens = len(out.prompt_token_ids)
                if listener is not None:
                    listener("first_token", request_id, stamp, ttft=stamp - stream.arrival,
                             num_prompt_tokens=stream.num_prompt_tokens, num_tokens=num_new)
            elif listener is not None:
                listener("tokens", request_id, stamp, itl=(stamp - stream.last_token_time) / num_new,
                         num_tokens=num_new)
            stream.last_token_time = stamp
        if out.finished and listener is not None:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason is not None]
            listener("finished", request_id, stamp, e2e=stamp - stream.arrival,
                     finish_reason=reasons[-1] if reasons else "abort")

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_steps()
        except BaseException as error:  # noqa: BLE001 - the loop itself broke: every caller must hear of it
            logger.exception("the engine loop stopped")
            self.dead_error = error
            failure = EngineLoopError(f"the engine loop stopped: {type(error).__name__}: {error}")
            self._loop.call_soon_threadsafe(self._deliver, [(rid, failure) for rid in list(self._streams)],
                                            time.monotonic())

    def _loop_steps(self) -> None:
        engine = self.engine
        deliveries: list[tuple[str, object]] = []
        while not self._stopping:
            block = not engine.has_unfinished_requests()
            try:
                while True:
                    command, payload = self._commands.get(block=block)
                    block = False
                    if command == "stop":
                        return
                    self._command(command, payload, deliveries)
            except queue.Empty:
                pass
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - reported to every request it hit, logged
                    self._step_failed(error, deliveries)
                    outputs = []
                for out in outputs:
                    deliveries.append((out.request_id, out))
            if deliveries:
                self._loop.call_soon_threadsafe(self._deliver, deliveries, time.monotonic())
                deliveries = []

    def _command(self, command: str, payload, deliveries: list) -> None:
        engine = self.engine
        if command == "add":
            request_id, prompt, params = payload
            try:
                engine.add_request(prompt, params, request_id)
            except (InvalidRequestError, ValueError) as error:
                deliveries.append((request_id, InvalidRequestError(str(error))))
            except Exception as error:  # noqa: BLE001 - this request fails; the engine goes on
                logger.exception("adding request %s failed", request_id)
                deliveries.append((request_id, EngineLoopError(f"{type(error).__name__}: {error}")))
            finally:
                self._num_taken += 1
        elif command == "abort":
            try:
                out = engine.abort_request(payload)
            except Exception:  # noqa: BLE001 - logged; the request is gone from the caller's side already
                logger.exception("aborting request %s failed", payload)
                return
            if out is not None:
                out.finished = True
                deliveries.append((payload, out))

    def _step_failed(self, error: Exception, deliveries: list) -> None:
        """A step raised. The engine's own failure handling decides what survives; here every
        request it was serving ends with the error, so no caller waits for ever, and the loop goes
        on serving new requests unless the engine reports itself dead."""
        logger.exception("engine step failed")
        message = EngineLoopError(f"engine step failed: {type(error).__name__}: {error}")
        for request_id in list(self.engine._tracked):
            self.engine.abort_request(request_id)
            deliveries.append((request_id, message))
        if type(error).__name__ == "EngineDeadError":
            self.dead_error = error
            self._stopping = True


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)
