"""compile_ahead / queuing_launches: inside both, launches queue their kernel's compilation and
never run; inside compile_ahead alone they run (CPU, fakes).

The real thing (Triton's async compile on threads; a start-up that compiles every kernel ahead)
is the `cuda` test in test_compile_ahead_cuda.py."""

from __future__ import annotations

import pytest

from launch import compile_ahead as ahead
from launch.fast_launch import FastLaunch


class FakeJIT:
    """Records how it was called: `fn[grid](...)` (a launch) or `fn.warmup(...)` (a queued compile)."""

    def __init__(self):
        self.launches, self.warmups = [], []

    def __getitem__(self, grid):
        return lambda *args, **options: self.launches.append((grid, args, options))

    def warmup(self, *args, grid, **options):
        self.warmups.append((grid, args, options))


class FakeAsyncMode:
    """Stands in for triton.runtime._async_compile.AsyncCompileMode (needs no GPU)."""
    entered = exited = 0

    def __init__(self, executor):
        self.executor = executor

    def __enter__(self):
        FakeAsyncMode.entered += 1
        return self

    def __exit__(self, *exc):
        FakeAsyncMode.exited += 1


@pytest.fixture()
def fake_mode(monkeypatch):
    FakeAsyncMode.entered = FakeAsyncMode.exited = 0
    monkeypatch.setattr(ahead, "_async_compile_mode", lambda: FakeAsyncMode)
    return FakeAsyncMode


def test_launch_runs_outside_and_queues_inside(fake_mode):
    fn = FakeJIT()
    ahead.launch(fn, (3,), 1, 2, BLOCK=4, num_warps=1)
    assert fn.launches == [((3,), (1, 2), {"BLOCK": 4, "num_warps": 1})] and not fn.warmups
    with ahead.compile_ahead(2) as asynchronous:
        assert asynchronous and not ahead.compiling_ahead()
        with ahead.queuing_launches():
            assert ahead.compiling_ahead()
            assert ahead.launch(fn, (5,), 7, BLOCK=8) is None
        ahead.launch(fn, (6,), 8)            # after the queuing block: a real launch again
    assert fn.warmups == [((5,), (7,), {"BLOCK": 8})] and len(fn.launches) == 2
    assert not ahead.compiling_ahead() and fake_mode.entered == fake_mode.exited == 1


def test_queuing_needs_compile_ahead():
    with pytest.raises(RuntimeError, match="needs an active compile_ahead"):
        with ahead.queuing_launches():
            pass


def test_fast_launch_queues_even_a_known_kernel(fake_mode):
    """Inside compile_ahead a FastLaunch never relaunches a compiled kernel (that would run it)."""
    fn = FakeJIT()
    launcher = FastLaunch(fn)
    launcher.kinds = (2,)          # pretend a compiled JITFunction with one plain parameter
    launcher._fast_key((1,), (0, 4, 3, False))
    launcher.compiled[launcher._fast_key((1,), (0, 4, 3, False))] = object()
    with ahead.compile_ahead(1), ahead.queuing_launches():
        assert launcher((1,), 1) is None
    assert len(fn.warmups) == 1 and not fn.launches and launcher.fast_launches == 0


def test_launch_kernel_queues_with_its_keywords_as_given(fake_mode, monkeypatch):
    """`fast_launch.launch_kernel` inside queuing_launches queues the compile with the caller's
    keywords (as `launch` would), and never relaunches a kernel its FastLaunch already holds."""
    from types import SimpleNamespace
    from launch import fast_launch
    fn = FakeJIT()
    fn.params = [SimpleNamespace(name=n, is_constexpr=n == "BLOCK", do_not_specialize=False, has_default=False)
                 for n in ("x", "BLOCK")]
    fn.device_caches = {}
    monkeypatch.setitem(fast_launch._launchers, id(fn), fast_launch._KeywordLauncher(fn, FastLaunch(fn, stream_of=lambda index: 0)))
    with ahead.compile_ahead(1), ahead.queuing_launches():
        assert fast_launch.launch_kernel(fn, (2,), 7, BLOCK=8, num_warps=2) is None
    assert fn.warmups == [((2,), (7,), {"BLOCK": 8, "num_warps": 2})] and not fn.launches


def test_no_threads_or_no_async_mode_means_launches_run(monkeypatch):
    fn = FakeJIT()
    with ahead.compile_ahead(0) as queued:
        assert not queued
        ahead.launch(fn, (1,), 0)
    monkeypatch.setattr(ahead, "_async_compile_mode", lambda: None)
    with ahead.compile_ahead(4) as queued:
        assert not queued
        ahead.launch(fn, (1,), 0)
    assert len(fn.launches) == 2 and not fn.warmups


