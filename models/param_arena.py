"""On a CPU, every parameter of a model placed in one anonymous mapping backed by huge pages.

Why: loading copies each checkpoint tensor into freshly allocated parameter memory, and the
first write to each 4 KiB page of it is a page fault: 137,000 for the 538 MB embedded checkpoint,
which on a virtual machine cost more than the copy itself. One mapping advised `MADV_HUGEPAGE`
takes 2 MiB pages where the kernel has them (transparent huge pages in "madvise" or "always"
mode): 6,500 faults for the whole load (`graphrunner bench load`, which also times the same load
into 4 KiB pages; docs/PERFORMANCE.md). A kernel short of free huge pages may compact memory
first (THP defrag), which can cost what the faults saved: compare both there. Where huge pages
are off, the mapping still works, with 4 KiB pages.

Parameters become views of the mapping (64-byte aligned, one per parameter, tied ones once); the
mapping is unmapped when the last of them is freed. Values are left as they were allocated
(zero): the caller loads or initialises them next.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

ALIGNMENT = 64


def place_parameters_in_arena(model: nn.Module) -> int:
    """Re-home `model`'s CPU parameters into one huge-page mapping; returns its size in bytes
    (0 when there is nothing to place)."""
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel() > 0]
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += -(-param.numel() * param.element_size() // ALIGNMENT) * ALIGNMENT
    if total == 0:
        return 0
    mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # a kernel without transparent huge pages: 4 KiB pages, still correct
            pass
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    for param, offset in zip(params, offsets):
        size = param.numel() * param.element_size()
        param.data = arena[offset:offset + size].view(param.dtype).view(param.shape)
    return total
