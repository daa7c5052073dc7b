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
