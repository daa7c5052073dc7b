"""`graphrunner serve MODEL`: build and warm up the engine, then serve the OpenAI API with uvicorn.

The ready line (`graphrunner: serving MODEL at http://HOST:PORT`) is printed to stdout once the
socket listens, with the real port when --port 0 asked for an ephemeral one."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time

from configs import EngineConfig, ServerConfig
from runner.engine_args import add_engine_args, engine_kwargs
from runner.collector import quiet_garbage_collector
from runner.engine_core import warm_up

logger = logging.getLogger("runner.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="default",
                        help="HF checkpoint folder, or 'default' (the embedded SmolLM2)")
    defaults = ServerConfig()
    parser.add_argument("--host", default=defaults.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=defaults.port, help="0: an ephemeral port")
    parser.add_argument("--served-model-name", help="the model name clients use (default: MODEL)")
    parser.add_argument("--max-waiting-requests", type=int,
                        help="answer 503 to a request that finds this many waiting (default: no bound)")
    parser.add_argument("--uvicorn-log-level", default=defaults.uvicorn_log_level,
                        help="log level of the HTTP server (uvicorn)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=defaults.engine_process,
                        help=ServerConfig.model_fields["engine_process"].description)
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default=defaults.loop,
                        help=ServerConfig.model_fields["loop"].description)
    parser.add_argument("--http", choices=["auto", "h11", "httptools"], default=defaults.http,
                        help=ServerConfig.model_fields["http"].description)
    add_engine_args(parser)


def event_loop_runner(loop: str):
    """What runs the server's coroutine for `ServerConfig.loop`: `uvloop.run` or `asyncio.run`.
    "uvloop" without uvloop installed is an error that says so; "auto" falls back quietly."""
    if loop == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise RuntimeError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return asyncio.run
    return uvloop.run


def import_streaming_backend() -> None:
    """Starlette runs every streamed response in an anyio task group, and anyio imports its asyncio
    backend on first use: without this, inside the first streamed responses, while they wait
    (py-spy of the API process under `graphrunner bench serve` put a tenth of its samples in that
    import, on a host whose packages carry no bytecode). A throwaway anyio run imports it at
    start-up, before the heap is frozen (runner/collector.quiet_garbage_collector)."""
    import anyio
    anyio.run(anyio.sleep, 0)


def engine_in_own_process(config: ServerConfig, engine_config: EngineConfig) -> bool:
    """`ServerConfig.engine_process`, or where it is None, whether the engine runs on a GPU."""
    if config.engine_process is not None:
        return config.engine_process
    from runner.platform import resolve_device
    return resolve_device(engine_config.device).type == "cuda"


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """The server's and the engine's configs from `graphrunner serve`'s flags (a bad value raises
    pydantic's ValidationError, which the CLI reports as a usage error naming the flag)."""
    config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                          max_waiting_requests=args.max_waiting_requests, uvicorn_log_level=args.uvicorn_log_level,
                          engine_process=args.engine_process, loop=args.loop, http=args.http)
    return config, EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))


def serve(args: argparse.Namespace, configs: tuple[ServerConfig, EngineConfig]) -> int:
    """Start the engine for `configs` (`configs_from_args(args)`), warm it up and serve until stopped."""
    import uvicorn

    from runner.async_llm import AsyncLLM
    from runner.engine import LLMEngine
    from runner.engine_process import engine_info
    from runner.server.app import build_app

    config, engine_config = configs
    run_event_loop = event_loop_runner(config.loop)  # a missing uvloop fails before the engine starts
    logger.setLevel(logging.INFO)  # the start-up and ready lines show without -v
    started = time.perf_counter()
    engine_process = engine_in_own_process(config, engine_config)
    if engine_process:
        async_llm = AsyncLLM.from_config(engine_config, engine_process=True)  # builds and warms up there
        info = async_llm.info
    else:
        engine = LLMEngine(engine_config)
        info = engine_info(engine)
    logger.info("engine ready in %.1f s (%s): %s on %s, KV cache %d blocks, CUDA graphs %s",
                time.perf_counter() - started,
                f"engine process pid {async_llm.engine_pid}" if engine_process else "engine thread",
                info["architecture"], info["device"], info["num_blocks"],
                "captured" if info["cuda_graph_ready"] else f"off (mode {info['cudagraph_mode']})")
    if not engine_process:
        warm_up(engine)
        async_llm = AsyncLLM(engine)
    model_name = config.served_model_name or args.model
    app = build_app(async_llm, model_name, config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.uvicorn_log_level, timeout_graceful_shutdown=5,
                                           http=config.http))

    async def run() -> None:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"graphrunner: serving {model_name} at http://{config.host}:{port}", flush=True)
        await serving

    import_streaming_backend()
    quiet_garbage_collector()
    try:
        run_event_loop(run())
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphrunner serve", description=__doc__)
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
