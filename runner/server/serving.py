"""What completions and chat share: the model check, prompt tokenization and length check, the
waiting-queue bound, and running one prompt's request to its per-choice results."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from configs import SamplingParams, ServerConfig
from runner.async_llm import AsyncLLM, EngineLoopError
from runner.engine import InvalidRequestError
from runner.outputs import CompletionOutput, RequestOutput
from runner.server.protocol import APIError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One completion's accumulated result (non-streaming responses)."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, config: ServerConfig) -> None:
        self.engine = engine
        self.model_name = model_name
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    def check_model(self, model: str | None) -> None:
        """vLLM's rule: a named model must be the served one (404 otherwise); no name means it."""
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model",
                           type="NotFoundError", code="model_not_found")

    def check_capacity(self) -> None:
        bound = self.config.max_waiting_requests
        if bound is not None and self.engine.num_waiting >= bound:
            raise APIError(f"the server has {self.engine.num_waiting} requests waiting (bound "
                           f"--max-waiting-requests {bound}); retry later", status=503,
                           type="server_overloaded", code="server_overloaded")
        if not self.engine.is_running and self.engine.dead_error is not None:
            raise APIError(f"the engine has stopped: {self.engine.dead_error}", status=503, type="engine_dead")

    def need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids", param=param)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.need_tokenizer(param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_params(self, params: SamplingParams, structured_param: str = "structured_outputs") -> None:
        """400s naming the field for what the engine would refuse when the request reaches it: token
        ids outside the vocabulary (logit_bias, allowed_token_ids) and a constraint xgrammar cannot
        parse (`structured_param`: the request field that set it). Checked here, a streamed request
        is refused before its stream starts, like any other bad request (from the engine the
        refusal could only be an error event inside a 200 stream). Parsing a constraint takes well
        under a millisecond (runner/structured_output/grammar.py); compiling it stays in the engine."""
        refused = params.vocabulary_error(self.engine.vocab_size)
        if refused is not None:
            raise APIError(refused[1], param=refused[0])
        if params.structured_outputs is not None:
            try:
                from runner.structured_output.grammar import InvalidGrammarError, parse_grammar
            except ImportError:   # no xgrammar here: the engine refuses the request itself
                return
            try:
                parse_grammar(params.structured_outputs)
            except InvalidGrammarError as error:
                raise APIError(str(error), param=structured_param) from None

    def check_length(self, token_ids: list[int], max_tokens: int | None, param: str,
                     max_tokens_param: str = "max_tokens") -> int:
        """The max_tokens to run with: a prompt that leaves no room, or a max_tokens over what
        is left, is a 400 (vLLM's message); no max_tokens means everything that is left."""
        if not token_ids:
            raise APIError("the prompt is empty", param=param)
        room = self.max_model_len - len(token_ids)
        if room <= 0:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                           f"prompt has {len(token_ids)} tokens, which leaves no room for a completion.",
                           param=param)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, "
                           f"{max_tokens} in the completion). Please reduce the prompt or {max_tokens_param}.",
                           param=max_tokens_param)
        return max_tokens

    async def stream(self, token_ids: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's DELTA outputs of one request; engine refusals become 400, failures 500."""
        try:
            async for out in self.engine.generate(token_ids, params, request_id):
                yield out
        except InvalidRequestError as error:
            raise APIError(str(error)) from None
        except EngineLoopError as error:
            raise APIError(str(error), status=500, type="internal_server_error") from None

    async def collect(self, token_ids: list[int], params: SamplingParams, request_id: str) -> dict:
        """Run one request to the end; its choices by completion index (and, when it asked for
        them, its prompt logprobs in vLLM's JSON shape under the key None)."""
        choices: dict = {}
        async for out in self.stream(token_ids, params, request_id):
            if out.prompt_logprobs is not None and None not in choices:
                choices[None] = prompt_logprobs_json(out.prompt_logprobs)
            for delta in out.outputs:
                accumulate(choices.setdefault(delta.index, Choice()), delta)
            if out.finished and out.error:
                raise APIError(f"request failed: {out.error}", status=500, type="internal_server_error")
        return choices


def accumulate(choice: Choice, delta: CompletionOutput) -> None:
    choice.text += delta.text
    choice.token_ids += delta.token_ids
    if delta.logprobs:
        choice.logprobs += delta.logprobs
    if delta.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())


def top_entries(entry: dict, k: int) -> list[tuple[int, object]]:
    """The top-k alternatives of one step's {token id: Logprob}, by rank (the sampled token comes
    first in the dict, and is among them only when its rank is <= k)."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:k]


def prompt_logprobs_json(prompt_logprobs) -> list:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()} for entry in prompt_logprobs]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class TextChunks:
    """The SSE lines of one stream's plain chunks (text, and token ids when the request asked for
    them; no logprobs; not the last), from a template: the chunk's JSON with everything else fixed,
    so a token costs encoding a string (and a short list) instead of the whole nested body
    (json.dumps took a tenth of the API process's time at 256 streams). Each line is exactly
    `sse(json.dumps(body(text, token_ids)))`."""

    _TEXT, _IDS = "\x00text\x00", "\x00ids\x00"

    def __init__(self, body: Callable[[str, object], dict]) -> None:
        head, found, rest = json.dumps(body(self._TEXT, self._IDS)).partition(json.dumps(self._TEXT))
        middle, ids_found, tail = rest.partition(json.dumps(self._IDS))
        if not found or json.dumps(self._IDS) in head:
            raise ValueError("the chunk body must hold its text as a JSON string, before its token ids")
        self.head, self.with_ids = "data: " + head, bool(ids_found)
        self.middle, self.tail = (middle, tail + "\n\n") if self.with_ids else ("", middle + "\n\n")

    def __call__(self, text: str, token_ids: list[int] | None = None) -> str:
        if self.with_ids:
            return self.head + json.dumps(text) + self.middle + json.dumps(token_ids) + self.tail
        return self.head + json.dumps(text) + self.tail


class ChoiceTextChunks:
    """The plain chunks of a streamed response with several choices: one `TextChunks` template per
    choice index, made from `body(index, text, token_ids)` when the choice first streams text."""

    def __init__(self, body: Callable[[int, str, object], dict]) -> None:
        self.body = body
        self.templates: dict[int, TextChunks] = {}

    def line(self, index: int, text: str, token_ids: list[int] | None) -> str:
        template = self.templates.get(index)
        if template is None:
            template = self.templates[index] = TextChunks(lambda t, ids: self.body(index, t, ids))
        return template(text, token_ids)
