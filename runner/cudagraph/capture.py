"""The capture phase: when graphs may be captured, the capture loop, and what graphs cost.

DESIGN.md step 3/4: the KV cache is sized after subtracting a *measured* graph reserve
(capture the largest graph once into a throwaway pool), then every graph is captured,
largest first, into one shared pool with the garbage collector frozen.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from tqdm import tqdm

from runner.collector import frozen_heap

logger = logging.getLogger(__name__)
K = TypeVar("K")


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class CapturePhase:
    """A flag the graph wrappers read: capture is allowed only while `active`, so a graph that
    was never captured fails loudly at serving time instead of capturing mid-step."""

    def __init__(self) -> None:
        self.active = False

    @contextmanager
    def capturing(self) -> Iterator["CapturePhase"]:
        """Allow capture, with the heap frozen (runner/collector.frozen_heap): hundreds of
        captures allocate many Python objects, and a collection pass over the model's objects in
        every capture is what makes capture slow. Synchronizes on both ends so timing and memory
        readings are real."""
        if self.active:
            raise RuntimeError("the capture phase is already active")
        with frozen_heap():
            if _cuda_in_use():
                torch.cuda.synchronize()
            self.active = True
            try:
                yield self
            finally:
                self.active = False
                if _cuda_in_use():
                    torch.cuda.synchronize()


def graph_pool() -> Any:
    """A fresh graph memory pool handle on CUDA (shared by every graph of one runner), else None."""
    return torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None


@dataclass(frozen=True)
class CaptureSummary:
    num_graphs: int
    seconds: float
    pool_bytes: int
    """Growth of memory reserved by torch while capturing (0 on a CPU): what the estimate predicts."""
    first_graph_bytes: int = 0
    """The same growth after the first (largest) graph only: the rest is what later graphs added."""
    device_bytes: int = 0
    """Growth of device memory in use by anyone (free memory the driver reports), which also counts
    the driver's own allocations (graph executables, modules loaded on first launch)."""
    address_record_seconds: float = 0.0
    """Of `seconds`, the time spent recording the graphs' input addresses for the address check
    (each graph's first replay then compares them: about as long again, spread over serving)."""


def _reserved() -> int:
    if not _cuda_in_use():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved()


def _device_used() -> int:
    if not _cuda_in_use():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def capture_all(keys: Sequence[K], capture_one: Callable[[K], None], desc: str = "capturing CUDA graphs",
                estimate_bytes: int | None = None) -> CaptureSummary:
    """Call `capture_one(key)` for each key in the given order (largest first, so the first
    capture sizes the shared pool and later ones reuse it), with a progress bar on a tty and
    one summary log line."""
    started, before, device_before = time.perf_counter(), _reserved(), _device_used()
    first = 0
    for i, key in enumerate(tqdm(keys, desc=desc, unit="graph", disable=not sys.stderr.isatty())):
        capture_one(key)
        if i == 0:
            first = max(0, _reserved() - before)
    summary = CaptureSummary(len(keys), time.perf_counter() - started, max(0, _reserved() - before),
                             first, max(0, _device_used() - device_before))
    estimate = "" if estimate_bytes is None else f" (estimate {estimate_bytes / 2**20:.1f} MiB)"
    logger.info("captured %d CUDA graphs in %.2f s; graph memory %.1f MiB%s, %.1f MiB after the first graph, "
                "device memory +%.1f MiB", summary.num_graphs, summary.seconds, summary.pool_bytes / 2**20, estimate,
                summary.first_graph_bytes / 2**20, summary.device_bytes / 2**20)
    return summary


def measure_graph_memory(capture_largest: Callable[[Any], None],
                         release: Callable[[], None] | None = None) -> int:
    """Bytes one capture of the largest graph(s) costs, measured on CUDA; 0 without CUDA.

    `capture_largest(pool)` captures into the given THROWAWAY pool. The cost is the growth of
    torch's reserved memory, the same quantity `capture_all` reports as actual: the pool, the
    persistent outputs, and the eager warm-up's activations on the capture stream (the caching
    allocator keeps those per stream, so the real capture needs them again). Driver memory
    outside torch (Triton module loads on first use) is a one-time cost, not graph memory, and
    is left out: counting it made an early estimate 4.8x too high. Afterwards `release()` (if
    given) must drop every reference to those graphs, so the pool returns to the device.
    """
    if not torch.cuda.is_available():
        return 0
    gc.collect()
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved()
    pool = graph_pool()
    try:
        capture_largest(pool)
        torch.cuda.synchronize()
        cost = torch.cuda.memory_reserved() - reserved_before
    finally:
        if release is not None:
            release()
        del pool
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    logger.info("graph memory measured on the largest capture: %.1f MiB", cost / 2**20)
    return max(0, cost)
