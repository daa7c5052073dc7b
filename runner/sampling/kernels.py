"""The optional Triton kernels of the sampling stage, imported on first use."""

from __future__ import annotations

import functools
import importlib


@functools.cache
def triton_module(name: str):
    """`runner.<name>` (a module of Triton kernels, e.g. "sampling.race_kernel"), or None where
    Triton is not installed (it is optional: the torch ops are the CPU path and the reference)."""
    try:
        return importlib.import_module(f"runner.{name}")
    except ImportError:
        return None
