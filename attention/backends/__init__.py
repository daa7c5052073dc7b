"""Attention backends by name."""

from __future__ import annotations

from attention.backends.base import AttentionBackend, AttentionCGSupport
from configs.kernel_config import KernelConfig


def get_attention_backend(name: str, kernel: KernelConfig | None = None) -> AttentionBackend:
    """`torch` (reference, CPU default) or `triton` (CUDA default), with the switches of `kernel` that
    the backend owns (default: KernelConfig's defaults)."""
    if name == "torch":
        from attention.backends.torch_sdpa import TorchSDPABackend
        return TorchSDPABackend(dense_kv=(kernel or KernelConfig()).torch_dense_kv)
    if name == "triton":
        from attention.backends.triton_paged import TritonPagedBackend
        return TritonPagedBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")


__all__ = ["AttentionBackend", "AttentionCGSupport", "get_attention_backend"]
