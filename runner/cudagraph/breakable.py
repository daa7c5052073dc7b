"""Breakable stream capture: PIECEWISE graphs without torch.compile.

One capture drives the whole forward. Ops decorated with `@break_point` (launch/break_point.py; attention) end
the current graph segment, run eagerly on the capture stream, are recorded, and a new
segment starts in the same memory pool. `BreakableGraph.replay()` then runs segment 0,
break op 0, segment 1, ... in order; the break ops run eagerly, so they read the forward
context that is current at *replay* (this step's metadata, any batch composition).

Contract of a break op: `op(*args, out=tensor)` or `op(*args, tensor_out)`; it writes its
result into the caller-provided `out` and returns None (or `out`). The caller allocates
`out` inside a segment, so it lives in the pool at an address the next segment reads; a
fresh result tensor would be allocated outside the pool and move each replay, so it is
rejected at capture. Its tensor arguments must be activations produced inside the graph
(or buffers that outlive it); per-step state (KV cache, metadata) is read from the forward
context, never passed in. Capture runs break ops on not-yet-computed inputs: the capture
batch must be inert (slot_mapping -1), which the runner's dummy batches are.

A break point may offer `prepare_replay(*args, **kwargs)` (launch/break_point.py: `BreakPoint`):
called once at capture with the recorded inputs, it returns a `PreparedBreak`, a zero-argument replay
of the op on them (which still reads the forward context current at replay), or None for the generic
call. Why: a PIECEWISE step of a 30-layer model replays 30 break ops from Python, and work that depends
only on the recorded inputs (checking their shapes, strides, alignment) need not be redone every step.

A graph whose prepared breaks all offer it (a `StepGraphLink`, one group for all: the Triton attention
backend's do; `native_step_graph`) is
replayed as ONE CUDA graph (runner/cudagraph/step_graph.py): its segments as child graphs and its
attention as kernel nodes, re-parameterised from the step's own launch plan when it differs from the
last step's. A step that cannot take it (its launch has no compiled kernel yet, needs a second
kernel, or something differs from the capture) replays from Python as above. For that the segments
are kept as graphs (`keep_graph=True`) after they are instantiated.

The graph primitive is a factory (`CUDA_GRAPHS` by default) so CPU tests can inject a fake.
"""

from __future__ import annotations

import functools
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from launch.break_point import BreakPoint, StepBinder, StepGraphLink, begin_capture, end_capture
from launch.driver_launch import KernelLaunch
from runner.cudagraph import step_graph


class GraphLike(Protocol):
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None: ...
    def capture_end(self) -> None: ...
    def replay(self) -> None: ...


class CudaGraphFactory:
    """The real primitive: a `torch.cuda.CUDAGraph`, captured on a side stream. `kept()`: one that
    keeps its cudaGraph_t after capture (a PIECEWISE segment, for the step graph), where torch can."""

    uses_cuda_streams = True

    def __call__(self) -> GraphLike:
        return torch.cuda.CUDAGraph()

    def kept(self) -> GraphLike:
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:   # a torch without keep_graph: no step graph, segments replay one by one
            return torch.cuda.CUDAGraph()
        graph.kept = True
        return graph


CUDA_GRAPHS = CudaGraphFactory()
_side_streams: dict[int, torch.cuda.Stream] = {}


@contextmanager
def capture_stream(graph_factory: Callable[[], GraphLike]) -> Iterator[None]:
    """Run warm-up and capture on one side stream (capture is illegal on the legacy default
    stream), synchronized on both ends, as `torch.cuda.graph` does. Reusing one stream keeps
    its lazily created per-stream state (cuBLAS workspace) out of the graph pool: the
    warm-up creates it. A no-op for fakes without `uses_cuda_streams`."""
    if not getattr(graph_factory, "uses_cuda_streams", False):
        yield
        return
    device = torch.cuda.current_device()
    stream = _side_streams.get(device) or _side_streams.setdefault(device, torch.cuda.Stream())
    torch.cuda.synchronize()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.synchronize()


