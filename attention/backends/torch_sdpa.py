"""Paged attention in plain torch: the CPU backend and the reference for the Triton one.

Vectorised over requests: queries are gathered into [num_reqs, max_query_len] and keys
into [num_reqs, max_seq_len] (through the block table), one masked SDPA call covers
prefill with a cached prefix, chunked prefill and decode in the same batch. Shapes depend
on max_seq_len, so FULL graphs can't hold it (support NEVER); as a PIECEWISE break point
it runs eagerly between graph segments and is fine.
"""

from __future__ import annotations

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


class TorchSDPABackend(AttentionBackend):
    name = "torch"
    cudagraph_support = AttentionCGSupport.NEVER

    def forward(self, layer, query, key, value, out, kv_cache, metadata: CommonAttentionMetadata) -> None:
        num_reqs = metadata.num_reqs
        qsl = metadata.query_start_loc_cpu[: num_reqs + 1].long()
        query_lens = qsl[1:] - qsl[:-1]
        seq_lens = metadata.seq_lens_cpu[:num_reqs].long()
        actual = int(qsl[-1])
        if kv_cache is not None:
            write_kv(key[:actual], value[:actual], kv_cache, metadata.slot_mapping[:actual])
        if actual < out.shape[0]:
            out[actual:].zero_()
        if actual == 0:
            return
        device = query.device
        max_q = int(query_lens.max())
        max_kv = int(seq_lens.max()) if kv_cache is not None else max_q
        # Row r, column i of the padded query grid is token qsl[r] + i (when i < query_len).
        q_cols = torch.arange(max_q)
        q_valid = q_cols[None, :] < query_lens[:, None]
        q_index = torch.where(q_valid, qsl[:-1, None] + q_cols[None, :], 0)
        context_lens = (seq_lens - query_lens) if kv_cache is not None else torch.zeros_like(query_lens)
        q_pos = context_lens[:, None] + q_cols[None, :]
        kv_pos = torch.arange(max_kv)
        if kv_cache is not None:
            block_size = kv_cache.shape[2]
            table = metadata.block_table[:num_reqs, : (max_kv + block_size - 1) // block_size].long().cpu()
            kv_index = table[:, kv_pos // block_size] * block_size + kv_pos % block_size
            keys = kv_cache[0].view(-1, layer.num_kv_heads, layer.head_dim)
            values = kv_cache[1].view(-1, layer.num_kv_heads, layer.head_dim)
            kv_len = seq_lens
        else:
            kv_index = qsl[:-1, None] + kv_pos[None, :]
            kv_index = torch.where(kv_pos[None, :] < query_lens[:, None], kv_index, 0)
            keys, values, kv_len = key, value, query_lens
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < kv_len[:, None, None])
        q_index, kv_index, mask = q_index.to(device), kv_index.to(device), mask.to(device)
        q = query[q_index].transpose(1, 2)                  # [R, Hq, max_q, D]
        k = keys[kv_index].transpose(1, 2)                  # [R, Hkv, max_kv, D]
        v = values[kv_index].transpose(1, 2)
        if layer.num_heads != layer.num_kv_heads:
            group = layer.num_heads // layer.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=layer.scale)
        result = result.transpose(1, 2)                     # [R, max_q, Hq, D]
        out[:actual] = result[q_valid.to(device)]
