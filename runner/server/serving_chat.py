"""POST /v1/chat/completions: the conversation through the tokenizer's chat template (system,
user and assistant turns), whole or streamed as server-sent events."""

from __future__ import annotations

import json
from typing import AsyncIterator

from configs.sampling_params import truncate_prompt
from runner.server.protocol import APIError, ChatCompletionRequest, ChatMessage
from runner.server.serving import Choice, ChoiceTextChunks, OpenAIServing, now, random_id, sse, top_entries, usage
from runner.server.serving_completion import error_body


class ServingChat(OpenAIServing):

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> str:
        """The prompt text, as `LLM.chat` makes it (so greedy outputs match the offline API)."""
        self.need_tokenizer("messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as error:  # noqa: BLE001 - a template's own error (jinja2, a bad role order)
            raise APIError(f"the chat template failed on these messages: {error}", param="messages") from None

    def _prepare(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        if request.tools:
            raise APIError("tools are not supported", param="tools")
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        text = self.render(request.messages, request.add_generation_prompt, request.continue_final_message,
                           request.chat_template_kwargs)
        token_ids = truncate_prompt(self.encode(text, "messages"), request.truncate_prompt_tokens, self.max_model_len)
        limit_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.check_length(token_ids, request.max_completion_tokens or request.max_tokens, "messages",
                                       limit_param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = request.sampling_params(max_tokens, logprobs, request.stream)
        self.check_params(params, request.structured_param())
        self.check_capacity()
        return token_ids, params

    async def create(self, request: ChatCompletionRequest):
        """The response body (dict), or an async iterator of SSE lines when streaming."""
        token_ids, params = self._prepare(request)
        request_id = random_id("chatcmpl")
        if request.stream:
            return self._stream(request, request_id, token_ids, params)
        result = await self.collect(token_ids, params, request_id)
        prompt_logprobs = result.pop(None, None)
        choices = [self._choice(request, index, choice) for index, choice in sorted(result.items())]
        body = {"id": request_id, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": choices,
                "usage": usage(len(token_ids), sum(len(c.token_ids) for c in result.values()))}
        if request.return_token_ids:
            body["prompt_token_ids"] = token_ids
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        return body

    def _choice(self, request: ChatCompletionRequest, index: int, choice: Choice) -> dict:
        body = {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self._logprobs(choice.logprobs, request.top_logprobs or 0) if request.logprobs else None,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        if request.return_token_ids:
            body["token_ids"] = choice.token_ids
        return body

    @staticmethod
    def _logprobs(entries: list[dict], k: int) -> dict:
        """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        content = []
        for entry in entries:
            sampled_id, sampled = next(iter(entry.items()))
            content.append({**_token(sampled_id, sampled),
                            "top_logprobs": [_token(t, lp) for t, lp in top_entries(entry, k)]})
        return {"content": content}

    async def _stream(self, request: ChatCompletionRequest, request_id: str, token_ids: list[int],
                      params) -> AsyncIterator[str]:
        created = now()
        started: set[int] = set()
        completion_tokens = 0

        def chunk_body(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason}]}

        def chunk(*args) -> str:
            return sse(json.dumps(chunk_body(*args)))

        plain = not request.logprobs
        text_chunks = ChoiceTextChunks(lambda i, text, ids: chunk_body(
            i, {"content": text, "token_ids": ids} if request.return_token_ids else {"content": text}))

        try:
            async for out in self.stream(token_ids, params, request_id):
                for delta in out.outputs:
                    completion_tokens += len(delta.token_ids)
                    if delta.index not in started:
                        started.add(delta.index)
                        yield chunk(delta.index, {"role": "assistant", "content": ""})
                    if not delta.text and not delta.token_ids and delta.finish_reason is None:
                        continue
                    if plain and delta.finish_reason is None:
                        yield text_chunks.line(delta.index, delta.text, delta.token_ids)
                        continue
                    logprobs = self._logprobs(delta.logprobs or [], request.top_logprobs or 0) \
                        if request.logprobs else None
                    body = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                    if request.return_token_ids:
                        body["token_ids"] = list(delta.token_ids)
                    yield chunk(delta.index, body, logprobs, delta.finish_reason, delta.stop_reason)
        except APIError as error:
            yield sse(json.dumps(error_body(error)))
        if request.stream_options is not None and request.stream_options.include_usage:
            yield sse(json.dumps({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                  "model": self.model_name, "choices": [],
                                  "usage": usage(len(token_ids), completion_tokens)}))
        yield sse("[DONE]")


def _token(token_id: int, logprob) -> dict:
    text = logprob.decoded_token if logprob.decoded_token is not None else str(token_id)
    return {"token": text, "logprob": max(logprob.logprob, -9999.0), "bytes": list(text.encode("utf-8"))}
