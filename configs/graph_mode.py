"""CUDA graph modes: what the user asks for, and what a single forward runs as.

`NONE`, `PIECEWISE` and `FULL` are *runtime* modes: one forward runs eagerly, as a
breakable piecewise graph, or as one full graph. `FULL_DECODE_ONLY` and
`FULL_AND_PIECEWISE` are *configured* modes that pick a runtime mode per batch:
one for uniform-decode batches and one for everything else (mixed/prefill).
"""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    def decode_mode(self) -> "CUDAGraphMode":
        """Runtime mode for a uniform-decode batch (every request adds one token)."""
        if self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
            return CUDAGraphMode.FULL
        return self

    def mixed_mode(self) -> "CUDAGraphMode":
        """Runtime mode for any other batch (prefill, chunked prefill, mixed)."""
        return {
            CUDAGraphMode.NONE: CUDAGraphMode.NONE,
            CUDAGraphMode.PIECEWISE: CUDAGraphMode.PIECEWISE,
            CUDAGraphMode.FULL: CUDAGraphMode.FULL,
            CUDAGraphMode.FULL_DECODE_ONLY: CUDAGraphMode.NONE,
            CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.PIECEWISE,
        }[self]

    def has_full(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())

    def is_runtime_mode(self) -> bool:
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

    def runtime_modes(self) -> tuple["CUDAGraphMode", ...]:
        """The runtime modes this configured mode can produce, graph modes only."""
        modes = {self.decode_mode(), self.mixed_mode()} - {CUDAGraphMode.NONE}
        return tuple(sorted(modes, key=lambda m: m.value))
