"""POST /v1/completions: OpenAI's text completions (one or several prompts, text or token ids),
whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from configs.sampling_params import truncate_prompt
from runner.server.protocol import APIError, CompletionRequest
from runner.server.serving import (Choice, ChoiceTextChunks, OpenAIServing, accumulate, now, random_id, sse,
                                   top_entries, usage)


class ServingCompletion(OpenAIServing):

    def _prompts(self, request: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """(token ids, text) per prompt: a string, a list of strings, token ids, or lists of them."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return [(self.encode(prompt, "prompt"), prompt)]
        if not prompt:
            raise APIError("the prompt is empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            prompts = [(list(prompt), None)]
        else:
            prompts = [(self.encode(p, "prompt"), p) if isinstance(p, str) else (list(p), None) for p in prompt]
        vocab = self.engine.vocab_size
        for token_ids, text in prompts:
            bad = [t for t in token_ids if not 0 <= t < vocab] if text is None else []
            if bad:
                raise APIError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})", param="prompt")
        return prompts

    def _prepare(self, request: CompletionRequest):
        self.check_model(request.model)
        if request.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError("best_of other than n is not supported", param="best_of")
        if request.echo and request.logprobs is not None:
            raise APIError("echo with logprobs needs prompt logprobs, which this server does not return",
                           param="echo")
        prompts = self._prompts(request)
        runs = []
        for token_ids, text in prompts:
            kept = truncate_prompt(token_ids, request.truncate_prompt_tokens, self.max_model_len)
            if text is not None and len(kept) < len(token_ids):
                text = self.tokenizer.decode(kept)   # echo returns the prompt that was served
            token_ids = kept
            max_tokens = self.check_length(token_ids, request.max_tokens, "prompt")
            params = request.sampling_params(max_tokens, request.logprobs, request.stream)
            self.check_params(params, request.structured_param())
            runs.append((token_ids, text, params))
        self.check_capacity()
        return runs

    async def create(self, request: CompletionRequest):
        """The response body (dict), or an async iterator of SSE lines when streaming."""
        runs = self._prepare(request)
        request_id = random_id("cmpl")
        if request.stream:
            return self._stream(request, request_id, runs)
        results = await asyncio.gather(*(self.collect(ids, params, f"{request_id}-{i}")
                                         for i, (ids, _, params) in enumerate(runs)))
        choices, completion_tokens = [], 0
        for prompt_index, ((token_ids, text, params), result) in enumerate(zip(runs, results)):
            prompt_logprobs = result.pop(None, None)
            for index, choice in sorted(result.items()):
                completion_tokens += len(choice.token_ids)
                choices.append(self._choice(request, prompt_index * request.n + index, choice, token_ids,
                                            text if request.echo else None))
                if prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = prompt_logprobs
        prompt_tokens = sum(len(ids) for ids, _, _ in runs)
        return {"id": request_id, "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def _choice(self, request: CompletionRequest, index: int, choice: Choice, prompt_ids: list[int],
                echo_text: str | None) -> dict:
        body = {"index": index, "text": (echo_text or "") + choice.text,
                "logprobs": self._logprobs(choice.logprobs, request.logprobs, 0) if request.logprobs is not None
                else None,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        if request.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
            body["token_ids"] = choice.token_ids
        return body

    @staticmethod
    def _logprobs(entries: list[dict], k: int, text_offset: int) -> dict:
        """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            sampled_id, sampled = next(iter(entry.items()))
            token = sampled.decoded_token if sampled.decoded_token is not None else str(sampled_id)
            tokens.append(token)
            token_logprobs.append(sampled.logprob)
            top = {(lp.decoded_token if lp.decoded_token is not None else str(t)): lp.logprob
                   for t, lp in top_entries(entry, k)}
            top.setdefault(token, sampled.logprob)
            tops.append(top)
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    async def _stream(self, request: CompletionRequest, request_id: str, runs) -> AsyncIterator[str]:
        created = now()
        merged: asyncio.Queue = asyncio.Queue()
        prompt_tokens = sum(len(ids) for ids, _, _ in runs)
        completion_tokens = 0
        offsets: dict[int, int] = {}
        plain = request.logprobs is None
        text_chunks = ChoiceTextChunks(lambda i, text, ids: self._chunk(
            request_id, created, i, text, None, None, None, ids if request.return_token_ids else None))

        async def pump(prompt_index: int, token_ids, params) -> None:
            try:
                async for out in self.stream(token_ids, params, f"{request_id}-{prompt_index}"):
                    await merged.put((prompt_index, out))
            except BaseException as error:  # noqa: BLE001 - handed to the response, which reports it
                await merged.put((prompt_index, error))
                if isinstance(error, asyncio.CancelledError):
                    raise
            finally:
                await merged.put((prompt_index, None))

        async def direct(token_ids, params) -> AsyncIterator:
            """One prompt (the usual case): its outputs as they come, no task or queue between."""
            try:
                async for out in self.stream(token_ids, params, f"{request_id}-0"):
                    yield 0, out
            except Exception as error:  # noqa: BLE001 - handed to the response, which reports it
                yield 0, error

        async def merged_items() -> AsyncIterator:
            remaining = len(tasks)
            while remaining:
                prompt_index, item = await merged.get()
                if item is None:
                    remaining -= 1
                    continue
                yield prompt_index, item

        tasks = [] if len(runs) == 1 else \
            [asyncio.create_task(pump(i, ids, params)) for i, (ids, _, params) in enumerate(runs)]
        items = direct(runs[0][0], runs[0][2]) if len(runs) == 1 else merged_items()
        try:
            if request.echo:
                for i, (_, text, _) in enumerate(runs):
                    for c in range(request.n):
                        yield sse(json.dumps(self._chunk(request_id, created, i * request.n + c, text or "",
                                                         None, None, None)))
            async for prompt_index, item in items:
                if isinstance(item, BaseException):
                    yield sse(json.dumps(error_body(item)))
                    continue
                for delta in item.outputs:
                    index = prompt_index * request.n + delta.index
                    completion_tokens += len(delta.token_ids)
                    if not delta.text and not delta.token_ids and delta.finish_reason is None:
                        continue
                    if plain and delta.finish_reason is None:
                        yield text_chunks.line(index, delta.text, delta.token_ids)
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._logprobs(delta.logprobs or [], request.logprobs, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
                    chunk = self._chunk(request_id, created, index, delta.text, logprobs, delta.finish_reason,
                                        delta.stop_reason, list(delta.token_ids) if request.return_token_ids else None)
                    yield sse(json.dumps(chunk))
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(json.dumps({"id": request_id, "object": "text_completion", "created": created,
                                      "model": self.model_name, "choices": [],
                                      "usage": usage(prompt_tokens, completion_tokens)}))
            yield sse("[DONE]")
        finally:
            await items.aclose()
            for task in tasks:
                task.cancel()

    def _chunk(self, request_id: str, created: int, index: int, text: str, logprobs, finish_reason,
               stop_reason, token_ids: list[int] | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if token_ids is not None:   # return_token_ids
            choice["token_ids"] = token_ids
        return {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice]}


def error_body(error: BaseException) -> dict:
    if isinstance(error, APIError):
        return error.body()
    return APIError(f"{type(error).__name__}: {error}", status=500, type="internal_server_error").body()
