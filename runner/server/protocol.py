"""Request bodies of the OpenAI-compatible API (OpenAI's and vLLM's field names), their mapping
to SamplingParams, and the OpenAI error body.

Sampling fields map to SamplingParams by name through a dict, so a field that this build's
SamplingParams lacks (a feature not built yet) is refused by SamplingParams' own validation
with a 400 that names the field, instead of being dropped silently. Fields left at their
neutral value (n=1, penalties 0 / 1) are not passed, so they never trip that check.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from configs import RequestOutputKind, SamplingParams
from configs.sampling_params import check_truncate_prompt_tokens


class APIError(Exception):
    """An error the server answers with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's and vLLM's servers do (clients send vendor extras).
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Request):
    """The fields completions and chat share."""
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's field: token id (a JSON object's keys are strings) -> a bias added to its logit."""
    allowed_token_ids: list[int] | None = None
    """vLLM's extra field: only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """vLLM's extra field: words the output may not contain."""
    truncate_prompt_tokens: int | None = None
    """vLLM's extra field: keep the prompt's last k tokens (-1: as many as max_model_len allows); the
    server truncates before it checks the length (`configs.sampling_params.truncate_prompt`)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's extra field: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """vLLM's extra field: the top-k logprobs of every prompt token, returned as `prompt_logprobs`."""
    return_token_ids: bool = False
    """vLLM's extra field: each choice carries `token_ids`, the response `prompt_token_ids`."""
    user: str | None = None
    use_beam_search: bool = False
    logits_processors: list[Any] | None = None
    prompt_embeds: Any = None
    """vLLM's extra fields this server does not build: asked for, they are 400s naming the field
    (ignored like other unknown fields, they would silently change what the request means)."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_k(cls, value: int | None) -> int | None:
        return check_truncate_prompt_tokens(value)

    def _logit_bias(self) -> dict[int, float] | None:
        """The bias by token id; a key that is not an integer is a 400 naming logit_bias."""
        if not self.logit_bias:
            return None
        bias, bad = {}, []
        for token, value in self.logit_bias.items():
            try:
                bias[int(token)] = value
            except ValueError:
                bad.append(token)
        if bad:
            raise APIError(f"logit_bias keys must be token ids (integers), got {bad[:5]}", param="logit_bias")
        return bias

    def _structured_outputs(self) -> dict[str, Any] | None:
        if self.structured_outputs:
            return dict(self.structured_outputs)
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                return {"json_object": True}
            schema = self.response_format.json_schema
            if schema is None or schema.schema_ is None:
                raise APIError("response_format of type json_schema needs json_schema.schema",
                               param="response_format")
            return {"json": schema.schema_}
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        guided = {k: v for k, v in guided.items() if v is not None}
        return guided or None

    def sampling_params(self, max_tokens: int, logprobs: int | None, stream: bool) -> SamplingParams:
        """SamplingParams for this request; an invalid value raises APIError naming the field."""
        for name, what in (("use_beam_search", "beam search"), ("logits_processors", "custom logits processors"),
                           ("prompt_embeds", "prompt embeddings")):
            if getattr(self, name) not in (None, False, []):
                raise APIError(f"{what} ({name}) is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options can only be given with stream=true", param="stream_options")
        values: dict[str, Any] = {"max_tokens": max_tokens, "min_tokens": self.min_tokens,
                                  "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
                                  "output_kind": RequestOutputKind.DELTA}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if logprobs is not None:
            values["logprobs"] = logprobs
        # Features SamplingParams may not have: passed only when the request asks for them.
        optional = {"n": (self.n, 1), "presence_penalty": (self.presence_penalty, 0.0),
                    "frequency_penalty": (self.frequency_penalty, 0.0),
                    "repetition_penalty": (self.repetition_penalty, 1.0),
                    "include_stop_str_in_output": (self.include_stop_str_in_output, False),
                    "prompt_logprobs": (self.prompt_logprobs, None), "logit_bias": (self._logit_bias(), None),
                    "allowed_token_ids": (self.allowed_token_ids, None), "bad_words": (self.bad_words, None)}
        for name, (value, neutral) in optional.items():
            if value is not None and value != neutral:
                values[name] = value
        structured = self._structured_outputs()
        if structured is not None:
            values["structured_outputs"] = structured
        return build_sampling_params(values, field_names=self._field_names())

    def structured_param(self) -> str:
        """The request field that set the output constraint (for error messages)."""
        return "response_format" if self.response_format is not None else "structured_outputs"

    def _field_names(self) -> dict[str, str]:
        """SamplingParams field -> the request field a client set (for error messages)."""
        return {"structured_outputs": self.structured_param()}


def build_sampling_params(values: dict[str, Any], field_names: dict[str, str] | None = None) -> SamplingParams:
    try:
        return SamplingParams(**values)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else None
        param = (field_names or {}).get(field, field)
        if first.get("type") == "extra_forbidden":
            message = f"{param} is not supported by this server's engine (SamplingParams has no field {field!r})"
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        raise APIError(message, param=param) from None
    except ValueError as error:
        raise APIError(str(error)) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(f"message content of type {part.get('type')!r} is not supported; only text",
                               param="messages")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