def prime_capture_stream(graph_factory: Callable[[], GraphLike], dtype: torch.dtype) -> None:
    """Create the capture stream's lazy per-stream state now: cuBLAS gives each stream its own
    workspace on first use (32 MiB on an H100), allocated through torch and never freed. The
    runner calls this inside the profile run, so the profile peak (and the KV budget) counts it
    once and the graph-memory measurement, which comes later, does not mistake it for graphs."""
    with capture_stream(graph_factory):
        if getattr(graph_factory, "uses_cuda_streams", False):
            x = torch.ones(16, 16, dtype=dtype, device="cuda")
            torch.nn.functional.linear(x, x, x[0])
            torch.nn.functional.linear(x, x)


def _end_capture(graph: GraphLike) -> None:
    with warnings.catch_warnings():  # two adjacent break points leave a legitimately empty segment
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        graph.capture_end()


def _instantiate_kept(segments: list[GraphLike]) -> None:
    """Instantiate the kept segments of a graph that replays them from Python every step (no step
    graph), now rather than at their first replay. A graph with a step graph leaves them as they are:
    the step graph holds them as child graphs of its own executable, and a segment is instantiated
    only by a step that falls back to the Python replay (torch does so at a kept graph's first
    replay). Why: a PIECEWISE capture of an n-layer model has n + 1 segments, and instantiating each
    cost a start-up thousands of cudaGraphInstantiate calls that most graphs never use."""
    for segment in segments:
        if getattr(segment, "kept", False):
            segment.instantiate()


def _alias(value: Any) -> Any:
    """A CUDA tensor that points at `value`'s memory without owning it, so recorded break
    inputs do not pin pool blocks (later segments and graphs reuse them, in replay order;
    the pool keeps the memory mapped). CPU tensors (tests with fake graphs) are kept as is."""
    if isinstance(value, torch.Tensor) and value.is_cuda:
        storage = value.untyped_storage()
        weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            weak, value.storage_offset(), value.size(), value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_alias(v) for v in value)
    return value


def _replay_of(segment: GraphLike) -> Callable[[], None]:
    """The segment's replay. For a torch.cuda.CUDAGraph, torch's C++ replay bound to it: the
    Python `CUDAGraph.replay` around it only re-checks state that a graph captured here always
    has (an instantiated executable; no pool tracker), and a PIECEWISE step replays ~31 segments
    per forward. Any other graph (tests' fakes, a tracked pool) keeps its own `replay`."""
    native = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)
    if native is None or not isinstance(segment, torch._C._CUDAGraph) or getattr(segment, "_tracker", None) is not None:
        return segment.replay
    return types.MethodType(native, segment)


class StepGraphRunner(Protocol):
    """What replays a whole BreakableGraph as one launch (runner/cudagraph/step_graph.StepGraph)."""

    runs: int

    def run(self, launch: KernelLaunch, stream: int) -> None: ...


@dataclass
class StepGraphReplay:
    """A BreakableGraph as one CUDA graph: `graph` launches it given the step's attention launch, which
    `bind()` plans each step (None: that step replays from Python)."""
    graph: StepGraphRunner
    bind: StepBinder


def native_step_graph(segments: list[GraphLike], breaks: list["BreakRecord"]) -> StepGraphReplay | None:
    """The step graph of a graph whose breaks all carry a StepGraphLink of one group that offers a
    binder (launch/break_point.py has the protocol; attention/backends/triton_paged.py implements it),
    else None."""
    links = [r.step_graph for r in breaks]
    if not links or links[0] is None or any(link is None or link.group is not links[0].group for link in links):
        return None
    bind = links[0].group.step_graph_binder([r.replay for r in breaks])
    if bind is None:
        return None
    graph = step_graph.make_step_graph(segments, [link.patched for link in links])
    return None if graph is None else StepGraphReplay(graph, bind)


@dataclass(frozen=True)
class BreakRecord:
    op: Callable[..., Any]
    args: tuple
    kwargs: dict
    replay: Callable[[], Any] | None = None
    """The op's own replay of these inputs (`prepare_replay`), or None: `op(*args, **kwargs)`."""
    step_graph: StepGraphLink | None = None
    """How this break joins a step graph (from its PreparedBreak), or None: it cannot."""


