"""LLMEngine: the "serve decode steps" API (add_request / step / abort_request).

Over 400 lines on purpose: the synchronous and the async step, and what each does when a step
or one request fails (cancel the step, fail its requests, or die), are one state machine over
the scheduler's pending steps; split apart, the paths that must agree would no longer be read
together. Per-request output state lives in request_state.py, text in detokenizer.py."""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from configs import EngineConfig, RequestOutputKind, SamplingParams
from configs.sampling_params import SEED_MAX, truncate_prompt
from models.config_json import ConfigFileError
from models.hf_config import load_hf_config, model_spec, resolve_max_model_len
from runner.collector import frozen_heap
from runner.detokenizer import IncrementalDetokenizer
from runner.outputs import CompletionOutput, PendingOutput, RequestMetrics, RequestOutput
from runner.platform import resolve_device, resolve_dtype
from runner.request import Request, RequestStatus
from runner.request_state import ParentRequest, RequestState, completion_fields, request_output, wire_output
from runner.sampling.bad_words import bad_words_token_ids
from runner.scheduler import Scheduler
from runner.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine refuses; raised by add_request before anything is queued."""


class EngineDeadError(RuntimeError):
    """The engine can serve nothing more: a step failed in a way that leaves the device or the
    workers unusable (see `is_fatal`). The step that failed returned an error output for every
    request it held; every later step() and add_request() raises this at once."""


_DEVICE_ERROR_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cudaError", "NCCL error",
                         "device-side assert", "illegal memory access", "an illegal instruction")
"""Messages of errors that leave a CUDA context unusable (a sticky error: every later call fails too)."""


def is_fatal(error: BaseException, executor) -> bool:
    """Whether a failed step leaves the engine unable to serve (it is then dead).

    Fatal: a device error (torch.AcceleratorError, or a RuntimeError naming a CUDA/cuBLAS/NCCL
    failure: CUDA errors are sticky, the context fails every later call) and a broken pipeline
    (the executor reports `failure`: a worker died or raised and the pipeline was torn down).
    Not fatal: anything else, e.g. out of memory (the allocation failed, nothing was corrupted),
    a bad value from one request's parameters, a Python error in the runner's host code: the
    requests of the step fail and the engine goes on with the others."""
    if getattr(executor, "failure", None):
        return True
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    message = str(error)
    return any(marker in message for marker in _DEVICE_ERROR_MARKERS)


@dataclass(slots=True)
class _Died:
    """What `_schedule` returns when the scheduler raised: the engine is dead, these are the error outputs."""
    outputs: list[RequestOutput]


def resolve_model_path(model: str) -> str:
    """'default' is the embedded SmolLM2, built on first use."""
    if model == "default":
        from models.embedded import ensure_smollm2
        return str(ensure_smollm2())
    return model


def eos_token_ids(path: str, spec, tokenizer) -> set[int]:
    """EOS ids as HF generate sees them: generation_config.json first, then config, then tokenizer.
    The file is read as JSON, as transformers' GenerationConfig reads it, without importing
    transformers (whose import chain is seconds of start-up: docs/PERFORMANCE.md, "GPU: LLM to ready")."""
    eos = None
    generation_config = Path(path) / "generation_config.json"
    if generation_config.is_file():
        try:
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as error:
            raise ConfigFileError(f"{generation_config} is not a JSON object: {error}") from None
    if eos is None:
        eos = list(spec.eos_token_ids) or (tokenizer.eos_token_id if tokenizer is not None else None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        with frozen_heap():   # its collections walk only what it allocates (runner/collector.py)
            path = resolve_model_path(config.model.model)
            self.model_path = path
            hf_config = load_hf_config(path)
            self.spec = model_spec(hf_config)
            self.device = resolve_device(config.device)
            self.dtype = resolve_dtype(config.model.dtype, self.spec, self.device)
            self.max_model_len = resolve_max_model_len(self.spec, config.model.max_model_len)
            self.async_scheduling = config.resolve_async_scheduling(self.device.type)
            """Launch step n+1 before waiting for step n's tokens (see `_step_async`). EngineConfig refuses
            it with pipeline parallelism, and auto resolves to off there."""
            self.tokenizer = load_tokenizer(config.model.tokenizer or path)
            self.executor = self._make_executor(path)
            try:
                self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks, self.max_model_len,
                                           eos_token_ids(path, self.spec, self.tokenizer),
                                           async_scheduling=self.async_scheduling)
            except BaseException:
                self.executor.shutdown()  # e.g. too few KV blocks: release the worker processes at once
                raise
        self.start_up_total_seconds = time.perf_counter() - started
        logger.info("engine ready in %.2f s: %s; %s on %s, %d KV blocks", self.start_up_total_seconds,
                    self.model_runner.start_up_times.line(self.start_up_total_seconds), self.spec.architecture,
                    self.device, self.executor.num_blocks)
        self._tracked: dict[str, RequestState] = {}
        """Unfinished requests by id (children of an `n` > 1 request by their own ids)."""
        self._parents: dict[str, ParentRequest] = {}
        self._dead: str | None = None
        """Why the engine can serve nothing more (see EngineDeadError); None while it can."""
        self._ids = itertools.count()
        self._in_flight: PendingOutput | None = None
        """The launched step whose tokens the next step() applies (async scheduling)."""
        self._undelivered: list[RequestOutput] = []
        """Outputs of an applied step that a failing launch kept from being returned; the next step() returns them."""
        self.wire_outputs = False
        """The engine process sets it: step() then returns a DELTA request without a parent as the wire
        tuple (request_state.wire_output) instead of a RequestOutput; everything else stays objects."""
        self._structured = None
        """Structured output: the StructuredOutputManager, made for the first request with a constraint."""

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _make_executor(self, path: str):
        args = (self.config, self.spec, path, self.device, self.dtype, self.max_model_len)
        if self.config.parallel.world_size > 1:
            from runner.distributed.executor import DistributedExecutor
            return DistributedExecutor(*args)
        from runner.executor import UniProcExecutor
        return UniProcExecutor(*args)

    @property
    def start_up_seconds(self) -> dict[str, float]:
        """Seconds of each start-up phase (load, profile, kv_cache, compile, capture) and `total`
        (runner/start_up_times.py), as the ready line logs them."""
        return {**self.model_runner.start_up_times.seconds, "total": self.start_up_total_seconds}

    @property
    def model_runner(self):
        """The (rank-0) model runner, for inspection: cuda_graph_ready, graph counters."""
        return self.executor.model_runner

    # ---- requests ----------------------------------------------------------------------------
    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._tracked or request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not token_ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        vocab = self.spec.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"request {request_id!r}: token id(s) {bad[:5]} outside the vocabulary "
                                      f"[0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(f"request {request_id!r}: prompt of {len(token_ids)} tokens leaves no room "
                                      f"to generate within max_model_len={self.max_model_len}")
        refused = params.vocabulary_error(vocab)
        if refused is not None:
            raise InvalidRequestError(f"request {request_id!r}: {refused[1]}")
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError(f"request {request_id!r}: bad_words need a tokenizer, and {self.model_path} "
                                      "has none")
        if (params.stop or not params.skip_special_tokens) and self.tokenizer is None:
            raise InvalidRequestError(f"request {request_id!r}: stop strings need a tokenizer, and "
                                      f"{self.model_path} has none")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"request {request_id!r}: structured_outputs needs a tokenizer, and "
                                          f"{self.model_path} has none")
            if self.config.parallel.pipeline_parallel_size > 1:
                raise InvalidRequestError(f"request {request_id!r}: structured_outputs is not supported with "
                                          f"pipeline_parallel_size={self.config.parallel.pipeline_parallel_size}")

    # ---- structured output (runner/structured_output) ------------------------------------------
    @property
    def structured_output(self):
        """The StructuredOutputManager (made on first use: it builds the tokenizer's xgrammar info)."""
        if self._structured is None:
            from runner.structured_output import StructuredOutputManager
            self._structured = StructuredOutputManager(self.tokenizer, self.spec.vocab_size,
                                                       self.config.scheduler.max_num_seqs, self.device)
            self.executor.model_runner.token_bitmask_provider = self._structured.token_bitmask
        return self._structured

    def _accept_early(self, pending: PendingOutput) -> None:
        """Async scheduling, called by the next step's bitmask fill: wait for the tokens of the step in
        flight and advance the matchers by them now; `_apply` then reports the refused ones. If the
        step failed, nothing is advanced: `_resolve_and_apply` meets the error again and forgets
        the step being launched."""
        try:
            result = pending.resolve()
        except Exception:
            return
        if getattr(result, "grammar_errors", None) is None:
            self._advance_matchers(result)

    def _advance_matchers(self, result) -> None:
        """Each structured request's matcher takes its token: the refused ones and the completed
        grammars go into the step's result (`grammar_errors`, `grammar_terminated`)."""
        structured = self._structured
        result.grammar_errors = structured.accept(result.sampled)
        result.grammar_terminated = frozenset(structured.terminated.intersection(result.sampled))

    def _accept_structured(self, result) -> list[tuple[RequestState, tuple | None]]:
        """Advance each structured request's matcher by its token (unless `_accept_early` did); a
        refused token fails that request alone (the token is dropped: the scheduler then skips the
        finished request)."""
        failed = []
        if getattr(result, "grammar_errors", None) is None:
            self._advance_matchers(result)
        for request_id, error in result.grammar_errors.items():
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                logger.warning("request %r failed: %s", request_id, error)
                failed.append((tracked, self._fail(tracked, error)))
        return failed

    def _structured_housekeeping(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile end with an error output."""
        if self._structured is None or not self._structured.active:
            return []
        failed = [(self._tracked[request_id], error) for request_id, error in self._structured.pop_failed()
                  if request_id in self._tracked]
        return self._collect([(tracked, self._fail(tracked, error)) for tracked, error in failed])

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; a bad one raises InvalidRequestError and changes nothing. With
        `params.n` > 1 it runs as n child requests whose outputs merge into this id's."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead ({self._dead}); start a new one")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"request {request_id!r}: text prompt but {self.model_path} has no "
                                          "tokenizer; pass token ids")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        self._validate(request_id, token_ids, params)
        if params.n == 1:
            self._add_one(request_id, token_ids, text, params)
            return request_id
        children = [(f"{i}_{request_id}", params.model_copy(update={
            "n": 1, "seed": None if params.seed is None else (params.seed + i) % (SEED_MAX + 1)}))
            for i in range(params.n)]   # seed + i as vLLM, wrapped: torch takes seeds up to SEED_MAX
        for child_id, _ in children:
            self._validate(child_id, token_ids, params)
        parent = ParentRequest(request_id, params.output_kind, [], [None] * params.n, params.n)
        first = None
        try:
            for index, (child_id, child_params) in enumerate(children):
                tracked = self._add_one(child_id, token_ids, text, child_params, share_prompt_of=first)
                first = first or tracked.request
                tracked.parent, tracked.index = parent, index
                parent.children.append(tracked)
        except InvalidRequestError:
            for tracked in parent.children:  # all or nothing
                self._tracked.pop(tracked.request.request_id, None)
                self.scheduler.abort_request(tracked.request.request_id)
            raise
        self._parents[request_id] = parent
        return request_id

    def _add_one(self, request_id: str, token_ids: list[int], text: str | None, params: SamplingParams,
                 share_prompt_of: Request | None = None) -> RequestState:
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params, prompt=text)
        request.prompt_source = share_prompt_of
        if params.bad_words:
            request.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        if params.structured_outputs is not None:  # parsed now (a bad one is refused), compiled in the background
            try:
                request.grammar = self.structured_output.add_request(request_id, params.structured_outputs)
            except ValueError as error:
                raise InvalidRequestError(f"request {request_id!r}: {error}") from error
        try:
            self.scheduler.add_request(request)
        except ValueError as error:
            if request.grammar is not None:
                self._structured.remove(request_id)
            raise InvalidRequestError(f"request {request_id!r}: {error}") from error
        if request.grammar is not None:  # the grammar may end where the request may stop: EOS, stop ids
            request.grammar.stop_token_ids = sorted(request.stop_token_ids)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output,
            params.min_tokens)
        tracked = self._tracked[request_id] = RequestState(
            request, detok, [] if params.logprobs is not None else None, RequestMetrics(arrival_time=time.monotonic()),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        return tracked

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request ("abort") and free its blocks; returns its final output in its
        output kind (DELTA: what was not handed out yet), or None for an unknown or finished id.
        A parent id aborts every unfinished completion."""
        parent = self._parents.get(request_id)
        if parent is not None:
            changed = []
            for tracked in parent.children:
                if self._tracked.pop(tracked.request.request_id, None) is not None:
                    self.scheduler.abort_request(tracked.request.request_id)
                    changed.append(tracked)
            return next(iter(self._collect([(t, self._finish_tracked(t)) for t in changed])), None)
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.parent is not None:
            return None
        del self._tracked[request_id]
        self.scheduler.abort_request(request_id)
        return request_output(tracked, CompletionOutput(*self._finish_tracked(tracked)))

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or a step in flight whose outputs the next step() returns."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._undelivered)

    # ---- steps -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; outputs of every request that got a token.

        With async scheduling the forward launched here is the next one, and the outputs are
        those of the step launched by the previous call (none on the first call).

        Failures: an error while processing one request (its text, stop strings, a bad token)
        finishes that request alone ("abort", `error` set). An error of the step itself (the
        forward, sampling) finishes the requests of that step the same way, returned by this
        call; if it left the device or the workers unusable (`is_fatal`) every request is
        finished so, and every later call raises EngineDeadError. KeyboardInterrupt and other
        non-Exception errors propagate and lose nothing: the same step runs again next time."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead ({self._dead}); start a new one")
        failed = self._structured_housekeeping()
        if self.async_scheduling:
            return failed + self._step_async()
        sched = self._schedule()
        if isinstance(sched, _Died):
            return failed + sched.outputs
        if not sched.scheduled:
            if sched.finished_ids or sched.preempted_ids:
                self.executor.execute(sched)  # lets the runner drop per-request state (generators)
            if self._structured is not None and self.scheduler.has_unfinished_requests():
                self._structured.wait_for_compiles()  # only compiling requests left: wait, do not spin
            return failed
        try:
            result = self.executor.execute(sched)
        except Exception as error:
            return failed + self._step_failed(error, self.scheduler.cancel_step())
        except BaseException:
            self.scheduler.cancel_step()  # interrupted: the same step runs again next time
            raise
        return failed + self._apply(result)

    def _schedule(self):
        """The scheduler's next step; if it raises, its state is not to be trusted any more: the
        engine dies, and the error outputs come back as `_Died`."""
        try:
            return self.scheduler.schedule()
        except Exception as error:
            return _Died(self._die(error))

    def _apply(self, result) -> list[RequestOutput]:
        """A step's tokens into the scheduler (stops, frees), then each request's text, stop
        strings and output (`_advance`); an error there fails that request alone."""
        now = time.monotonic()
        structured = self._structured if self._structured is not None and self._structured.active else None
        finished: list[tuple[RequestState, tuple | None]] = (
            [] if structured is None else self._accept_structured(result))
        for request_id, entries in getattr(result, "prompt_logprobs", {}).items():
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.prompt_logprobs is not None:
                if self.tokenizer is not None:
                    for entry in entries:
                        for token, logprob in (entry or {}).items():
                            logprob.decoded_token = self.tokenizer.decode([token])
                tracked.prompt_logprobs.extend(entries)
        try:
            updated = self.scheduler.update(result.sampled)
        except Exception as error:  # the scheduler's state is not to be trusted any more
            return self._collect(finished) + self._die(error)
        for request in updated:
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                continue
            if (structured is not None and request.status is not RequestStatus.FINISHED
                    and request.request_id in result.grammar_terminated):
                self.scheduler.finish_request(request.request_id, "stop")  # the grammar is complete
            try:
                completion = self._advance(tracked, result, now)
            except Exception as error:
                logger.exception("request %r failed", request.request_id)
                completion = self._fail(tracked, f"{type(error).__name__}: {error}")
            finished.append((tracked, completion))
        return self._collect(finished)

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch step n+1, then wait for step n's tokens and apply them.

        The scheduler plans n+1 with step n in flight: placeholders for n's tokens (the runner
        gathers them on the device), and no request whose token in flight certainly ends it.
        Requests that stopped at step n lose their n+1 work when n is applied. When n+1 would
        have to preempt, step n is applied first (a drain) and n+1 scheduled after it. With
        structured output, n+1's bitmask fill first waits for n's tokens and advances the
        matchers (`_accept_early`), after n+1's forward is launched: no drain. A launch
        that fails fails the requests of n+1 (n is still applied); a step n whose tokens never
        arrive fails its requests and forgets n+1 (the others' work is scheduled again)."""
        outputs = self._undelivered  # grows as steps are applied; kept for the next call if anything raises
        previous = self._in_flight
        sched = self._schedule()
        if sched is None:  # it would preempt blocks the step in flight writes: apply that step first
            self._in_flight = None
            outputs += self._resolve_and_apply(previous)
            previous = None
            sched = self._schedule() if self._dead is None else _Died([])
        if isinstance(sched, _Died):
            self._undelivered = []
            return outputs + sched.outputs
        pending = None
        if sched.scheduled:
            structured = self._structured if self._structured is not None and self._structured.active else None
            if structured is not None and previous is not None:
                # The bitmask of n+1 needs n's tokens in the matchers: the fill (after n+1's forward
                # is launched) first waits for them and advances the matchers (`_accept_early`).
                structured.before_fill = lambda: self._accept_early(previous)
            try:
                pending = self.executor.execute_async(sched)
            except Exception as error:
                outputs += self._step_failed(error, self.scheduler.cancel_step())
                if self._dead is not None:
                    self._undelivered = []
                    return outputs
            except BaseException:
                self.scheduler.cancel_step()  # the step in flight, if any, stays: the next call applies it
                raise
            finally:
                if structured is not None:
                    structured.before_fill = None
        elif sched.finished_ids or sched.preempted_ids:
            self.executor.execute(sched)  # lets the runner drop per-request state (generators)
        if pending is None and previous is None and self._structured is not None and self._structured.active:
            self._structured.wait_for_compiles()  # only compiling requests left: wait, do not spin
        self._in_flight = pending
        if previous is not None:
            outputs += self._resolve_and_apply(previous)
        self._undelivered = []
        return outputs

    def _resolve_and_apply(self, pending: PendingOutput) -> list[RequestOutput]:
        try:
            result = pending.resolve()
        except BaseException as error:
            # Its tokens are lost, and the step launched after it fed on them: forget both; the
            # next schedule() hands out the other requests' work again (blocks stay with them).
            self._in_flight = None
            step_requests = []
            while self.scheduler.num_steps_pending:
                step_requests = self.scheduler.cancel_step()  # the newest first: the last is `pending`'s
            if not isinstance(error, Exception):
                raise
            return self._step_failed(error, step_requests)
        return self._apply(result)

    def _step_failed(self, error: Exception, step_requests: list[Request]) -> list[RequestOutput]:
        """A step raised: error outputs for its requests, or for every request if the engine is dead."""
        if is_fatal(error, self.executor):
            logger.error("engine step failed; the engine is dead", exc_info=error)
            return self._die(error)
        logger.error("engine step failed; its %d request(s) are finished with the error", len(step_requests),
                     exc_info=error)
        message = f"the engine step failed: {type(error).__name__}: {error}"
        return self._fail_all([self._tracked[r.request_id] for r in step_requests if r.request_id in self._tracked],
                              message)

    def _die(self, error: BaseException) -> list[RequestOutput]:
        """Mark the engine dead and finish every request with the error."""
        self._dead = f"{type(error).__name__}: {error}"
        self._in_flight, self._undelivered = None, []
        while self.scheduler.num_steps_pending:
            self.scheduler.cancel_step()
        return self._fail_all(list(self._tracked.values()), f"the engine died: {self._dead}")

    def _fail_all(self, failed: list[RequestState], message: str) -> list[RequestOutput]:
        return self._collect([(tracked, self._fail(tracked, message)) for tracked in failed])

    def _collect(self, changed: list[tuple[RequestState, tuple | None]]) -> list[RequestOutput]:
        """The step's outputs from its requests' completions (`completion_fields`): one per
        request, and one per parent (`n` > 1) merging its children's; None completions (nothing to
        show) are left out. With `wire_outputs`, a DELTA request without a parent gives its wire tuple."""
        outputs, parents = [], {}
        wire = self.wire_outputs
        for tracked, fields in changed:
            if tracked.parent is not None:
                completion = None if fields is None else CompletionOutput(*fields)
                parents.setdefault(tracked.parent.request_id, []).append((tracked, completion))
            elif fields is not None:
                if wire and tracked.request.sampling_params.output_kind is RequestOutputKind.DELTA:
                    outputs.append(wire_output(tracked, fields))
                else:
                    outputs.append(request_output(tracked, CompletionOutput(*fields)))
        for parent_id, children in parents.items():
            parent = self._parents[parent_id]
            output = parent.merge(children)
            if parent.num_unfinished == 0:
                del self._parents[parent_id]
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail(self, tracked: RequestState, message: str) -> tuple | None:
        """Finish one request with "abort" and `message` as its error; frees its blocks."""
        request = tracked.request
        if self.scheduler.finish_request(request.request_id, "abort") is None:
            request.finish_reason, request.stop_reason = "abort", None  # the scheduler had finished it already
        tracked.error = message
        if tracked.parent is not None and tracked.parent.error is None:
            tracked.parent.error = message
        self._tracked.pop(request.request_id, None)
        return self._finish_tracked(tracked)

    def _advance(self, tracked: RequestState, result, now: float) -> tuple | None:
        """A request got a token: metrics, logprobs, text and stop strings, then its completion's
        fields (`completion_fields`; None when its output kind has nothing to show yet)."""
        request, metrics = tracked.request, tracked.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        token = request.output_token_ids[-1]
        if not 0 <= token < self.spec.vocab_size:
            raise ValueError(f"sampled token id {token} is outside the vocabulary [0, {self.spec.vocab_size})")
        if tracked.logprobs is not None and request.request_id in result.logprobs:
            entry = result.logprobs[request.request_id]
            tracked.cumulative_logprob += next(iter(entry.values())).logprob  # the sampled token comes first
            if self.tokenizer is not None:
                for token_id, logprob in entry.items():
                    logprob.decoded_token = self.tokenizer.decode([token_id])
            tracked.logprobs.append(entry)
        if tracked.detokenizer is not None:
            stop = tracked.detokenizer.update(request.output_token_ids)
            if stop is not None and request.status is not RequestStatus.FINISHED:
                self.scheduler.finish_request(request.request_id, "stop", stop_reason=stop)
        if request.status is RequestStatus.FINISHED:
            del self._tracked[request.request_id]
            return self._finish_tracked(tracked, now)
        return completion_fields(tracked, False)

    def _finish_tracked(self, tracked: RequestState, now: float | None = None) -> tuple:
        """The request has finished (any reason): all its text is final; its last completion's fields."""
        tracked.metrics.finished_time = now if now is not None else time.monotonic()
        if tracked.request.grammar is not None and self._structured is not None:
            self._structured.remove(tracked.request.request_id)
        if tracked.detokenizer is not None:
            tracked.detokenizer.finish()
        try:
            return completion_fields(tracked, True)
        except Exception as error:  # an error output must not fail in turn
            logger.exception("request %r: output failed", tracked.request.request_id)
            tracked.error = tracked.error or f"{type(error).__name__}: {error}"
            return (tracked.index, "", [], None, None, "abort", None)   # completion_fields' order: no text, aborted

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        self.executor.shutdown()
