"""The FastAPI application: OpenAI's routes, vLLM's extras (/health, /metrics, /tokenize,
/detokenize), OpenAI error bodies, and aborting a request whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from configs import ServerConfig
from runner.async_llm import AsyncLLM
from runner.server.metrics import ServerMetrics
from runner.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest)
from runner.server.serving_chat import ServingChat
from runner.server.serving_completion import ServingCompletion

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, model_name: str, config: ServerConfig) -> FastAPI:
    """The app serving `engine` as `model_name`. The engine core (thread or process) starts
    delivering with the app (lifespan) and stops with it."""
    metrics = ServerMetrics(engine, model_name)
    engine.stats_listener = metrics.observe
    completions = ServingCompletion(engine, model_name, config)
    chat = ServingChat(engine, model_name, config)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.shutdown()

    app = FastAPI(title="graphrunner", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":   # its loc is a character offset, not a field
            detail = (first.get("ctx") or {}).get("error", first.get("msg"))
            return JSONResponse(APIError(f"the request body is not valid JSON: {detail}").body(), status_code=400)
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg"))
        return JSONResponse(APIError(message, param=param).body(), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "graphrunner", "root": engine.model_path,
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await respond(request, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await respond(request, chat.create(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = chat.render(body.messages, body.add_generation_prompt)
            tokens = chat.encode(text, "messages")
        else:
            tokens = completions.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": completions.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        completions.check_model(body.model)
        completions.need_tokenizer("tokens")
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": completions.tokenizer.decode(body.tokens)}

    return app


async def respond(request: Request, pending):
    """Run a handler's coroutine until it answers or the client disconnects (which cancels it,
    and so aborts its engine requests); a stream is watched the same way while it is sent."""
    result = await until_disconnected(request, pending)
    if result is None:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(guarded(request, result), media_type="text/event-stream")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, awaitable):
    """The awaitable's result, or None if the client disconnected first (the awaitable is cancelled)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return None
    finally:
        watcher.cancel()


async def guarded(request: Request, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """`body`, closed (its requests abort) when the response ends for any reason. A client that
    disconnects is noticed by Starlette's StreamingResponse, which listens for the disconnect
    while it streams and cancels the stream (ASGI spec 2.3, as uvicorn serves it): the
    cancellation ends `body` at its await and its requests abort at once. Nothing here runs per
    chunk beyond handing it on."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        with contextlib.suppress(BaseException):
            await body.aclose()
