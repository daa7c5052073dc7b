"""The optional Triton kernels of the sampling stage, imported on first use."""

from __future__ import annotations

import functools
import importlib

import torch

from configs.kernel_config import active_kernel_config


@functools.cache
def triton_module(name: str):
    """`runner.<name>` (a module of Triton kernels, e.g. "sampling.race_kernel"), or None where
    Triton is not installed (it is optional: the torch ops are the CPU path and the reference)."""
    try:
        return importlib.import_module(f"runner.{name}")
    except ImportError:
        return None


def sampling_kernel(name: str, logits: torch.Tensor):
    """`triton_module(name)` where the GPU sampling kernels take these logits (CUDA, contiguous
    rows, KernelConfig.triton_sampling on), else None: the torch path."""
    if not (logits.is_cuda and logits.stride(1) == 1 and active_kernel_config().triton_sampling):
        return None
    return triton_module(name)


def aligned_width(n: int, itemsize: int) -> int:
    """Columns of a [fields, width] host upload that holds n entries of `itemsize` bytes per field,
    so that every field's row starts 16-byte aligned on the device (the first n columns are the
    entries). Why: Triton compiles a kernel variant per pointer alignment, and fields viewed at
    offsets of n entries made some batch sizes launch variants that start-up had not compiled."""
    step = 16 // itemsize
    return -(-max(n, 1) // step) * step
