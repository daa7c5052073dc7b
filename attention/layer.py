"""The attention op every layer calls: RoPE, then a PIECEWISE break point that reads the forward context."""

from __future__ import annotations

import torch
from torch import nn

from attention.forward_context import get_forward_context
from launch.break_point import PreparedBreak, break_point


class Attention(nn.Module):
    """RoPE + paged attention of one layer. Holds no weights: q/k/v come from the layer's
    projections, the KV cache and metadata from the forward context (`cache_index` picks this
    layer's cache)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cache_index: int,
                 rotary: nn.Module, *, scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.sliding_window = sliding_window
        """A query at position p sees keys at positions p - sliding_window < k <= p (HF's sliding
        window: at most `sliding_window` keys, itself included); None: every earlier key."""
        self.logits_soft_cap = logits_soft_cap
        """Scores become cap * tanh(scores / cap) before the softmax (Gemma 2); None: as they are."""
        self.cache_index = cache_index
        self.rotary = rotary  # the model's one table, shared by every layer

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (not yet rotated) -> [T, Hq * D]. The output is allocated
        here, by the caller of the break point, so inside a PIECEWISE capture it lives in the pool.

        When the backend lets the layer write the cache (`kv_written_by_layer`), one fused kernel
        rotates q and k and writes k/v at the step's slots, before the break point: inside the
        graph segment, so PIECEWISE's eager part is the attention launch alone."""
        rotated = None
        cache = self.cache_written_here()
        if cache is not None:
            rotated = self.rotary.rotate_and_cache(positions, q, k, v, *cache)
        if rotated is not None:
            q, k, v = rotated, None, None
        else:
            q, k = self.rotary(positions, q, k)
        return self.attend_rotated(q, k, v)

    def cache_written_here(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this layer's kv_cache, the step's slot_mapping) when the layer, not the backend, writes
        the KV cache (a `kv_written_by_layer` backend, and a cache: not the profile run); else None."""
        context = get_forward_context()
        if context.kv_caches is None or not context.attn_backend.kv_written_by_layer:
            return None
        return context.kv_caches[self.cache_index], context.attn_metadata.slot_mapping

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor | None = None,
                       v: torch.Tensor | None = None) -> torch.Tensor:
        """The attention op on a rotated q [T, Hq, D] (k/v None: already in this layer's cache,
        written by `rotate_and_cache` or models/small_batch_kernels.norm_qkv_rope_cache) -> [T, Hq * D]."""
        out = torch.empty_like(q)
        attention_op(self, q, k, v, out=out)
        return out.view(q.shape[0], -1)


def _attention(layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               *, out: torch.Tensor) -> None:
    context = get_forward_context()
    kv_cache = None if context.kv_caches is None else context.kv_caches[layer.cache_index]
    context.attn_backend.forward(layer, query, key, value, out, kv_cache, context.attn_metadata)


def _prepare_attention_replay(layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              *, out: torch.Tensor) -> PreparedBreak | None:
    """The break's replay on its recorded inputs, when the backend offers a faster one than
    `_attention` (AttentionBackend.prepare_replay); else None."""
    context = get_forward_context()
    if context.kv_caches is None:
        return None
    kv_cache = context.kv_caches[layer.cache_index]
    return context.attn_backend.prepare_replay(layer, query, key, value, out, kv_cache)


attention_op = break_point(_attention, prepare_replay=_prepare_attention_replay)
"""The attention op every layer calls: a PIECEWISE break point (launch/break_point.py; the capture: runner/cudagraph/breakable.py)."""
