"""AsyncLLM: the engine behind an asyncio front end (the OpenAI server).

`async for out in engine.generate(prompt, params, request_id)` yields RequestOutputs as the
engine makes them. The engine core loop (runner/engine_core.py) busy-loops its steps off the
event loop, in one of two places:

- a thread of this process (`AsyncLLM(engine)`, the default of `graphrunner serve`): outputs
  cross as Python objects with no copying, but the step's host work shares the GIL with the
  event loop's HTTP/SSE work;
- its own process (`AsyncLLM.from_config(config, engine_process=True)`, `--engine-process`,
  runner/engine_process.py): the step loop has an interpreter to itself and outputs cross a
  pipe as compact tuples, once per step.

Either way the core hands the event loop all of one step's outputs in one batch, and never
waits for it. Each request has a collector that holds at most one undelivered output: a step's
DELTA output for a request whose caller has not taken the previous one yet is merged into it
(vLLM's RequestOutputCollector). A caller slower than the engine (256 SSE streams) then gets
fewer, larger deltas instead of falling behind, and the event loop's work per step stays
bounded by what it can do.

The engine is always asked for DELTA outputs (only what is new); the caller's `output_kind` is
rebuilt here (CUMULATIVE joins the deltas, FINAL_ONLY yields once). A request whose caller stops
iterating (a client that disconnected) is aborted at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from typing import AsyncIterator

from configs import EngineConfig, RequestOutputKind, SamplingParams
from runner.engine import InvalidRequestError, LLMEngine
from runner.engine_core import AsyncEngineDeadError, Deliveries, EngineCoreLoop, EngineLoopError
from runner.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "AsyncEngineDeadError", "EngineLoopError"]


class _Stream:
    """One request's collector on the event loop side: at most one output waiting for the caller."""

    __slots__ = ("kind", "arrival", "pending", "ready", "completions", "num_prompt_tokens", "first_token_time",
                 "last_token_time", "finished")

    def __init__(self, kind: RequestOutputKind, arrival: float) -> None:
        self.kind, self.arrival = kind, arrival
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()
        self.completions: dict[int, CompletionOutput] = {}
        """CUMULATIVE/FINAL_ONLY callers: the deltas joined so far, by completion index."""
        self.num_prompt_tokens = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self.pending
        if pending is None or isinstance(item, BaseException):
            self.pending = item
            self.ready.set()
        elif not isinstance(pending, BaseException):
            merge_delta(pending, item)

    async def take(self) -> RequestOutput | BaseException:
        if self.pending is None:
            await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        return item


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold DELTA output `new` into the earlier DELTA output `into` of the same request (as if
    the engine had made one output of both steps)."""
    for delta in new.outputs:
        for joined in into.outputs:
            if joined.index == delta.index:
                break
        else:
            into.outputs.append(delta)
            into.outputs.sort(key=lambda c: c.index)
            continue
        joined.text += delta.text
        joined.token_ids = joined.token_ids + delta.token_ids
        if delta.logprobs is not None:
            joined.logprobs = (joined.logprobs or []) + delta.logprobs
        joined.cumulative_logprob = delta.cumulative_logprob
        joined.finish_reason, joined.stop_reason = delta.finish_reason, delta.stop_reason
    into.finished = new.finished
    into.error = new.error or into.error
    into.metrics = new.metrics or into.metrics
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class _EngineThread:
    """The core loop in a thread of this process: commands through a SimpleQueue, one
    `call_soon_threadsafe` per step with all of its outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.core = EngineCoreLoop(engine, self._next_commands, self._emit)
        self._thread: threading.Thread | None = None
        self._loop = self._on_outputs = self._on_dead = None
        self.dead_error: BaseException | None = None
        self.info = {"max_model_len": engine.max_model_len, "vocab_size": engine.spec.vocab_size,
                     "model_path": engine.model_path}

    def attach(self, loop, on_outputs, on_dead) -> None:
        self._loop, self._on_outputs, self._on_dead = loop, on_outputs, on_dead
        self._thread = threading.Thread(target=self._run, name="graphrunner-engine", daemon=True)
        self._thread.start()

    @property
    def num_taken(self) -> int:
        return self.core.num_taken

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def stats(self) -> dict:
        stats = dict(self.engine.scheduler.stats())
        stats["steps_by_mode"] = dict(getattr(self.engine.model_runner, "steps_by_mode", {}))
        return stats

    def send(self, command) -> None:
        self._commands.put(command)

    def _next_commands(self, block: bool) -> list:
        got = []
        try:
            got.append(self._commands.get(block=block))
            while True:
                got.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return got

    def _emit(self, deliveries: Deliveries) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_outputs, deliveries)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        try:
            self.core.run()
            error = self.core.dead_error
        except BaseException as loop_error:  # noqa: BLE001 - the loop itself broke: every caller must hear of it
            logger.exception("the engine loop stopped")
            error = loop_error
        if error is not None:
            self.dead_error = AsyncEngineDeadError(f"the engine loop stopped: {type(error).__name__}: {error}")
            try:
                self._loop.call_soon_threadsafe(self._on_dead, self.dead_error)
            except RuntimeError:
                pass

    def shutdown(self) -> None:
        self.send(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.shutdown()


class AsyncLLM:
    """An engine stepped off the event loop; asyncio callers add, stream and abort requests.

    `AsyncLLM(engine)` steps `engine` in a thread; `AsyncLLM.from_config(config,
    engine_process=True)` builds the engine in its own process (and then `engine` is None).

    `stats_listener(kind, request_id, stamp, **fields)` (optional) is called on the event loop
    for each request event ("first_token", "tokens", "finished"), which is how the server's
    metrics see time to first token, inter-token latency and end-to-end latency."""

    def __init__(self, engine: LLMEngine | None = None, stats_listener=None, *, client=None,
                 tokenizer=None) -> None:
        if (engine is None) == (client is None):
            raise ValueError("give an LLMEngine (thread) or an EngineProcessClient (process), not both")
        self.engine = engine
        self._core = _EngineThread(engine) if engine is not None else client
        self.tokenizer = engine.tokenizer if engine is not None else tokenizer
        self.stats_listener = stats_listener
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._started = False
        self._num_submitted = 0
        """Adds sent to the core (the core counts those it took: the difference is the backlog)."""
        self.dead_error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, engine_process: bool = False, **kwargs) -> "AsyncLLM":
        if not engine_process:
            return cls(LLMEngine(config), **kwargs)
        from runner.engine import resolve_model_path
        from runner.engine_process import EngineProcessClient
        from runner.tokenizer import load_tokenizer
        path = resolve_model_path(config.model.model)  # builds the embedded model once, here
        config = config.model_copy(update={"model": config.model.model_copy(update={"model": path})})
        client = EngineProcessClient(config)
        try:
            client.wait_ready()
        except BaseException:
            client.shutdown(timeout=5)
            raise
        return cls(client=client, tokenizer=load_tokenizer(config.model.tokenizer or path), **kwargs)

    # ---- what the server needs to know of the engine -----------------------------------------
    @property
    def info(self) -> dict:
        """max_model_len, vocab_size, model_path (and, for the process, what it reported at start)."""
        return self._core.info

    @property
    def max_model_len(self) -> int:
        return self._core.info["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self._core.info["vocab_size"]

    @property
    def model_path(self) -> str:
        return self._core.info["model_path"]

    @property
    def engine_pid(self) -> int:
        """The engine process's id (this process's own with the engine thread)."""
        return self._core.process.pid if self.engine is None else os.getpid()

    def engine_stats(self) -> dict:
        """The scheduler's counters (num_running, num_waiting, kv_cache_usage, prefix cache,
        preemptions) and steps_by_mode; from the engine process, as of its last report."""
        return self._core.stats

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start delivering outputs to `loop` (default: the running loop); starts the engine thread."""
        if self._started:
            return
        self._started = True
        self._core.attach(loop or asyncio.get_running_loop(), self._deliver, self._died)

    def shutdown(self) -> None:
        """Stop the engine (after its current step) and release it."""
        self._core.shutdown()

    @property
    def is_running(self) -> bool:
        return self._started and self._core.is_alive and self.dead_error is None

    @property
    def num_pending_adds(self) -> int:
        """Requests handed to the engine core that it has not added yet (they count as waiting)."""
        return max(0, self._num_submitted - self._core.num_taken)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine core, or in the scheduler's waiting queue."""
        return self.num_pending_adds + self._core.stats.get("num_waiting", 0)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its outputs in the caller's `output_kind`. A request the engine
        refuses raises InvalidRequestError from the first iteration; leaving the loop early (or
        the task being cancelled) aborts the request and frees its KV blocks. When the caller is
        slower than the engine, a DELTA output carries several steps' tokens."""
        if self.dead_error is not None:
            raise AsyncEngineDeadError(f"the engine has stopped: {self.dead_error}")
        if not self._started:
            self.start()
        params = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        engine_params = params if params.output_kind is RequestOutputKind.DELTA else \
            params.model_copy(update={"output_kind": RequestOutputKind.DELTA})
        stream = _Stream(params.output_kind, time.monotonic())
        self._streams[request_id] = stream
        self._num_submitted += 1
        self._core.send(("add", (request_id, prompt, engine_params)))
        try:
            while True:
                item = await stream.take()
                if isinstance(item, BaseException):
                    raise item
                if self.stats_listener is not None:
                    self._observe(request_id, stream, item, time.monotonic())
                out = self._in_callers_kind(stream, item)
                if out is not None:
                    yield out
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self._core.send(("abort", request_id))
                if self.stats_listener is not None:
                    now = time.monotonic()
                    self.stats_listener("finished", request_id, now, e2e=now - stream.arrival, finish_reason="abort")

    def abort(self, request_id: str) -> None:
        """Abort a request: the engine core frees its blocks before its next step, and its
        generate() ends with a last output whose finish_reason is "abort"."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._core.send(("abort", request_id))

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
    def _deliver(self, items: Deliveries) -> None:
        """On the event loop: hand each request its output (or error) from one engine step (or,
        from the engine process, from every step that arrived since the last call)."""
        streams = self._streams
        for request_id, item in items:
            stream = streams.get(request_id)
            if stream is None or stream.finished:
                continue
            if isinstance(item, BaseException) or item.finished:
                stream.finished = True
            stream.put(item)

    def _died(self, error: BaseException) -> None:
        """On the event loop: the engine core stopped; every request in flight ends with `error`."""
        self.dead_error = error
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.finished = True
                stream.put(error)

    def _observe(self, request_id: str, stream: _Stream, out: RequestOutput, stamp: float) -> None:
        num_new = sum(len(c.token_ids) for c in out.outputs)
        listener = self.stats_listener
        if num_new:
            if stream.first_token_time is None:
                stream.first_token_time = stamp
                stream.num_prompt_tokens = len(out.prompt_token_ids)
                listener("first_token", request_id, stamp, ttft=stamp - stream.arrival,
                         num_prompt_tokens=stream.num_prompt_tokens, num_tokens=num_new)
            else:
                listener("tokens", request_id, stamp, itl=(stamp - stream.last_token_time) / num_new,
                         num_tokens=num_new)
            stream.last_token_time = stamp
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason is not None]
            listener("finished", request_id, stamp, e2e=stamp - stream.arrival,
                     finish_reason=reasons[-1] if reasons else "abort")


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)
