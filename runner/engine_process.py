"""The engine in its own process (`graphrunner serve --engine-process`), as vLLM runs its engine core.

    server process (event loop, HTTP, SSE)                 engine process (EngineCoreLoop)
      sender thread --[commands pipe: lists of commands]-->  add / abort / stop, then step()
      event loop   <--[outputs pipe: one message a step]--   outputs (compact tuples) + stats

Why a process: the engine's step is Python host work between device launches, and so is the
server's HTTP and SSE work. In one interpreter they share the GIL; every torch call releases and
retakes it, and retaking it while the event loop holds it costs up to the switch interval
(5 ms), so a busy event loop slows every step (the convoy effect). In its own process the step
loop runs as fast as offline `LLM.generate` and the server only receives its outputs.

Why multiprocessing pipes and not ZMQ: one reader and one writer each way, on one host; a pipe
needs no dependency, and its file descriptor goes straight into the event loop (`add_reader`),
so receiving costs no thread. The outputs pipe is enlarged (F_SETPIPE_SZ) so that the engine
rarely waits for a busy event loop.

Failure handling: the engine process dying (killed, crashed) closes its end of the outputs
pipe; the event loop sees end-of-file, fails every in-flight request with AsyncEngineDeadError,
refuses new ones, and /health answers 503. The engine process stops when the server process
goes away (end-of-file on the commands pipe).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection

from configs import EngineConfig
from runner.engine_core import AsyncEngineDeadError, Command, Deliveries, EngineCoreLoop, EngineLoopError
from runner.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

_PIPE_BYTES = 1 << 20
"""Outputs pipe capacity asked for (Linux F_SETPIPE_SZ; the default is 64 KiB, a few steps of 256 streams)."""
_STATS_INTERVAL_S = 0.05
"""Engine statistics (for /metrics and the waiting bound) ride along with outputs at most this often."""


# ---- the wire format of outputs -------------------------------------------------------------------
def encode_outputs(deliveries: Deliveries, prompt_sent: set[str]) -> list:
    """Compact tuples for one step's deliveries: the prompt (ids, text, prompt logprobs) only in a
    request's first output, metrics only in its last; errors as the exception objects. What the
    engine already made in this form (`LLMEngine.wire_outputs`: request_state.wire_output) passes
    as it is (it tracks its own prompts: an abort's RequestOutput after it may carry the prompt
    again, which the receiver takes as the same prompt)."""
    encoded = []
    for request_id, item in deliveries:
        if item.__class__ is tuple:
            encoded.append(item)
            continue
        if isinstance(item, BaseException):
            encoded.append((request_id, item))
            prompt_sent.discard(request_id)
            continue
        first = request_id not in prompt_sent
        if first:
            prompt_sent.add(request_id)
        if item.finished:
            prompt_sent.discard(request_id)
        completions = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                        c.stop_reason) for c in item.outputs]
        encoded.append((request_id, completions, item.finished, item.error,
                        (item.prompt, item.prompt_token_ids, item.prompt_logprobs) if first else None,
                        item.metrics if item.finished else None))
    return encoded


def decode_output(entry: tuple, prompt: tuple | None) -> RequestOutput:
    """A RequestOutput from `encode_outputs`' tuple; `prompt`: the request's (text, ids, prompt
    logprobs) as its first output carried them."""
    request_id, completions, finished, error, _, metrics = entry
    text, ids, prompt_logprobs = prompt if prompt is not None else (None, [], None)
    return RequestOutput(request_id, text, ids, prompt_logprobs, [CompletionOutput(*c) for c in completions],
                         finished, metrics, error)


# ---- the engine process ---------------------------------------------------------------------------
def run_engine_process(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int) -> None:
    """Entry point of the engine process: build and warm up the engine, report ready, then run the
    core loop on the two pipes until "stop" or end-of-file on the commands pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    from runner.engine import LLMEngine
    from runner.collector import quiet_garbage_collector
    from runner.engine_core import warm_up
    try:
        engine = LLMEngine(config)
        warm_up(engine)
        engine.wire_outputs = True   # its outputs only cross the pipe: no RequestOutput to build
        quiet_garbage_collector()    # no full collection of the whole heap while serving
    except BaseException as error:  # noqa: BLE001 - reported to the server, which refuses to start
        logger.exception("the engine failed to start")
        outputs.send(("failed", f"{type(error).__name__}: {error}"))
        return
    outputs.send(("ready", engine_info(engine)))
    prompt_sent: set[str] = set()
    last_stats = [0.0]
    loop: EngineCoreLoop

    def next_commands(block: bool) -> list[Command]:
        got: list[Command] = []
        try:
            if block:
                outputs.send(("stats", None, loop.num_taken, engine_stats(engine)))  # idle: /metrics sees it now
                commands.poll(None)
            while commands.poll():
                got.extend(commands.recv())
        except (EOFError, OSError):  # the server went away
            got.append(("stop", None))
        return got

    def emit(deliveries: Deliveries) -> None:
        now = time.monotonic()
        stats = None
        if now - last_stats[0] >= _STATS_INTERVAL_S:
            stats, last_stats[0] = engine_stats(engine), now
        outputs.send(("out", encode_outputs(deliveries, prompt_sent), loop.num_taken, stats))

    loop = EngineCoreLoop(engine, next_commands, emit)
    try:
        loop.run()
        if loop.dead_error is not None:
            outputs.send(("dead", f"{type(loop.dead_error).__name__}: {loop.dead_error}"))
    except (BrokenPipeError, EOFError):
        pass  # the server went away
    except BaseException as error:  # noqa: BLE001 - the loop broke: the server fails every request
        logger.exception("the engine loop stopped")
        try:
            outputs.send(("dead", f"{type(error).__name__}: {error}"))
        except OSError:
            pass
    finally:
        engine.shutdown()


