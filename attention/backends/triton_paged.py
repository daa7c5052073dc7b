"""The Triton paged-attention backend (the CUDA default): KV write + one unified attention launch.

It declares `ALWAYS` graph support because both launches have grids that depend only on padded
shapes and read every per-step value (slots, query offsets, seq lens, block table) from the
metadata tensors: a FULL graph captured for a BatchDescriptor replays any batch padded to it,
prefill and mixed batches included. The split-KV count is chosen from padded shapes too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from attention.backends.base import AttentionBackend, AttentionCGSupport
from attention.kernels.kv_write import write_kv
from attention.backends.torch_sdpa import TorchSDPABackend
from attention.kernels.unified_attention import unified_attention
from attention.metadata import CommonAttentionMetadata


_PROFILE_BACKEND = TorchSDPABackend()


class TritonPagedBackend(AttentionBackend):
    name: ClassVar[str] = "triton"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def build_metadata(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """The kernels read the common tensors directly: nothing to derive, nothing to copy."""
        return common

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                out: torch.Tensor, kv_cache: torch.Tensor | None, metadata: Any) -> None:
        if kv_cache is None:
            # Profile run (never captured): the torch reference's causal attention within requests.
            _PROFILE_BACKEND.forward(layer, query, key, value, out, None, metadata)
            return
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        unified_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                          metadata.block_table, layer.scale)
