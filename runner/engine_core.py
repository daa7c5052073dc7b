"""The engine core loop: take every queued command (add / abort / stop), run one step, hand the
step's outputs on in one batch; repeat while there is work, block for a command when idle.

The same loop runs in the AsyncLLM engine thread and in the engine process
(runner/engine_process.py); only where commands come from and where a step's outputs go
differ. It never waits for the consumer: outputs are handed on once per step, as one list of
`(request_id, RequestOutput | BaseException)`, and the consumer merges what a request got over
several steps if it is slower than the engine (AsyncLLM's per-request collector).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from runner.engine import InvalidRequestError, LLMEngine

logger = logging.getLogger(__name__)


class EngineLoopError(RuntimeError):
    """The engine failed while serving a request: the request ends with this error."""


class AsyncEngineDeadError(EngineLoopError):
    """The engine behind AsyncLLM (its thread or its process) has stopped: the requests it held
    end with this error, new ones are refused, and /health answers 503."""


Command = tuple[str, object]
"""("add", (request_id, prompt, params)) | ("abort", request_id) | ("stop", None)."""
Deliveries = list[tuple[str, object]]


class EngineCoreLoop:
    """Runs `engine` until a "stop" command or until it dies.

    `next_commands(block)` returns the commands queued since the last call (waiting for at least
    one when `block`); `emit(deliveries)` hands on one step's outputs and errors. `num_taken`
    counts the add commands taken so far (the caller's backlog is what it sent minus this)."""

    def __init__(self, engine: LLMEngine, next_commands: Callable[[bool], list[Command]],
                 emit: Callable[[Deliveries], None]) -> None:
        self.engine = engine
        self.next_commands = next_commands
        self.emit = emit
        self.num_taken = 0
        self.dead_error: BaseException | None = None

    def run(self) -> None:
        """Loop until "stop" (returns) or the engine dies (sets `dead_error`, returns); an error of
        the loop itself propagates (the caller fails every request)."""
        engine = self.engine
        deliveries: Deliveries = []
        while True:
            for command, payload in self.next_commands(not engine.has_unfinished_requests()):
                if command == "stop":
                    return
                self._command(command, payload, deliveries)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - reported to every request it hit, logged
                    self._step_failed(error, deliveries)
                    outputs = []
                for out in outputs:   # a RequestOutput, or the engine's wire tuple (request id first)
                    deliveries.append((out[0], out) if out.__class__ is tuple else (out.request_id, out))
            if deliveries:
                self.emit(deliveries)
                deliveries = []
            if self.dead_error is not None:
                return

    def _command(self, command: str, payload, deliveries: Deliveries) -> None:
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
                self.num_taken += 1
        elif command == "abort":
            try:
                out = engine.abort_request(payload)
            except Exception:  # noqa: BLE001 - logged; the request is gone from the caller's side already
                logger.exception("aborting request %s failed", payload)
                return
            if out is not None:
                out.finished = True
                deliveries.append((payload, out))

    def _step_failed(self, error: Exception, deliveries: Deliveries) -> None:
        """A step raised. The engine's own failure handling decides what survives; here every
        request it was serving ends with the error, so no caller waits for ever, and the loop goes
        on serving new requests unless the engine reports itself dead."""
        logger.exception("engine step failed")
        message = EngineLoopError(f"engine step failed: {type(error).__name__}: {error}")
        for request_id in list(self.engine._tracked) + list(self.engine._parents):
            self.engine.abort_request(request_id)
            deliveries.append((request_id, message))
        if type(error).__name__ == "EngineDeadError":
            self.dead_error = error


def warm_up(engine: LLMEngine) -> None:
    """One short request through the engine before the server opens its socket, so the first client
    does not pay for lazily built kernels and first-touch allocations; its prefix-cache entries
    are dropped."""
    from configs import SamplingParams
    started = time.perf_counter()
    engine.add_request([0] * 8, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), "warm-up")
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.reset_prefix_cache()
    logging.getLogger("runner.server").info("warm-up request in %.2f s; ready to serve",
                                            time.perf_counter() - started)
