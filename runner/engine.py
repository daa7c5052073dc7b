"""LLMEngine: the "serve decode steps" API (add_request / step / abort_request)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from configs import EngineConfig, RequestOutputKind, SamplingParams
from models.hf_config import load_hf_config, model_spec, resolve_max_model_len
from runner.detokenizer import IncrementalDetokenizer
from runner.outputs import CompletionOutput, PendingOutput, RequestMetrics, RequestOutput
from runner.platform import resolve_device, resolve_dtype
from runner.request import Request, RequestStatus
from runner.sampling.bad_words import bad_words_token_ids
from runner.scheduler import Scheduler

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine refuses; raised by add_request before anything is queued."""


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    """None without a tokenizer: there is no text to keep."""
    logprobs: list[dict] | None
    """Per generated token {token id: Logprob}, when the request asked for logprobs."""
    metrics: RequestMetrics
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0
    """DELTA outputs: token ids (and logprob entries) already handed out..."""
    num_sent_chars: int = 0
    """...and characters of text."""
    error: str | None = None
    """Why the request failed (structured output: a refused token or a failed compile)."""
    prompt_logprobs: list | None = None
    """Prompt logprobs entries received so far (prompt_logprobs=k), in prompt order."""


def resolve_model_path(model: str, download_dir: str | None = None) -> str:
    """'default' is the embedded SmolLM2, built on first use in `download_dir` (ModelConfig.download_dir)."""
    if model == "default":
        from models.embedded import ensure_smollm2
        return str(ensure_smollm2(home=download_dir))
    return model


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it ships none (prompts must then be token ids).
    Looks for the files first: transformers may otherwise build an empty tokenizer from config.json."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer files in %s; prompts must be token ids", path)
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        logger.info("no tokenizer in %s (%s); prompts must be token ids", path, type(error).__name__)
        return None


