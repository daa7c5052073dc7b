"""One generation request: its tokens, its progress through the KV cache, and why it ended.

The scheduler owns the state transitions (WAITING -> RUNNING -> [PREEMPTED -> RUNNING ...]
-> FINISHED); the KV-cache manager owns `block_ids`. Everything else reads.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from configs import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
"""vLLM's finish reasons: a stop token/string or EOS, a length limit, or an abort."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Evicted from the KV cache to make room; waits to recompute prompt + outputs so far."""
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """A request's mutable state. `eq=False`: requests compare (and are removed) by identity."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    """Only ever appended to: RequestOutputs keep a prefix of it instead of a copy."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose keys/values are in the KV cache (prefix-cache hits included)."""
    block_ids: list[int] = field(default_factory=list)
    """The block table; written only by the KV-cache manager."""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request; None for EOS and lengths."""
    first_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when the request was last scheduled."""
    block_table_id: int = -1
    """Names the current `block_ids` list: the KV-cache manager gives each table it starts (first
    admission, and again after a preemption freed the old one) a new number. A runner that keeps
    block-table rows between steps can then tell a grown table from a new one."""
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end the request once more than `min_tokens` are out: the params' stop ids, and
    EOS unless ignored. Set by the scheduler on `add_request` (EOS is the model's)."""
    max_output_tokens: int = 0
    """The length limit as an output count: max_tokens, or what max_model_len leaves after the
    prompt if that is less. Set by the scheduler on `add_request`."""
    bad_words_token_ids: list[list[int]] | None = None
    """`sampling_params.bad_words` tokenized (runner/sampling/bad_words.py), set by the engine on
    `add_request`: the sampler bans them and holds no tokenizer."""
    sampler_needs_prompt: bool = False
    """Whether the sampler reads the prompt's token ids (repetition_penalty, prompt_logprobs)."""
    logits_processors: bool = False
    """Whether the params turn on a penalty or a logit control (min_tokens aside, which the sampler
    checks per step): computed once, the sampler asks every step."""
    num_inflight_tokens: int = 0
    """Tokens scheduled in steps whose results are not applied yet (async scheduling): the
    scheduler counts `num_computed_tokens + num_inflight_tokens` as computed when it schedules
    the next step. 0 outside of `schedule()` ... `update()` in the synchronous engine."""
    num_output_placeholders: int = 0
    """Output tokens sampled by scheduled steps but not yet appended (at most one while the
    scheduler plans a step: that of the step in flight)."""
    placeholder_row: int = -1
    """Row of the latest placeholder in its step's sampled-token tensor (the order of the step's
    sampling requests): a step that feeds the placeholder reads its token there, on the device."""
    grammar: object | None = None
    """Structured output: the request's GrammarState (runner/structured_output), None without a
    constraint. The scheduler admits the request only once `grammar.ready` (its compile is done)."""

    prompt_source: "Request | None" = None
    """Another completion of the same prompt (`n` > 1) whose full prompt blocks this request
    shares once they are computed, instead of computing its own; None: computes its prompt."""

    def __post_init__(self) -> None:
        # A private copy: the caller's list must not grow or shrink under the scheduler.
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        params = self.sampling_params
        self.sampler_needs_prompt = params.repetition_penalty != 1.0 or params.prompt_logprobs is not None
        self.logits_processors = params.needs_logits_processors

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without copying the whole sequence (decode is the hot path)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