class BreakableGraph:
    """Captured segments and the break ops between them: len(segments) == len(breaks) + 1.

    `step_graph`: the whole graph as one CUDA graph (runner/cudagraph/step_graph.py) and its per-step
    binder, when the breaks allow it (`native_step_graph`); else None and every replay runs from Python."""

    def __init__(self, segments: list[GraphLike], breaks: list[BreakRecord],
                 step_graph: StepGraphReplay | None = None) -> None:
        if len(segments) != len(breaks) + 1:
            raise ValueError(f"{len(segments)} segments for {len(breaks)} breaks")
        self.segments, self.breaks = segments, breaks
        self._calls = [r.replay or functools.partial(r.op, *r.args, **r.kwargs) for r in breaks]
        self._replays = [_replay_of(segment) for segment in segments]
        self.step_graph = step_graph

    def replay(self) -> None:
        whole = self.step_graph
        if whole is not None:
            bound = whole.bind()              # this step's attention launch, planned, not launched
            if bound is not None:
                whole.graph.run(*bound)       # the whole forward: one graph launch
                return
        for replay, call in zip(self._replays, self._calls):
            replay()
            call()
        self._replays[-1]()

    def break_inputs(self) -> list[tuple[tuple, dict]]:
        """(args, kwargs) of each break, for the debug address check."""
        return [(r.args, r.kwargs) for r in self.breaks]


class BreakableCapture:
    """Context manager: capture everything run inside it as a `BreakableGraph` (`.graph`).

    Only one per thread at a time (graphs cannot nest). Break points act only inside one, so
    a FULL capture (no BreakableCapture) records attention like any other op."""

    def __init__(self, pool: Any, graph_factory: Callable[[], GraphLike] = CUDA_GRAPHS,
                 step_graph: bool = True, capture_error_mode: str = "global") -> None:
        """`step_graph`: offer the captured graph a step graph (`native_step_graph`); False: every replay
        runs from Python (CompilationConfig.step_graph). `capture_error_mode`: torch's name for CUDA's
        stream capture mode of every segment ("relaxed" for a capture without a warm-up before it,
        CUDAGraphWrapper._capture)."""
        self.pool, self.graph_factory, self.step_graph = pool, graph_factory, step_graph
        self.capture_error_mode = capture_error_mode
        self._segments: list[GraphLike] = []
        self._breaks: list[BreakRecord] = []
        self._open: GraphLike | None = None
        self.graph: BreakableGraph | None = None

    def _begin_segment(self) -> None:
        graph = getattr(self.graph_factory, "kept", self.graph_factory)()
        graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        self._open = graph
        self._segments.append(graph)

    def _end_segment(self) -> None:
        graph, self._open = self._open, None
        _end_capture(graph)

    def __enter__(self) -> "BreakableCapture":
        begin_capture(self)
        try:
            self._begin_segment()
        except BaseException:
            end_capture()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        end_capture()
        if self._open is None:  # failed inside a break op: no segment is open
            return
        try:
            self._end_segment()
        except Exception:
            if exc_type is None:
                raise  # otherwise the original error is the one worth seeing
            return
        if exc_type is None:
            whole = native_step_graph(self._segments, self._breaks) if self.step_graph else None
            if whole is None:
                _instantiate_kept(self._segments)
            self.graph = BreakableGraph(self._segments, self._breaks, whole)

    def run_break(self, point: BreakPoint, args: tuple, kwargs: dict) -> Any:
        """End the segment, run the point's op eagerly, check it wrote into `out`, record it, resume."""
        op = point.op
        name = getattr(op, "__qualname__", repr(op))
        out = kwargs.get("out")
        if out is None and args and isinstance(args[-1], torch.Tensor):
            out = args[-1]
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"break op {name} has no caller-provided out buffer "
                               f"(a kwarg `out` or a last positional tensor)")
        self._end_segment()
        result = op(*args, **kwargs)
        if result is not None and not (isinstance(result, torch.Tensor) and result.data_ptr() == out.data_ptr()):
            what = "a fresh tensor" if isinstance(result, torch.Tensor) else f"a {type(result).__name__}"
            raise RuntimeError(f"break op {name} returned {what}; write into the caller-provided "
                               f"out buffer and return None (or out)")
        args, kwargs = _alias(args), {k: _alias(v) for k, v in kwargs.items()}
        prepared = point.prepare_replay(*args, **kwargs) if point.prepare_replay is not None else None
        self._breaks.append(BreakRecord(op, args, kwargs, prepared.replay if prepared else None,
                                        prepared.step_graph if prepared else None))
        self._begin_segment()
        return result
