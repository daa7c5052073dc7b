"""Attention backends by name."""

from __future__ import annotations

from attention.backends.base import AttentionBackend, AttentionCGSupport


def get_attention_backend(name: str) -> AttentionBackend:
    """`torch` (reference, CPU default) or `triton` (CUDA default)."""
    if name == "torch":
        from attention.backends.torch_sdpa import TorchSDPABackend
        return TorchSDPABackend()
    if name == "triton":
        from attention.backends.triton_paged import TritonPagedBackend
        return TritonPagedBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")


__all__ = ["AttentionBackend", "AttentionCGSupport", "get_attention_backend"]