def engine_info(engine) -> dict:
    """What the server needs to know of the engine once (its limits, for validation and /v1/models)."""
    return {"max_model_len": engine.max_model_len, "vocab_size": engine.spec.vocab_size,
            "model_path": engine.model_path, "architecture": engine.spec.architecture,
            "device": str(engine.device), "num_blocks": engine.executor.num_blocks,
            "cuda_graph_ready": engine.model_runner.cuda_graph_ready,
            "cudagraph_mode": engine.model_runner.cudagraph_mode.name}


def engine_stats(engine) -> dict:
    """The scheduler's counters and the steps by graph mode (read by /metrics)."""
    stats = dict(engine.scheduler.stats())
    stats["steps_by_mode"] = dict(getattr(engine.model_runner, "steps_by_mode", {}))
    return stats


# ---- the server side --------------------------------------------------------------------------------
class EngineProcessClient:
    """Starts the engine process and talks to it: `send` queues a command (a sender thread pickles
    and writes, so the event loop never blocks on a full pipe); outputs arrive on the event loop
    through `add_reader` and go to `on_outputs(deliveries)`; `on_dead(error)` is called once if the
    process dies or its engine does."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: dict = {}
        self.stats: dict = {}
        self.num_taken = 0
        self.dead_error: BaseException | None = None
        self._prompts: dict[str, tuple] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = None
        self._on_outputs = self._on_dead = None
        ctx = multiprocessing.get_context("spawn")
        commands_read, self._commands_write = ctx.Pipe(duplex=False)
        self._outputs_read, outputs_write = ctx.Pipe(duplex=False)
        _enlarge_pipe(outputs_write)
        self.process = ctx.Process(target=run_engine_process, name="graphrunner-engine",
                                   args=(config, commands_read, outputs_write,
                                         logging.getLogger().getEffectiveLevel()), daemon=False)
        self.process.start()
        commands_read.close()  # ours are the other ends: the child's exit must close its pipes for good
        outputs_write.close()
        self._sender = threading.Thread(target=self._send_loop, name="graphrunner-engine-sender", daemon=True)
        self._sender.start()

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Block until the engine process has built and warmed up its engine; its info dict. Raises
        RuntimeError if it failed or exited first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._outputs_read.poll(0.5):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (exit code {self.process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine process was not ready within {timeout} s")
        try:
            kind, payload = self._outputs_read.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited during start-up (exit code "
                               f"{self.process.join(5) or self.process.exitcode})") from None
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.info = payload
        return payload

    def attach(self, loop, on_outputs, on_dead) -> None:
        """Deliver outputs to `loop` from now on."""
        self._loop, self._on_outputs, self._on_dead = loop, on_outputs, on_dead
        loop.add_reader(self._outputs_read.fileno(), self._readable)
        # uvloop (libuv) makes a watched descriptor non-blocking; Connection.recv reads whole messages
        # and would fail on a message that has only partly arrived, so the pipe goes back to blocking.
        os.set_blocking(self._outputs_read.fileno(), True)

    def send(self, command: Command) -> None:
        self._commands.put(command)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self.process.is_alive()

    def _send_loop(self) -> None:
        while True:
            batch = [self._commands.get()]
            while True:
                try:
                    batch.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            try:
                self._commands_write.send(batch)
            except (OSError, ValueError):
                return  # the engine process is gone: the outputs pipe reports it
            if any(command == "stop" for command, _ in batch):
                return

    def _readable(self) -> None:
        """On the event loop: every message waiting in the outputs pipe, handed on as one batch."""
        deliveries: Deliveries = []
        try:
            while self._outputs_read.poll():
                message = self._outputs_read.recv()
                kind = message[0]
                if kind == "out":
                    _, encoded, self.num_taken, stats = message
                    if stats is not None:
                        self.stats = stats
                    prompts = self._prompts
                    for entry in encoded:
                        request_id = entry[0]
                        if len(entry) == 2:
                            deliveries.append(entry)
                            prompts.pop(request_id, None)
                            continue
                        if entry[4] is not None:
                            prompts[request_id] = entry[4]
                        out = decode_output(entry, prompts.get(request_id))
                        if out.finished:
                            prompts.pop(request_id, None)
                        deliveries.append((request_id, out))
                elif kind == "stats":
                    _, _, self.num_taken, self.stats = message
                elif kind == "dead":
                    self._died(AsyncEngineDeadError(f"the engine died: {message[1]}"), deliveries)
                    return
        except (EOFError, OSError):
            code = self.process.join(5) or self.process.exitcode
            self._died(AsyncEngineDeadError(f"the engine process exited (exit code {code})"), deliveries)
            return
        if deliveries:
            self._on_outputs(deliveries)

    def _died(self, error: AsyncEngineDeadError, deliveries: Deliveries) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._outputs_read.fileno())
        if deliveries:
            self._on_outputs(deliveries)
        if self.dead_error is None:
            self.dead_error = error
            logger.error("%s", error)
            self._on_dead(error)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop after its current step; terminate it if it does not."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._outputs_read.fileno())
            except (ValueError, OSError):
                pass
        self.send(("stop", None))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._commands_write.close()
        self._outputs_read.close()


def _enlarge_pipe(connection: Connection) -> None:
    try:
        import fcntl
        fcntl.fcntl(connection.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except (ImportError, OSError):
        pass  # not Linux, or over /proc/sys/fs/pipe-max-size: the default size only costs some waiting


__all__ = ["EngineProcessClient", "EngineLoopError", "AsyncEngineDeadError", "run_engine_process"]
