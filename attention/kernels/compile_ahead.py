"""Compile the Triton kernels some forwards will launch on worker threads, before running them.

Why: on a fresh machine (empty Triton cache) a kernel variant compiles the first time it is
launched, and the launches come one after another: the capture phase's warm-up runs met about
nine variants one at a time (PERFORMANCE.md §S5: capture 10.6 s cold, 3.2 s warm, H100). Most of
a Triton compile (LLVM, ptxas) runs without the GIL, so threads compile variants in parallel.

How: inside `compile_ahead(threads)`, a launch made through `launch()` or `FastLaunch` does not
run; it only queues its kernel's compilation (Triton's AsyncCompileMode: `JITFunction.warmup`
returns at once, the compile runs on the pool) and returns None. Leaving the block waits for
every queued compile (a compile error is raised there) and puts the kernels into Triton's
caches, so the next real launch of the same variant finds it compiled. A forward run inside the
block computes garbage (its Triton kernels never ran): only which variants it launches matters.
Without Triton's async compile mode (older Triton) the block does nothing and says so.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

logger = logging.getLogger(__name__)

_active = False
"""True inside `compile_ahead`: launches queue compiles instead of running."""
_queued: set[tuple] = set()
"""Launch keys queued in this `compile_ahead` block: a repeat is skipped before Triton's binder,
which costs tens of microseconds a call (a pass runs ~100 forwards of ~200 launches each)."""


def compiling_ahead() -> bool:
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
    """At least everything Triton specialises a compiled kernel on, for these arguments:
    constexprs (positional ones by `fn.params`, keyword arguments, compile options) by value,
    tensors by dtype and 16-byte alignment, other ints by (== 1, % 16 == 0, fits in 32 bits),
    other scalars by type. Equal keys: the same variant; it may tell apart calls Triton would
    not (an int Triton does not specialise on), which costs one more warm-up call, never a missed
    compile."""
    params = getattr(fn, "params", None) or ()
    parts = []
    for index, arg in enumerate(args):
        if index < len(params) and params[index].is_constexpr:
            parts.append(arg)
        elif type(arg) is int:
            parts.append((arg == 1, arg % 16 == 0, -(2 ** 31) <= arg < 2 ** 31))
        elif hasattr(arg, "data_ptr"):
            parts.append((arg.dtype, arg.data_ptr() % 16 == 0))
        else:
            parts.append(type(arg))
    return (fn, tuple(parts), tuple(sorted(options.items())))


def compile_threads() -> int:
    """Compiler threads: GRAPHRUNNER_COMPILE_THREADS, else one per CPU up to 16 (0 turns
    compiling ahead off; the kernels then compile at their first launch, one at a time)."""
    configured = os.environ.get("GRAPHRUNNER_COMPILE_THREADS")
    if configured is not None:
        return max(0, int(configured))
    return min(16, os.cpu_count() or 1)


def _async_compile_mode() -> Any:
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


@contextmanager
def compile_ahead(threads: int) -> Iterator[bool]:
    """Queue instead of launch inside the block (see the module docstring); yields whether it
    does (False: no threads asked for, or a Triton without async compilation)."""
    global _active
    mode = _async_compile_mode()
    if threads < 1 or mode is None:
        if threads >= 1:
            logger.info("this Triton has no async compile mode: kernels compile at their first launch")
        yield False
        return
    if _active:
        raise RuntimeError("compile_ahead is already active; it cannot nest")
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, mode(pool):
        _active = True
        try:
            yield True
        finally:
            _active = False
            _queued.clear()
