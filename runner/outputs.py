"""What the runner hands the engine, and what the engine hands the user."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests that sampled this step (the last pipeline rank's answer)."""
    sampled: dict[str, int]
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    """request id -> {token id: logprob} for the sampled token and the top-k, when asked."""


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's state after a step (cumulative: text and token_ids hold everything so far)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    """"stop" | "length" | "abort" once finished."""
    stop_reason: str | int | None = None
    """The stop string or token id that ended it, if any."""
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    """Why the request was rejected (finish_reason "abort"); the engine goes on serving others."""
