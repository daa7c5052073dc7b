"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from configs.structured_outputs import StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names and values)."""
    CUMULATIVE = 0
    """Everything generated so far."""
    DELTA = 1
    """Only the text and token ids new since the request's previous output."""
    FINAL_ONLY = 2
    """One output, when the request finishes."""


class SamplingParams(BaseModel):
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1 disables
    top-p; min_p 0 disables min-p. `logprobs=k` returns the sampled token's logprob
    and the top-k logprobs of each step.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=100)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice list or grammar (runner/structured_output)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value):
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_le_max(cls, value: int, info) -> int:
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"min_tokens ({value}) must be <= max_tokens ({max_tokens})")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
