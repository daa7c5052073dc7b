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
from attention.kernels.unified_attention import causal_attention_no_cache, unified_attention
from attention.metadata import CommonAttentionMetadata


class TritonPagedBackend(AttentionBackend):
    name: ClassVar[str] = "triton"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def build_metadata(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """The kernels read the common tensors directly: nothing to derive, nothing to copy."""
        return common

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                out: torch.Tensor, kv_cache: torch.Tensor | None, metadata: Any) -> None:
        if kv_cache is None:
            # Profile run: eager only, so host offsets are fine; no metadata means one request.
            if metadata is not None:
                query_start_loc_cpu = metadata.query_start_loc_cpu
            else:
                query_start_loc_cpu = torch.tensor([0, query.shape[0]], dtype=torch.int32)
            causal_attention_no_cache(query, key, value, out, query_start_loc_cpu, layer.scale)
            return
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        unified_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                          metadata.block_table, layer.scale)
