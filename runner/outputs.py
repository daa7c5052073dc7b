"""What the runner hands the engine, and what the engine hands the user."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests that sampled this step (the last pipeline rank's answer)."""
    sampled: dict[str, int]
    logprobs: dict[str, dict[int, "Logprob"]] = field(default_factory=dict)
    """request id -> {token id: Logprob (logprob, rank; no text)} for the sampled token and the
    top-k, when asked."""
    prompt_logprobs: dict[str, list[dict[int, "Logprob"] | None]] = field(default_factory=dict)
    """request id -> this step's prompt logprobs entries (prompt_logprobs=k), in prompt order: a
    prefill chunk's share, None first for the prompt's first token; the engine appends them."""
    grammar_errors: dict[str, str] | None = None
    """Structured output: {request id: error} of the tokens the grammar refused, once the engine
    has advanced the matchers by this step's tokens (None before: each step's tokens go to the
    matchers exactly once, early under async scheduling, see LLMEngine._accept_early)."""
    grammar_terminated: frozenset[str] = frozenset()
    """Structured output: the requests whose grammar this step's token completed, taken right
    after the step's accepts."""


class PendingOutput:
    """A launched step's sampled tokens on their way to the host (async scheduling).

    `sampled` is the step's token tensor on the device, one row per sampling request in schedule
    order (what the next step's placeholders gather from). `resolve()` waits for the step's
    event (CUDA; None on a CPU, where the step already ran) and then builds the
    ModelRunnerOutput from the host copies, once."""

    __slots__ = ("sampled", "_event", "_finish", "_result")

    def __init__(self, finish: Callable[[], ModelRunnerOutput], event=None, sampled=None) -> None:
        self.sampled = sampled
        self._event, self._finish, self._result = event, finish, None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> "PendingOutput":
        pending = cls(None)
        pending._result = output
        return pending

    def wait(self) -> None:
        """Block until the step's tokens are in host memory: the one GPU wait of an async step."""
        if self._event is not None:
            self._event.synchronize()

    def resolve(self) -> ModelRunnerOutput:
        if self._result is None:
            self.wait()
            self._result, self._finish = self._finish(), None
        return self._result


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank in the step's distribution (1 = most
    likely) and its text (filled by the engine, which holds the tokenizer)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: {token id: Logprob} for the sampled token and the top-k."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token: None for the first (nothing predicts it), then {token id: Logprob}."""


class _FieldsValue:
    """Equality and repr over a slotted class's `_FIELDS` (outputs compare by value in tests)."""

    __slots__ = ()
    _FIELDS: tuple[str, ...] = ()

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self._FIELDS)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"{type(self).__name__}({fields})"


class CompletionOutput(_FieldsValue):
    """One completion of a request (vLLM's CompletionOutput; `n` completions share a prompt).

    The engine makes one per completion per step, so it does not copy the tokens each time
    (O(length) per step): it passes the request's own list, which only ever grows, with its
    length at this step (`num_token_ids`), and `token_ids` copies that prefix when first read.
    Given a plain list (no `num_token_ids`), `token_ids` is that list."""

    __slots__ = ("index", "text", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
                 "_token_ids", "_num_token_ids")

    def __init__(self, index: int, text: str, token_ids: list[int], cumulative_logprob: float | None = None,
                 logprobs: SampleLogprobs | None = None, finish_reason: str | None = None,
                 stop_reason: str | int | None = None, num_token_ids: int | None = None) -> None:
        self.index, self.text = index, text
        self._token_ids, self._num_token_ids = token_ids, num_token_ids
        self.cumulative_logprob = cumulative_logprob
        """Sum of the sampled tokens' logprobs; None unless the request asked for logprobs."""
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        """"stop" | "length" | "abort" once finished, else None."""
        self.stop_reason = stop_reason
        """The stop string or stop token id that ended it; None for EOS, lengths and aborts."""

    @property
    def token_ids(self) -> list[int]:
        if self._num_token_ids is not None:  # a prefix of a growing list: take it now
            self._token_ids, self._num_token_ids = self._token_ids[:self._num_token_ids], None
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids, self._num_token_ids = value, None

    def finished(self) -> bool:
        return self.finish_reason is not None

    _FIELDS = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason")


class RequestOutput(_FieldsValue):
    """One request's state after a step (vLLM's RequestOutput): the prompt, and one
    CompletionOutput per completion in `outputs`."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
                 "error")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 prompt_logprobs: PromptLogprobs | None, outputs: list[CompletionOutput], finished: bool,
                 metrics: RequestMetrics | None = None, error: str | None = None) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.error = error
        """Why the request failed or was rejected (finish_reason "abort"); the engine goes on serving others."""

    _FIELDS = ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics",
               "error")

