"""Break points: the ops a PIECEWISE capture ends a graph segment at (the attention op is one), and
the typed protocol between a break and the step graph that may replay it.

Why here, below attention: the attention op must be declared a break point where it is defined
(attention/layer.py), while the capture that acts on break points is orchestrated by the runner
(runner/cudagraph/breakable.py, `BreakableCapture`; runner/cudagraph/step_graph.py). This module is
their meeting point and imports neither: a capture registers itself as the thread's `BreakHandler`
for its duration, and a break point outside one is just its op.

The collaborators, typed:
- `BreakPoint(op, prepare_replay)`: the op, and optionally `prepare_replay(*args, **kwargs)`, asked
  once at capture with the recorded inputs, which returns a `PreparedBreak` (or None: the generic
  `op(*args, **kwargs)` at every replay);
- `PreparedBreak(replay, step_graph)`: the zero-argument replay (it still reads the forward context
  current at replay) and, where the break can be a kernel node of a step graph, its `StepGraphLink`;
- `StepGraphLink(group, patched)`: `patched` are the launch's first PATCHED_ARGS (launch/driver_launch.py)
  arguments for this break (q, KV cache, out addresses); `group` (a `StepGraphGroup`, the attention
  backend) is one object for all breaks that can share one launch;
- `StepGraphGroup.step_graph_binder(replays)`: given the graph's prepared replays (the ones the group
  made), a `StepBinder`, called each step: the step's launch in driver form and its stream
  (`StepLaunch`), planned without launching, or None (that step replays from Python).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from launch.driver_launch import KernelLaunch

StepLaunch = tuple[KernelLaunch, int]
"""One step's attention launch in driver form and the raw stream it goes on."""
StepBinder = Callable[[], "StepLaunch | None"]


class StepGraphGroup(Protocol):
    def step_graph_binder(self, replays: Sequence[Callable[[], None]]) -> StepBinder | None: ...


@dataclass(frozen=True)
class StepGraphLink:
    group: StepGraphGroup
    patched: tuple[int, ...]


@dataclass(frozen=True)
class PreparedBreak:
    replay: Callable[[], None]
    step_graph: StepGraphLink | None = None


class BreakPoint:
    """A PIECEWISE break point: calls `op` outside a capture, hands itself to the capture inside one."""

    def __init__(self, op: Callable[..., Any],
                 prepare_replay: Callable[..., PreparedBreak | None] | None = None) -> None:
        self.op, self.prepare_replay = op, prepare_replay
        functools.update_wrapper(self, op)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture = getattr(_state, "capture", None)
        if capture is None:
            return self.op(*args, **kwargs)
        return capture.run_break(self, args, kwargs)


class BreakHandler(Protocol):
    """What a capture offers its break points (runner/cudagraph/breakable.BreakableCapture)."""

    def run_break(self, point: BreakPoint, args: tuple, kwargs: dict) -> Any: ...


_state = threading.local()


def active_capture() -> BreakHandler | None:
    """The capture active on this thread, or None."""
    return getattr(_state, "capture", None)


def begin_capture(handler: BreakHandler) -> None:
    """Route this thread's break points to `handler` until `end_capture()` (captures cannot nest)."""
    if getattr(_state, "capture", None) is not None:
        raise RuntimeError("a BreakableCapture is already active on this thread; captures cannot nest")
    _state.capture = handler


def end_capture() -> None:
    _state.capture = None


def break_point(op: Callable[..., Any] | None = None, *,
                prepare_replay: Callable[..., PreparedBreak | None] | None = None) -> Any:
    """`op` as a PIECEWISE break point (`@break_point`, or `@break_point(prepare_replay=...)`)."""
    if op is None:
        return lambda fn: BreakPoint(fn, prepare_replay)
    return BreakPoint(op, prepare_replay)
