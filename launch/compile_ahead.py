"""Compile Triton kernels on worker threads, ahead of their first launch.

Why: on a fresh machine (empty Triton cache) a kernel variant compiles the first time it is
launched, and the launches come one after another: the capture phase's warm-up runs met about
nine variants one at a time, which made a cold capture several times a warm one. Most of a Triton
compile (LLVM, ptxas) runs without the GIL, so threads compile variants in parallel
(`graphrunner bench compile_threads`: 8 variants 5.05x faster on 8 threads on an H100's host; the
capture figures are in docs/PERFORMANCE.md, `graphrunner bench capture --cold`).

How: inside `compile_ahead(threads)` Triton compiles asynchronously on a thread pool (Triton's
AsyncCompileMode): a launch of a kernel not yet compiled queues its compile and then waits for it
(itself only). Inside `queuing_launches()` (within compile_ahead) a launch made through `launch()`
or `FastLaunch` does not run at all: it only queues its compile (`JITFunction.warmup`) and
returns None, so a forward run there queues every variant it would launch and computes garbage;
the queued compiles start when that block ends (`_HeldPool`).
The work after it in the compile_ahead block then finds its kernels compiled, or compiling.
Leaving compile_ahead waits for every queued compile (a compile error is raised there). Without
Triton's async compile mode (older Triton) compile_ahead does nothing and says so.
"""

from __future__ import annotations

import logging
import functools
import os
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from launch.specialisation import SPECIALISED, param_kinds, specialisation

logger = logging.getLogger(__name__)

_asynchronous = False
"""True inside `compile_ahead` (when it is on)."""
_active = False
"""True inside `queuing_launches`: launches queue compiles instead of running."""
_queued: set[tuple] = set()
"""Launch keys queued in this `queuing_launches` block: a repeat is skipped before Triton's
binder, which costs tens of microseconds a call (a start-up runs ~100 forwards of ~200 launches)."""


def compiling_ahead() -> bool:
    """Whether launches only queue compiles now (inside `queuing_launches`)."""
    return _active


def launch(fn: Any, grid: tuple, *args: Any, **options: Any) -> Any:
    """`fn[grid](*args, **options)`, or inside `compile_ahead` only its compilation, queued (None)."""
    if _active:
        key = launch_key(fn, args, options)
        if key not in _queued:
            _queued.add(key)
            fn.warmup(*args, grid=grid, **options)
        return None
    return fn[grid](*args, **options)


def launch_key(fn: Any, args: tuple, options: dict) -> tuple:
    """The variant a launch compiles: `fn` (by id: hashing a JITFunction takes a lock and its
    `cache_key` property; the kernels outlive the queuing block), its arguments' specialisation
    (specialisation.py; every parameter counted as specialised when `fn` does not list them) and
    its keyword arguments (constexprs, compile options) by value."""
    kinds = param_kinds(fn) or (SPECIALISED,) * len(args)
    return (id(fn), tuple(specialisation(args, kinds)), tuple(sorted(options.items())))


def compile_threads(configured: int | None) -> int:
    """Compiler threads: `configured` (CompilationConfig.compile_threads), else (None) one per CPU up to
    16. 0 turns compiling ahead off: the kernels then compile at their first launch, one at a time."""
    if configured is not None:
        return max(0, int(configured))
    return min(16, os.cpu_count() or 1)


def _async_compile_mode() -> Any:
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


class _HeldPool(Executor):
    """A thread pool that holds what is submitted while `holding` and starts it all on `release`.
    Why: while launches are being queued (Python on the main thread, ~100 forwards) the compile
    threads' own Python work (Triton's code generation holds the GIL) would slow the forwards
    about 2-3x; they start right after instead. Measured again against starting them at once (H100,
    empty caches): the queue pass took 4.1 s instead of 1.9 s, and the whole start-up 8.46 s
    instead of 7.76 s (Llama-3.2-1B shape; docs/PERFORMANCE.md, "GPU: LLM to ready")."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")
        self.holding, self.held = False, []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        call = functools.partial(_with_launcher, functools.partial(fn, *args, **kwargs))
        if not self.holding:
            return self.pool.submit(call)
        future: Future = Future()
        self.held.append((future, call))
        return future

    def release(self) -> None:
        self.holding, held, self.held = False, self.held, []
        for future, call in held:
            self.pool.submit(_run_into, future, call)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.release()
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _launcher_builder() -> Any:
    """Triton's launcher class of the active driver (`CompiledKernel._init_handles` makes one per kernel)."""
    from triton.runtime import driver
    return driver.active.launcher_cls


def _with_launcher(compile_call) -> Any:
    """`compile_call()` (a Triton compile: a CompiledKernel), then that kernel's host launcher built on
    this thread too. Why: Triton 3.6 generates a C launcher per kernel signature and compiles it with
    the host's C compiler at the kernel's first launch, 0.25-0.9 s each; a start-up with empty caches
    met about 20, one after another on the main thread, 6.8 s of a 17 s start-up on an H100's host
    (docs/PERFORMANCE.md, "GPU LLM(...) to ready"). Built here, on the compile threads, they compile in
    parallel and the first launch finds them in Triton's cache (a newer Triton without per-kernel
    launchers makes this cheap). Best effort: a launcher that fails to build here is built, and its
    error raised, at the first launch as before."""
    started = time.perf_counter()
    kernel = compile_call()
    logger.debug("compiled %s in %.2f s", getattr(kernel, "name", kernel), time.perf_counter() - started)
    src, metadata = getattr(kernel, "src", None), getattr(kernel, "metadata", None)
    if src is not None and metadata is not None:
        try:
            _launcher_builder()(src, metadata)
        except Exception as error:  # noqa: BLE001 - the first launch builds it again and reports
            logger.debug("building the launcher of %s ahead failed: %s", getattr(kernel, "name", kernel), error)
    return kernel


def _run_into(future: Future, call) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(call())
    except BaseException as error:   # the waiting launch (or leaving compile_ahead) raises it
        future.set_exception(error)


_pool: _HeldPool | None = None


@contextmanager
def compile_ahead(threads: int) -> Iterator[bool]:
    """Triton compiles on `threads` threads inside the block (see the module docstring); yields
    whether they do (False: no threads asked for, or a Triton without async compilation)."""
    global _asynchronous, _pool
    mode = _async_compile_mode()
    if threads < 1 or mode is None:
        if threads >= 1:
            logger.info("this Triton has no async compile mode: kernels compile at their first launch")
        yield False
        return
    if _asynchronous:
        raise RuntimeError("compile_ahead is already active; it cannot nest")
    with _HeldPool(threads) as pool, mode(pool):
        _asynchronous, _pool = True, pool
        try:
            yield True
        finally:
            _asynchronous, _pool = False, None


@contextmanager
def queuing_launches() -> Iterator[None]:
    """Launches queue their kernel's compile and do not run, inside the block (only within an
    active `compile_ahead`)."""
    global _active
    if not _asynchronous:
        raise RuntimeError("queuing_launches() needs an active compile_ahead() around it")
    _active, _pool.holding = True, True
    try:
        yield
    finally:
        _active = False
        _queued.clear()
        _pool.release()   # the compiles start now, on the threads
