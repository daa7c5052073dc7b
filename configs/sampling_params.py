"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, field_validator


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

    n: int = Field(1, ge=1, le=1024)
    """Completions of the prompt (prefilled once, its KV blocks shared); `outputs[i]`, index i."""
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
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request at the end of its text."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (left truncation); -1: as many as max_model_len allows."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

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

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_k(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {value}")
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
