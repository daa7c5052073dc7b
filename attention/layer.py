"""The attention op every layer calls: a PIECEWISE break point that reads the forward context."""

from __future__ import annotations

import torch
from torch import nn

from attention.forward_context import get_forward_context
from runner.cudagraph.breakable import break_point


class Attention(nn.Module):
    """Paged attention of one layer. Holds no weights: q/k/v come from the layer's projections,
    the KV cache and metadata from the forward context (`cache_index` picks this layer's cache)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cache_index: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.cache_index = cache_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]. The output is allocated here, by the
        caller of the break point, so inside a PIECEWISE capture it lives in the graph pool."""
        out = torch.empty_like(q)
        attention_op(self, q, k, v, out=out)
        return out.view(q.shape[0], -1)


@break_point
def attention_op(layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 *, out: torch.Tensor) -> None:
    context = get_forward_context()
    kv_cache = None if context.kv_caches is None else context.kv_caches[layer.cache_index]
    context.attn_backend.forward(layer, query, key, value, out, kv_cache, context.attn_metadata)
