"""What the engine keeps per request between steps, and how it turns that into outputs.

`RequestState` is one request's output side (its text, logprobs, what DELTA outputs already
handed out, its error); `ParentRequest` merges the completions of a request with `n` > 1, which
runs as n child requests `f"{index}_{request_id}"` (vLLM's names). `completion_fields` makes a
request's completion once per step; `completion_output` and `request_output` build the
vLLM-shaped outputs from it, `wire_output` the engine process's tuple.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs import RequestOutputKind
from runner.detokenizer import IncrementalDetokenizer
from runner.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runner.request import Request, RequestStatus


@dataclass(slots=True)
class RequestState:
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
    """Why the request failed (finish_reason "abort"); its output carries it."""
    parent: "ParentRequest | None" = None
    index: int = 0
    """The completion's index among its parent's `n` (0 without a parent)."""
    prompt_logprobs: list | None = None
    """Prompt logprobs entries received so far (prompt_logprobs=k), in prompt order."""
    prompt_sent: bool = False
    """Wire outputs (`wire_output`): the prompt went out with an earlier one."""


@dataclass(slots=True)
class ParentRequest:
    """A request with `n` > 1, whose completions run as child requests."""
    request_id: str
    kind: RequestOutputKind
    children: list[RequestState]
    finished: list[CompletionOutput | None]
    """FINAL_ONLY: each child's final completion, in index order, once it has one."""
    num_unfinished: int
    error: str | None = None

    def merge(self, changed: list[tuple[RequestState, CompletionOutput | None]]) -> RequestOutput | None:
        """The parent's output after its children `changed` in a step: streaming kinds carry the
        completions that changed (vLLM's behaviour), FINAL_ONLY all n once every child has
        finished. The parent is finished when every child is (`num_unfinished == 0`)."""
        completions = []
        for state, completion in changed:
            if state.request.status is RequestStatus.FINISHED:
                self.num_unfinished -= 1
                if self.kind is RequestOutputKind.FINAL_ONLY:
                    self.finished[state.index] = completion
            if completion is not None:
                completions.append(completion)
        finished = self.num_unfinished == 0
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = list(self.finished)
        if not completions:
            return None
        completions.sort(key=lambda c: c.index)
        first = self.children[0]
        return RequestOutput(self.request_id, first.request.prompt, first.request.prompt_token_ids, first.prompt_logprobs,
                             completions, finished, first.metrics, self.error)


def completion_fields(state: RequestState, finished: bool) -> tuple | None:
    """The request's completion after a step, in its `output_kind`, as CompletionOutput's
    positional arguments: everything so far (CUMULATIVE), what is new since its last output
    (DELTA), or None until it finishes (FINAL_ONLY). Text is the detokenizer's stable prefix until
    the request finishes, so no output shows text a later one takes back. A tuple, not the object:
    the engine process sends these fields as they are (`wire_output`)."""
    request = state.request
    kind = request.sampling_params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    tokens = request.output_token_ids  # only ever grows: the output copies its prefix when read
    detok = state.detokenizer
    text = "" if detok is None else detok.text if finished else detok.text[:detok.num_stable_chars]
    logprobs = state.logprobs
    cumulative = state.cumulative_logprob if logprobs is not None else None
    if kind is RequestOutputKind.DELTA:
        start, chars = state.num_sent_tokens, state.num_sent_chars
        state.num_sent_tokens, state.num_sent_chars = len(tokens), max(chars, len(text))
        return (state.index, text[chars:], tokens[start:], cumulative,
                logprobs[start:] if logprobs is not None else None, request.finish_reason, request.stop_reason)
    return (state.index, text, tokens, cumulative, logprobs[:] if logprobs is not None else None,
            request.finish_reason, request.stop_reason, len(tokens))


def completion_output(state: RequestState, finished: bool) -> CompletionOutput | None:
    """`completion_fields` as a CompletionOutput (None when there is nothing to show)."""
    fields = completion_fields(state, finished)
    return None if fields is None else CompletionOutput(*fields)


def request_output(state: RequestState, completion: CompletionOutput | None) -> RequestOutput | None:
    """A request without a parent: its completion as a RequestOutput."""
    if completion is None:
        return None
    request = state.request
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, state.prompt_logprobs, [completion],
                         request.status is RequestStatus.FINISHED, state.metrics, state.error)


def wire_output(state: RequestState, fields: tuple) -> tuple:
    """A request without a parent, DELTA: its output straight in the engine process's wire format
    (runner/engine_process.encode_outputs' tuple: the prompt with the first output, metrics with
    the last), without building the RequestOutput and CompletionOutput the wire would take apart."""
    request = state.request
    finished = request.status is RequestStatus.FINISHED
    prompt = None
    if not state.prompt_sent:
        state.prompt_sent = True
        prompt = (request.prompt, request.prompt_token_ids, state.prompt_logprobs)
    return (request.request_id, [fields], finished, state.error, prompt, state.metrics if finished else None)
