"""Break points: the ops a PIECEWISE capture ends a graph segment at (the attention op is one).

Why here, below attention: the attention op must be declared a break point where it is defined
(attention/layer.py), while the capture that acts on break points is orchestrated by the runner
(runner/cudagraph/breakable.py, `BreakableCapture`). This module is the meeting point, importing
neither: a capture registers itself as the thread's `BreakHandler` for its duration, and a
break-point op outside one is just the op.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Protocol


class BreakHandler(Protocol):
    """What a capture offers its break points (runner/cudagraph/breakable.BreakableCapture)."""

    def run_break(self, op: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


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


def break_point(op: Callable[..., Any]) -> Callable[..., Any]:
    """Make `op` a PIECEWISE break point; outside a capture it is just `op`."""

    @functools.wraps(op)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        capture = getattr(_state, "capture", None)
        if capture is None:
            return op(*args, **kwargs)
        return capture.run_break(op, args, kwargs)

    wrapper.__wrapped_op__ = op
    return wrapper
