"""Settings of the OpenAI-compatible HTTP server (`graphrunner serve`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServerConfig(BaseModel):
    """Where the server listens and how much work it queues before refusing more."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    """0: an ephemeral port, printed in the ready line."""
    served_model_name: str | None = None
    """The model name clients send and /v1/models lists; None: the MODEL argument."""
    max_waiting_requests: int | None = Field(None, ge=0)
    """A request that finds this many or more waiting (not yet running) gets 503; None: no bound."""
    uvicorn_log_level: str = "warning"
    engine_process: bool | None = Field(None, description=(
        "run the engine core in its own process (pipes to the server) instead of a thread of the server "
        "process: the step loop then never shares the GIL with HTTP and SSE work. Default: its own process "
        "when the engine runs on a GPU (at 256 streams it serves 1.8x the thread's tokens/s, docs/PERFORMANCE.md), "
        "a thread on a CPU (the forward uses every core; a second process only competes for them)"))
    loop: Literal["auto", "asyncio", "uvloop"] = Field("auto", description=(
        "the server's event loop: uvloop (libuv) runs the per-chunk loop work (callbacks, socket writes) "
        "in C; auto: uvloop when it is installed, else asyncio's"))
    http: Literal["auto", "h11", "httptools"] = Field("auto", description=(
        "uvicorn's HTTP protocol: httptools (C parser and writer) or h11 (pure Python); auto: httptools "
        "when it is installed"))
