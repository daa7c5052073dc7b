"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from configs.structured_outputs import StructuredOutputsParams


SEED_MAX = 2**64 - 1
"""The largest seed: torch's generators take an unsigned 64-bit seed."""


def check_truncate_prompt_tokens(value: int | None) -> int | None:
    """`truncate_prompt_tokens` is None, -1 or a count >= 1 (ValueError otherwise)."""
    if value is not None and value < 1 and value != -1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {value}")
    return value


def truncate_prompt(token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt `truncate_prompt_tokens` = k leaves (vLLM's meaning): its last k tokens; -1 keeps as
    many as leave room for one generated token within max_model_len; None keeps it whole."""
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len - 1
    return token_ids[-k:]


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
    and the top-k logprobs of each step; `prompt_logprobs=k` those of each prompt token.

    Logit controls, applied before temperature and the filters (vLLM's meanings):
    `presence_penalty` / `frequency_penalty` subtract `frequency_penalty * count + presence_penalty
    * (count > 0)` from each token's logit, counting the OUTPUT tokens so far; `repetition_penalty`
    divides the positive and multiplies the negative logits of every token seen in the prompt or
    the output (HF's and vLLM's rule); `logit_bias` adds a bias per token id; `allowed_token_ids`
    masks every other token; `bad_words` are banned (a one-token word always; a longer one's last
    token when the output ends with the rest of it). EOS and `stop_token_ids` cannot be sampled
    before `min_tokens` output tokens.
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
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=100)
    prompt_logprobs: int | None = Field(None, ge=0, le=100)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request at the end of its text."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (left truncation); -1: as many as max_model_len allows."""
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

    @field_validator("seed")
    @classmethod
    def _seed_in_generator_range(cls, value: int | None) -> int | None:
        # torch.Generator.manual_seed takes an unsigned 64-bit seed (CPU and CUDA alike).
        if value is not None and not 0 <= value <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1] = [0, {SEED_MAX}], got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        bad = [token for token in value if token < 0]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {bad[:5]}")
        # vLLM clamps biases to [-100, 100]: beyond that a bias only overflows half precision.
        return {token: max(-100.0, min(100.0, bias)) for token, bias in value.items()}

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_not_empty(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        bad = [token for token in value if token < 0]
        if bad:
            raise ValueError(f"allowed_token_ids must be token ids >= 0, got {bad[:5]}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _no_empty_bad_word(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not word.strip() for word in value):
            raise ValueError("bad_words must be non-empty strings")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_k(cls, value: int | None) -> int | None:
        return check_truncate_prompt_tokens(value)

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

    @property
    def needs_logits_processors(self) -> bool:
        """Whether any logit control or penalty is on (min_tokens aside: it applies per step)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words))

    def token_ids_outside(self, vocab_size: int) -> dict[str, list[int]]:
        """The token ids this request names (logit_bias keys, allowed_token_ids) that lie outside the
        vocabulary [0, vocab_size), by field; empty when all are inside (`vocabulary_error`)."""
        fields = {"logit_bias": list(self.logit_bias or ()), "allowed_token_ids": self.allowed_token_ids or []}
        outside = {name: [t for t in ids if not 0 <= t < vocab_size] for name, ids in fields.items()}
        return {name: ids for name, ids in outside.items() if ids}

    def vocabulary_error(self, vocab_size: int) -> tuple[str, str] | None:
        """(field, message) for the first field of `token_ids_outside`, or None when there is none:
        the one refusal the engine raises and the server's 400 names."""
        name, ids = next(iter(self.token_ids_outside(vocab_size).items()), (None, None))
        if name is None:
            return None
        return name, f"{name} has token id(s) {ids[:5]} outside the vocabulary [0, {vocab_size})"
