"""Copying checkpoint tensors into parameters: straight, or through pinned buffers to a GPU.

Every weight_loader ends in `copy_weight(dest, src)`. On a CPU, and whenever no staging is active,
that is `dest.copy_(src)`: one pass that also converts the dtype when the checkpoint's differs.

To a GPU, a plain `dest.copy_(mapped_view)` is a synchronous copy from pageable memory: the
driver bounces it through its own small pinned buffer, one tensor at a time, and the host waits
for each. Inside `staged_copies(device)` a same-dtype contiguous tensor instead goes in chunks
through a few pinned buffers of our own: the host copies chunk i+1 from the mapped file into one
buffer (torch's copy, on all intra-op threads) while the DMA engine moves chunk i from another to
the device (`non_blocking`), on the current stream, so later work on the weights is ordered after
it. A buffer is reused once the event recorded after its last transfer has completed. Whatever
does not fit that pattern (a dtype conversion, a strided tensor-parallel slice) takes the plain
copy, which stays correct. `graphrunner bench load --device cuda` compares both.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

STAGING_BUFFER_BYTES = 32 * 2**20
STAGING_BUFFERS = 3


class PinnedStager:
    """Host -> device copies through `buffers` pinned host buffers of `buffer_bytes` each
    (`pin=False`: plain host buffers, which lets a CPU test run the same chunking)."""

    def __init__(self, device: torch.device, buffer_bytes: int = STAGING_BUFFER_BYTES,
                 buffers: int = STAGING_BUFFERS, pin: bool = True) -> None:
        self.device = device
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(buffers)]
        self.events: list[torch.cuda.Event | None] = [None] * buffers
        self.next = 0
        self.staged_bytes = 0
        """Bytes that went through the buffers (the rest took the plain copy)."""

    def eligible(self, dest: torch.Tensor, src: torch.Tensor) -> bool:
        return (src.device.type == "cpu" and dest.dtype == src.dtype
                and dest.shape == src.shape and dest.is_contiguous() and src.is_contiguous()
                and src.numel() > 0)

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        if not self.eligible(dest, src):
            dest.copy_(src)
            return
        source, target = _bytes(src), _bytes(dest)
        chunk = self.buffers[0].numel()
        for start in range(0, source.numel(), chunk):
            stop = min(start + chunk, source.numel())
            index, self.next = self.next, (self.next + 1) % len(self.buffers)
            if self.events[index] is not None:
                self.events[index].synchronize()   # its previous transfer is done: safe to overwrite
            buffer = self.buffers[index][: stop - start]
            buffer.copy_(source[start:stop])
            target[start:stop].copy_(buffer, non_blocking=True)
            if dest.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self.events[index] = event
        self.staged_bytes += source.numel()

    def finish(self) -> None:
        """Wait until every staged transfer has landed (the buffers may then be freed)."""
        for event in self.events:
            if event is not None:
                event.synchronize()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as flat bytes (a view, no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


_active: contextvars.ContextVar[PinnedStager | None] = contextvars.ContextVar("weight_stager", default=None)


def copy_weight(dest: torch.Tensor, src: torch.Tensor) -> None:
    """`dest.copy_(src)`, through the active stager when one is (see the module docstring)."""
    stager = _active.get()
    if stager is None:
        dest.copy_(src)
    else:
        stager.copy(dest, src)


@contextlib.contextmanager
def staged_copies(stager: PinnedStager | None) -> Iterator[PinnedStager | None]:
    """Route copy_weight through `stager` for the block (None: plain copies), then wait for it."""
    token = _active.set(stager)
    try:
        yield stager
    finally:
        _active.reset(token)
        if stager is not None:
            stager.finish()