def eos_token_ids(path: str, spec, tokenizer) -> set[int]:
    """EOS ids as HF generate sees them: generation_config.json first, then config, then tokenizer."""
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = list(spec.eos_token_ids) or (tokenizer.eos_token_id if tokenizer is not None else None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model.model, config.model.download_dir)
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
            self.executor.shutdown()  # e.g. too few KV blocks: release pipeline workers at once
            raise
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._in_flight: PendingOutput | None = None
        """The launched step whose tokens the next step() applies (async scheduling)."""
        self._undelivered: list[RequestOutput] = []
        """Outputs of an applied step that a failing launch kept from being returned; the next step() returns them."""
        self._structured = None
        """STRUCTURED OUTPUT: the StructuredOutputManager, made for the first request with a constraint."""

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _make_executor(self, path: str):
        args = (self.config, self.spec, path, self.device, self.dtype, self.max_model_len)
        if self.config.parallel.pipeline_parallel_size > 1:
            from runner.pipeline.executor import PipelineExecutor
            return PipelineExecutor(*args)
        from runner.executor import UniProcExecutor
        return UniProcExecutor(*args)

    @property
    def model_runner(self):
        """The (rank-0) model runner, for inspection: cuda_graph_ready, graph counters."""
        return self.executor.model_runner

    # ---- requests ----------------------------------------------------------------------------
    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._tracked:
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
        for name, ids in params.token_id_fields().items():
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise InvalidRequestError(f"request {request_id!r}: {name} has token id(s) {outside[:5]} outside the "
                                          f"vocabulary [0, {vocab})")
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
            runner = self.executor.model_runner
            self._structured = StructuredOutputManager(self.tokenizer, self.spec.vocab_size,
                                                       self.config.scheduler.max_num_seqs, self.device)
            runner.token_bitmask_provider = self._structured.token_bitmask
        return self._structured

    def _accept_structured(self, sampled: dict[str, int]) -> list[RequestOutput]:
        """Advance each structured request's matcher by its token; a refused token aborts that
        request alone (its output, with the error, is returned; the token is dropped)."""
        outputs = []
        structured = self._structured
        for request_id in [r for r in sampled if r in structured.states]:
            error = structured.accept(request_id, sampled[request_id])
            if error is not None:
                outputs.append(self._fail(request_id, error))
        return outputs

    def _fail(self, request_id: str, error: str) -> RequestOutput:
        """Finish a request with "abort" and `error`, now; its final output."""
        logger.warning("request %r failed: %s", request_id, error)
        tracked = self._tracked.pop(request_id)
        tracked.error = error
        self.scheduler.finish_request(request_id, "abort")
        self._structured.remove(request_id)
        tracked.metrics.finished_time = time.monotonic()
        return self._output(tracked)

    def _structured_housekeeping(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile end with an error output."""
        if self._structured is None or not self._structured.active:
            return []
        return [self._fail(request_id, error) for request_id, error in self._structured.pop_failed()
                if request_id in self._tracked]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; a bad one raises InvalidRequestError and changes nothing."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"request {request_id!r}: text prompt but {self.model_path} has no "
                                          "tokenizer; pass token ids")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
        self._validate(request_id, token_ids, params)
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params, prompt=text)
        if params.structured_outputs is not None:  # parsed now (a bad one is refused), compiled in the background
            try:
                request.grammar = self.structured_output.add_request(request_id, params.structured_outputs)
            except ValueError as error:
                raise InvalidRequestError(f"request {request_id!r}: {error}") from error
        if params.bad_words:
            request.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        try:
            self.scheduler.add_request(request)
        except ValueError as error:
            if request.grammar is not None:
                self._structured.remove(request_id)
            raise InvalidRequestError(f"request {request_id!r}: {error}") from error
        if request.grammar is not None:  # the grammar may end where the request may stop: EOS, stop ids
            request.grammar.stop_token_ids = sorted(request.stop_token_ids)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                                            params.stop)
        self._tracked[request_id] = _Tracked(request, detok, [] if params.logprobs is not None else None,
                                             RequestMetrics(arrival_time=time.monotonic()),
                                             prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort_request(request_id)
        if self._structured is not None:
            self._structured.remove(request_id)
        return self._output(tracked)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or a step in flight whose outputs the next step() returns."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._undelivered)

    # ---- steps -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; outputs of every request that got a token.

        With async scheduling the forward launched here is the next one, and the outputs are
        those of the step launched by the previous call (none on the first call)."""
        failed = self._structured_housekeeping()
        if self.async_scheduling:
            return failed + self._step_async()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if sched.finished_ids or sched.preempted_ids:
                self.executor.execute(sched)  # lets the runner drop per-request state (generators)
            if self._structured is not None and self.scheduler.has_unfinished_requests():
                self._structured.wait_for_compiles()  # only compiling requests left: wait, do not spin
            return failed
        try:
            result = self.executor.execute(sched)
        except BaseException:
            self.scheduler.cancel_step()  # the engine stays usable: the same step runs again next time
            raise
        return failed + self._apply(result)

    def _apply(self, result) -> list[RequestOutput]:
        """A step's tokens into the scheduler (stops, frees), then text, stop strings and outputs."""
        now = time.monotonic()
        structured = self._structured if self._structured is not None and self._structured.active else None
        outputs = [] if structured is None else self._accept_structured(result.sampled)
        for request_id, entries in getattr(result, "prompt_logprobs", {}).items():
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.prompt_logprobs is not None:
                if self.tokenizer is not None:
                    for entry in entries:
                        for token, logprob in (entry or {}).items():
                            logprob.decoded_token = self.tokenizer.decode([token])
                tracked.prompt_logprobs.extend(entries)
        for request in self.scheduler.update(result.sampled):
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                if (structured is not None and request.status is not RequestStatus.FINISHED
                        and structured.is_terminated(request.request_id)):
                    self.scheduler.finish_request(request.request_id, "stop")  # the grammar is complete
                output = self._advance(tracked, result, now)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch step n+1, then wait for step n's tokens and apply them.

        The scheduler plans n+1 with step n in flight: placeholders for n's tokens (the runner
        gathers them on the device), and no request whose token in flight certainly ends it.
        Requests that stopped at step n lose their n+1 work when n is applied. When n+1 would
        have to preempt, step n is applied first (a drain) and n+1 scheduled after it."""
        outputs = self._undelivered  # grows as steps are applied; kept for the next call if anything raises
        previous = self._in_flight
        if previous is not None and self._structured is not None and self._structured.active:
            # STRUCTURED OUTPUT: the next step's bitmask needs this step's tokens in the matchers,
            # so apply it before scheduling (the host work of such steps does not overlap the device).
            self._in_flight = None
            outputs += self._resolve_and_apply(previous)
            previous = None
        sched = self.scheduler.schedule()
        if sched is None:  # it would preempt blocks the step in flight writes: apply that step first
            self._in_flight = None
            outputs += self._resolve_and_apply(previous)
            previous = None
            sched = self.scheduler.schedule()
        pending = None
        if sched.scheduled:
            try:
                pending = self.executor.execute_async(sched)
            except BaseException:
                self.scheduler.cancel_step()  # the step in flight, if any, stays: the next call applies it
                raise
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
        except BaseException:
            # Its tokens are lost, and the step launched after it fed on them: forget both; the
            # next schedule() hands out the same work again (blocks stay with their requests).
            self._in_flight = None
            while self.scheduler.num_steps_pending:
                self.scheduler.cancel_step()
            raise
        return self._apply(result)

    def _advance(self, tracked: _Tracked, result, now: float) -> RequestOutput | None:
        """A request got a token: metrics, logprobs, text and stop strings, then its output."""
        request, metrics = tracked.request, tracked.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if tracked.logprobs is not None and request.request_id in result.logprobs:
            entry = result.logprobs[request.request_id]
            tracked.cumulative_logprob += next(iter(entry.values())).logprob  # the sampled token comes first
            if self.tokenizer is not None:
                for token, logprob in entry.items():
                    logprob.decoded_token = self.tokenizer.decode([token])
            tracked.logprobs.append(entry)
        if tracked.detokenizer is not None:
            stop = tracked.detokenizer.update(request.output_token_ids)
            if stop is not None and request.status is not RequestStatus.FINISHED:
                self.scheduler.finish_request(request.request_id, "stop", stop_reason=stop)
        if request.status is RequestStatus.FINISHED:
            metrics.finished_time = now
            del self._tracked[request.request_id]
            if request.grammar is not None:
                self._structured.remove(request.request_id)
        return self._output(tracked)

    def _output(self, tracked: _Tracked) -> RequestOutput | None:
        """The request's output after a step, in its `output_kind`: everything so far (CUMULATIVE),
        what is new since its last output (DELTA), or nothing until it finishes (FINAL_ONLY)."""
        request = tracked.request
        finished = request.status is RequestStatus.FINISHED
        kind = request.sampling_params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        tokens = request.output_token_ids  # only ever grows: the output copies its prefix when read
        text = tracked.detokenizer.text if tracked.detokenizer is not None else ""
        logprobs = tracked.logprobs
        if kind is RequestOutputKind.DELTA:
            start, chars = tracked.num_sent_tokens, tracked.num_sent_chars
            tracked.num_sent_tokens, tracked.num_sent_chars = len(tokens), max(chars, len(text))
            completion = CompletionOutput(0, text[chars:], tokens[start:],
                                          tracked.cumulative_logprob if logprobs is not None else None,
                                          logprobs[start:] if logprobs is not None else None, request.finish_reason,
                                          request.stop_reason)
        else:
            # Positional: keyword arguments would add a third to the cost of this per-request, per-step call.
            completion = CompletionOutput(0, text, tokens, tracked.cumulative_logprob if logprobs is not None else None,
                                          logprobs[:] if logprobs is not None else None, request.finish_reason,
                                          request.stop_reason, len(tokens))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, tracked.prompt_logprobs, [completion],
                             finished, tracked.metrics, tracked.error)

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        self.executor.shutdown()
