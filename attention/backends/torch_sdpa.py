"""Paged attention in plain torch: the CPU backend and the reference for the Triton one.

Vectorised over requests: queries are gathered into [num_reqs, max_query_len] and keys into
[num_reqs, max_seq_len] (whole blocks at a time, through the block table); one masked SDPA
call covers prefill with a cached prefix, chunked prefill and decode in the same batch, with
GQA handled by SDPA itself (no repeated K/V). The gather indices and the mask depend only on
the step, so they are built once per step (on the first layer) and shared by every layer.
Shapes depend on max_seq_len, so FULL graphs can't hold it (support NEVER); as a PIECEWISE
break point it runs eagerly between graph segments and is fine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attention.backends.base import AttentionBackend, AttentionCGSupport
from attention.metadata import CommonAttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values into their slots; slot -1 (padded rows) is skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0].index_copy_(0, slots, key[valid])
    flat[1].index_copy_(0, slots, value[valid])


@dataclass
class _StepLayout:
    """Where each query and key of the step sits in the padded [request, position] grid."""
    actual: int
    q_index: torch.Tensor      # [R, max_q] token row of each query slot (0 where padded)
    q_valid: torch.Tensor      # [R, max_q] bool
    mask: torch.Tensor         # [R, 1, max_q, max_kv] additive: 0 where causal and within seq_len, else -inf
    kv_blocks: torch.Tensor | None  # [R, blocks] block ids to gather (cache path)
    kv_index: torch.Tensor | None   # [R, max_kv] token rows of the step's own keys (no-cache path)


@dataclass
class TorchSDPAMetadata:
    common: CommonAttentionMetadata
    layouts: dict = field(default_factory=dict)
    """(has_cache, block_size) -> _StepLayout, filled by the first layer of the step."""

    def __getattr__(self, name: str):
        """The common fields read through (`metadata.uniform_decode`); guarded so that a copy
        made without __init__ (copy, pickle) raises instead of recursing."""
        if name == "common":
            raise AttributeError(name)
        return getattr(self.common, name)


def _layout(common: CommonAttentionMetadata, block_size: int | None, device: torch.device,
            dtype: torch.dtype) -> _StepLayout:
    num_reqs = common.num_reqs
    qsl = common.query_start_loc_cpu[: num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = common.seq_lens_cpu[:num_reqs].long()
    actual = int(qsl[-1])
    max_q = int(query_lens.max()) if num_reqs else 0
    q_cols = torch.arange(max_q)
    q_valid = q_cols[None, :] < query_lens[:, None]
    q_index = torch.where(q_valid, qsl[:-1, None] + q_cols[None, :], 0)
    if block_size is not None:
        max_kv = int(seq_lens.max()) if num_reqs else 0
        blocks = -(-max_kv // block_size)
        max_kv = blocks * block_size
        kv_blocks = common.block_table[:num_reqs, :blocks].long()
        kv_index, context, kv_len = None, seq_lens - query_lens, seq_lens
    else:
        max_kv = max_q
        kv_blocks, context, kv_len = None, torch.zeros_like(query_lens), query_lens
        kv_index = q_index.to(device)
    kv_pos = torch.arange(max_kv)
    q_pos = context[:, None] + q_cols[None, :]
    allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < kv_len[:, None, None])
    # Additive float mask, built once: SDPA would otherwise convert a bool mask in every layer.
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return _StepLayout(actual, q_index.to(device), q_valid.to(device), mask[:, None].to(device),
                       kv_blocks, kv_index)


def _rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`source[index]` for a 2-D index over source's first dimension."""
    return source.index_select(0, index.reshape(-1)).view(*index.shape, *source.shape[1:])


class TorchSDPABackend(AttentionBackend):
    name = "torch"
    cudagraph_support = AttentionCGSupport.NEVER

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        return TorchSDPAMetadata(common)

    def forward(self, layer, query, key, value, out, kv_cache, metadata) -> None:
        if not isinstance(metadata, TorchSDPAMetadata):
            metadata = TorchSDPAMetadata(metadata)
        block_size = None if kv_cache is None else kv_cache.shape[2]
        layout = metadata.layouts.get(block_size)
        if layout is None:
            layout = metadata.layouts[block_size] = _layout(metadata.common, block_size, query.device, query.dtype)
        actual = layout.actual
        if kv_cache is not None:
            write_kv(key[:actual], value[:actual], kv_cache, metadata.common.slot_mapping[:actual])
        if actual < out.shape[0]:
            out[actual:].zero_()
        if actual == 0:
            return
        # index_select on flattened indices: about twice as fast on a CPU as advanced indexing.
        q = _rows(query, layout.q_index).transpose(1, 2)                  # [R, Hq, max_q, D]
        if kv_cache is not None:
            num_reqs, blocks = layout.kv_blocks.shape
            shape = (num_reqs, blocks * kv_cache.shape[2], layer.num_kv_heads, layer.head_dim)
            k = _rows(kv_cache[0], layout.kv_blocks).view(shape).transpose(1, 2)  # [R, Hkv, max_kv, D]
            v = _rows(kv_cache[1], layout.kv_blocks).view(shape).transpose(1, 2)
        else:
            k = _rows(key, layout.kv_index).transpose(1, 2)
            v = _rows(value, layout.kv_index).transpose(1, 2)
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, scale=layer.scale,
                                                enable_gqa=layer.num_heads != layer.num_kv_heads)
        out[:actual] = result.transpose(1, 2)[layout.q_valid]
