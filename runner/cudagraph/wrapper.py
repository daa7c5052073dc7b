"""CUDAGraphWrapper: capture-on-first-use and replay of one runtime mode around a callable.

The runner nests them: FULL wraps PIECEWISE wraps the model forward. Each wrapper acts
only when the forward context's runtime_mode is its own and a batch descriptor is set;
otherwise it passes the call through. So under a FULL capture the inner PIECEWISE wrapper
is transparent and no BreakableCapture is open: attention's break points do not break and
attention is recorded into the one FULL graph. Under PIECEWISE the FULL wrapper passes
through and the PIECEWISE wrapper opens the breakable capture.

Graphs are captured only inside `CapturePhase.capturing()`; a descriptor seen later without
a graph is a runner bug (the dispatcher only returns captured keys), so it raises.

Each graph's first replay compares its inputs' addresses with the capture's (addresses.py;
every replay in debug mode). The wrapper adds up what recording and checking cost
(`address_check_seconds`) and logs one INFO line when every graph it captured has passed its
first-replay check.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from attention.forward_context import get_forward_context
from configs.graph_mode import CUDAGraphMode
from runner.cudagraph.addresses import AddressCheck, AddressRecorder
from runner.cudagraph.breakable import (CUDA_GRAPHS, BreakableCapture, BreakableGraph, GraphLike, _alias, _end_capture,
                                        capture_stream)
from runner.cudagraph.capture import CapturePhase
from runner.cudagraph.dispatcher import BatchDescriptor

logger = logging.getLogger(__name__)

def _pool_fields(obj: Any) -> tuple[str, ...]:
    """Fields of an output dataclass that a FULL graph leaves in the pool instead of copying out
    (`pool_fields`, e.g. a decode step's logits: rows x vocab, too big to copy every step)."""
    return getattr(obj, "pool_fields", ())


def _tensors(obj: Any, pooled: bool = True) -> list[torch.Tensor]:
    """Tensors of an output (tensor, list/tuple, dict, dataclass such as IntermediateTensors) in
    order; `pooled=False` leaves out a dataclass's `pool_fields`."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v, pooled)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v, pooled)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        skip = () if pooled else _pool_fields(obj)
        return [t for f in dataclasses.fields(obj) if f.name not in skip for t in _tensors(getattr(obj, f.name), pooled)]
    return []


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any, pooled: bool = True) -> Any:
    """`obj` with `fn` applied to its tensors (`pooled=False`: not to a dataclass's `pool_fields`)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, v, pooled) for v in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v, pooled) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        skip = () if pooled else _pool_fields(obj)
        return dataclasses.replace(obj, **{f.name: _map_tensors(fn, getattr(obj, f.name), pooled)
                                           for f in dataclasses.fields(obj) if f.init and f.name not in skip})
    return obj


@dataclass
class _Entry:
    graph: Any
    """A GraphLike (FULL) or a BreakableGraph (PIECEWISE)."""
    output: Any
    """Where a replay leaves its result. FULL: views [:num_tokens] of the wrapper's shared output
    buffers, which the graph copies its result into (a dataclass's `pool_fields`: non-owning aliases
    in the pool, not copied); PIECEWISE: a non-owning alias of the last segment's output in the pool.
    Either way no graph keeps memory of its own for its output:
    graphs replay one at a time and a step consumes its output before the next replay (vLLM
    keeps only weak references to graph outputs for the same reason), so the graphs together
    cost what the largest one does -- the figure the KV budget reserves."""
    recorder: AddressRecorder | None
    """The capture's addresses, until the check that the address-check mode asks for is done."""


class CUDAGraphWrapper:
    """One graph per BatchDescriptor for `runnable`, in one runtime mode (FULL or PIECEWISE)."""

    def __init__(self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode, pool: Any,
                 capture_phase: CapturePhase, address_check: AddressCheck | bool = AddressCheck.FIRST_REPLAY,
                 graph_factory: Callable[[], GraphLike] = CUDA_GRAPHS, step_graph: bool = True,
                 warm_up_every_capture: bool = False) -> None:
        """`address_check`: AddressCheck.from_config(CompilationConfig's check_cudagraph_addresses,
        debug_cudagraph_addresses); `step_graph`: CompilationConfig.step_graph (PIECEWISE graphs may
        replay as one step graph, runner/cudagraph/step_graph.py); `warm_up_every_capture`:
        CompilationConfig.warm_up_every_capture (`_capture` says what it changes)."""
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a graph wrapper runs FULL or PIECEWISE graphs, not {runtime_mode.name}")
        self.runnable, self.runtime_mode, self.pool = runnable, runtime_mode, pool
        self.capture_phase, self.graph_factory = capture_phase, graph_factory
        self.address_check = AddressCheck.of(address_check)
        self.step_graph = step_graph
        self.warm_up_every_capture = warm_up_every_capture
        self.warm_ups = 0
        """Eager runs before a capture (with `warm_up_every_capture` off: the first capture's of each
        kind of batch, and one per output structure the shared buffers did not have yet)."""
        self._warmed_kinds: set[bool] = set()
        """`uniform_decode` of the batches whose first (largest) capture warmed up."""
        self.address_record_seconds = 0.0
        """Time spent recording addresses at capture."""
        self.first_replay_check_seconds = 0.0
        """Time spent in first-replay address checks (every replay's, in debug mode)."""
        self.first_replay_checks = 0
        """Graphs whose first replay was checked."""
        self._entries: dict[BatchDescriptor, _Entry] = {}
        self._shared_output: dict[tuple, torch.Tensor] = {}
        """FULL: one buffer per (position, dtype, trailing shape) of an output tensor, as many rows as
        the largest output so far (graphs of different output structures share what matches)."""
        self.num_replays = 0
        """Calls served by replaying an already captured graph (the capturing call not counted)."""
        self.replays_by_descriptor: Counter[BatchDescriptor] = Counter()

    @property
    def num_captured(self) -> int:
        return len(self._entries)

    @property
    def step_graph_runs(self) -> int:
        """PIECEWISE replays launched as one step graph (runner/cudagraph/step_graph.py)."""
        return sum(e.graph.step_graph.graph.runs for e in self._entries.values()
                   if isinstance(e.graph, BreakableGraph) and e.graph.step_graph is not None)

    def captured_descriptors(self) -> list[BatchDescriptor]:
        return list(self._entries)

    def release_graphs(self) -> None:
        """Forget every captured graph (a descriptor called again captures anew, the first one after
        a warm-up: after the throwaway capture that measures graph memory, the real largest graph then
        costs what was measured, its warm-up's activations included). Dropping the last reference
        destroys the graph and returns its memory to the pool."""
        self._entries.clear()
        self._warmed_kinds.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        desc = context.batch_descriptor
        if context.runtime_mode != self.runtime_mode or desc is None:
            return self.runnable(*args, **kwargs)
        entry = self._entries.get(desc)
        if entry is None:
            if not self.capture_phase.active:
                raise RuntimeError(f"{self.runtime_mode.name} graph for {desc} requested outside the capture "
                                   f"phase: capture outside the capture phase is not allowed (was it dispatched "
                                   f"before capture_cudagraphs()?)")
            entry = self._entries[desc] = self._capture(context, args, kwargs)
            entry.graph.replay()  # the capture ran nothing: compute this call's result
            return entry.output
        if entry.recorder is not None:
            self._check_addresses(desc, entry, context, args, kwargs)
        entry.graph.replay()
        self.num_replays += 1
        self.replays_by_descriptor[desc] += 1
        return entry.output

    @property
    def address_check_seconds(self) -> float:
        """What the address check has cost so far: recording at capture plus the checks."""
        return self.address_record_seconds + self.first_replay_check_seconds

    def _check_addresses(self, desc: BatchDescriptor, entry: _Entry, context: Any, args: tuple,
                         kwargs: dict) -> None:
        """Raise AddressMismatchError if an input moved; in FIRST_REPLAY mode, forget the recorded
        addresses once they matched, so later replays skip the check."""
        started = time.perf_counter()
        entry.recorder.check(**self._addressed(entry.graph, context, args, kwargs))
        self.first_replay_check_seconds += time.perf_counter() - started
        if self.address_check is not AddressCheck.FIRST_REPLAY:
            return
        entry.recorder = None
        self.first_replay_checks += 1
        if self.first_replay_checks == len(self._entries):
            logger.info("cudagraph address check: all %d %s graphs replayed at their captured addresses; "
                        "recording them at capture took %.4f s, their first-replay checks %.4f s",
                        len(self._entries), self.runtime_mode.name, self.address_record_seconds,
                        self.first_replay_check_seconds)

    def _addressed(self, graph: Any, context: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        """What a replay must see at the captured addresses. FULL bakes in the metadata too;
        PIECEWISE reads metadata eagerly, but replays its break ops on the recorded inputs."""
        if self.runtime_mode == CUDAGraphMode.FULL:
            return {"args": args, "kwargs": kwargs, "attn_metadata": context.attn_metadata}
        return {"args": args, "kwargs": kwargs, "breaks": graph.break_inputs()}

    def _capture(self, context: Any, args: tuple, kwargs: dict) -> _Entry:
        """Capture on the capture stream, after an eager warm-up when one is needed.

        A warm-up does what cannot happen inside a capture in CUDA's default ("global") capture mode:
        lazy initialisation, and loading each kernel variant's module at its first launch (the driver
        refuses cuModuleLoadData while a stream captures). It also gives a FULL graph its output's
        structure. It costs about as long as the capture itself, so with `warm_up_every_capture`
        off only the first capture of each kind of batch (uniform decode, which computes the logits
        too, and mixed) warms up: the largest, whose warm-up activations are part of the graph
        memory that `GraphStartUp.measure_graph_reserve` measures on the same two graphs. Later
        captures run at once in "relaxed" mode, where a variant not loaded yet (another batch size's
        tile or specialisation) loads inside the capture. A FULL capture whose output needs a shared
        buffer that does not exist yet (a new output structure) is ended and redone after a warm-up,
        since a buffer made inside the capture would live in the pool."""
        kind = context.batch_descriptor.uniform_decode
        with capture_stream(self.graph_factory):
            graph = output = None
            if not self.warm_up_every_capture and kind in self._warmed_kinds:
                graph, output = self._capture_graph(None, args, kwargs, capture_error_mode="relaxed")
            if graph is None:
                warm = self.runnable(*args, **kwargs)
                self.warm_ups += 1
                self._warmed_kinds.add(kind)
                like = self._output_views(warm) if self.runtime_mode == CUDAGraphMode.FULL else None
                del warm
                graph, output = self._capture_graph(like, args, kwargs, capture_error_mode="global")
        recorder = None
        if self.address_check is not AddressCheck.OFF:
            started = time.perf_counter()
            recorder = AddressRecorder(f"{self.runtime_mode.name} graph replay of {context.batch_descriptor}")
            recorder.record(**self._addressed(graph, context, args, kwargs))
            self.address_record_seconds += time.perf_counter() - started
        return _Entry(graph, output, recorder)

    def _capture_graph(self, output: Any, args: tuple, kwargs: dict,
                       capture_error_mode: str) -> tuple[GraphLike | BreakableGraph | None, Any]:
        """(graph, output) of one capture in this wrapper's mode; FULL: `output` as `_output_views`
        made it, or None to take the views from the captured result ((None, None) if that needs a
        new buffer)."""
        if self.runtime_mode == CUDAGraphMode.FULL:
            return self._capture_full(output, args, kwargs, capture_error_mode)
        with BreakableCapture(self.pool, self.graph_factory, self.step_graph, capture_error_mode) as capture:
            output = _map_tensors(_alias, self.runnable(*args, **kwargs))
        return capture.graph, output

    def _output_views(self, like: Any, grow: bool = True) -> Any:
        """`like`'s structure as views [:rows] of the shared output buffers (outside the pool),
        a buffer grown when a larger output comes (captures go largest first, so normally never;
        earlier graphs keep the old buffer alive through their views). `pool_fields` stay as they are.
        `grow=False` (inside a capture, where a new buffer would be allocated in the pool): None
        instead of growing or adding a buffer."""
        views = []
        for position, t in enumerate(_tensors(like, pooled=False)):
            key = (position, t.dtype, tuple(t.shape[1:]))
            buf = self._shared_output.get(key)
            if buf is None or buf.shape[0] < t.shape[0]:
                if not grow:
                    return None
                buf = self._shared_output[key] = torch.empty_like(t)
            views.append(buf[:t.shape[0]])
        views = iter(views)
        return _map_tensors(lambda _: next(views), like, pooled=False)

    def _capture_full(self, output: Any, args: tuple, kwargs: dict,
                      capture_error_mode: str) -> tuple[GraphLike | None, Any]:
        """One graph for the whole forward; its result is copied, inside the graph, into
        `output` (shared buffers outside the pool), so the pool's blocks all return to the pool
        for the next capture while the result stays at a fixed address. Returns the graph and
        `output` with its `pool_fields` set to non-owning aliases of the captured tensors.
        `output` None: views of the existing shared buffers shaped like the captured result; when
        they lack one, the capture is ended and dropped and (None, None) returned."""
        graph = self.graph_factory()
        graph.capture_begin(pool=self.pool, capture_error_mode=capture_error_mode)
        try:
            result = self.runnable(*args, **kwargs)
            if output is None:
                output = self._output_views(result, grow=False)
            if output is not None:
                for dst, src in zip(_tensors(output, pooled=False), _tensors(result, pooled=False), strict=True):
                    dst.copy_(src)
                pooled = {name: _alias(getattr(result, name)) for name in _pool_fields(result)}
                if pooled:
                    output = dataclasses.replace(output, **pooled)
            del result
        except BaseException:
            try:
                _end_capture(graph)
            except Exception:
                pass  # the capture is already broken; the original error says why
            raise
        _end_capture(graph)
        return (graph, output) if output is not None else (None, None)