def test_nesting_raises_and_the_flag_resets_after_an_error(fake_mode):
    with pytest.raises(ValueError, match="boom"):
        with ahead.compile_ahead(1), ahead.queuing_launches():
            with pytest.raises(RuntimeError, match="cannot nest"):
                with ahead.compile_ahead(1):
                    pass
            raise ValueError("boom")
    assert not ahead.compiling_ahead() and not ahead._asynchronous


@pytest.mark.parametrize("configured, expected", [(0, 0), (3, 3), (None, None)])
def test_compile_threads(configured, expected):
    """CompilationConfig.compile_threads as given; None: one per CPU, at most 16."""
    if configured is None:
        assert 1 <= ahead.compile_threads(None) <= 16
    else:
        assert ahead.compile_threads(configured) == expected


def test_a_repeated_launch_is_queued_once_and_constexprs_count_by_value(fake_mode):
    """Inside one block a launch whose key was queued is not handed to Triton again; a positional
    constexpr (known from fn.params) and keyword options count by value, tensors by dtype and
    alignment, plain ints by what Triton specialises on."""
    import torch
    from types import SimpleNamespace
    fn = FakeJIT()
    fn.params = [SimpleNamespace(is_constexpr=c, do_not_specialize=False) for c in (False, False, True)]
    fn.device_caches = {}      # like a compiled JITFunction: its params decide the key
    x = torch.zeros(8)
    with ahead.compile_ahead(1), ahead.queuing_launches():
        ahead.launch(fn, (1,), x, 32, 64, BLOCK=4)
        ahead.launch(fn, (9,), torch.ones(8), 48, 64, BLOCK=4)      # same variant: skipped
        ahead.launch(fn, (1,), x, 32, 128, BLOCK=4)                 # another positional constexpr
        ahead.launch(fn, (1,), x, 1, 64, BLOCK=4)                   # an int that became 1
        ahead.launch(fn, (1,), x.double(), 32, 64, BLOCK=4)         # another dtype
        ahead.launch(fn, (1,), x, 32, 64, BLOCK=8)                  # another keyword constexpr
        ahead.launch(fn, (1,), x[1:], 32, 64, BLOCK=4)              # misaligned by 4 bytes
    assert len(fn.warmups) == 6
    with ahead.compile_ahead(1), ahead.queuing_launches():           # a new block starts empty
        ahead.launch(fn, (1,), x, 32, 64, BLOCK=4)
    assert len(fn.warmups) == 7


def test_compiles_submitted_while_queuing_start_when_queuing_ends(fake_mode):
    """The pool holds compiles submitted inside queuing_launches (the forwards there run without
    the compile threads' Python competing for the GIL) and starts them when it ends; after that
    a submit starts at once; results and errors reach the futures."""
    import time
    started = []
    with ahead.compile_ahead(2):
        with ahead.queuing_launches():
            held = ahead._pool.submit(lambda: started.append("held") or 5)
            failing = ahead._pool.submit(lambda: 1 / 0)
            time.sleep(0.05)
            assert started == [] and not held.done()
        assert held.result(timeout=10) == 5 and started == ["held"]
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=10)
        assert ahead._pool.submit(lambda: 7).result(timeout=10) == 7
    assert ahead._pool is None


def test_each_compiled_kernel_gets_its_launcher_built_on_the_compile_thread(fake_mode, monkeypatch):
    """A compile's result (a CompiledKernel: src, metadata) has its host launcher built right after,
    on the same compile thread, held or not; results without them, and a launcher that fails to
    build, leave the compile's result as it was (the first launch builds it again)."""
    import threading
    from types import SimpleNamespace
    built = []

    def builder(src, metadata):
        if src == "bad":
            raise RuntimeError("no C compiler")
        built.append((src, metadata, threading.current_thread().name))

    monkeypatch.setattr(ahead, "_launcher_builder", lambda: builder)
    kernel, bad = SimpleNamespace(src="src", metadata="meta"), SimpleNamespace(src="bad", metadata="meta")
    with ahead.compile_ahead(2):
        with ahead.queuing_launches():
            held = ahead._pool.submit(lambda: kernel)
        assert held.result(timeout=10) is kernel
        assert ahead._pool.submit(lambda: bad).result(timeout=10) is bad
        assert ahead._pool.submit(lambda: 7).result(timeout=10) == 7
    assert [(s, m) for s, m, _ in built] == [("src", "meta")]
    assert built[0][2].startswith("triton-compile")
