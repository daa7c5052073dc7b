"""The Triton paged-attention backend (the CUDA default): KV write + one unified attention launch
(the KV write is usually done by the layer, fused with RoPE: `kv_written_by_layer`).

It declares `ALWAYS` graph support because both launches have grids that depend only on padded
shapes and read every per-step value (slots, query offsets, seq lens, block table) from the
metadata tensors: a FULL graph captured for a BatchDescriptor replays any batch padded to it,
prefill and mixed batches included. Inside a FULL graph the split-KV count is chosen from padded
shapes too.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from attention.backends.base import AttentionBackend, AttentionCGSupport
from attention.forward_context import current_runtime_mode, get_forward_context
from attention.kernels.kv_write import write_kv
from attention.backends.torch_sdpa import TorchSDPABackend
from attention.kernels.unified_attention import StepAttention, interned_layer_key, unified_attention
from attention.metadata import CommonAttentionMetadata
from configs.graph_mode import CUDAGraphMode
from launch.break_point import PreparedBreak, StepBinder, StepGraphLink, StepLaunch


_PROFILE_BACKEND = TorchSDPABackend()


class TritonPagedBackend(AttentionBackend):
    name: ClassVar[str] = "triton"
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    kv_written_by_layer: ClassVar[bool] = True

    def __init__(self) -> None:
        self._step: tuple[CommonAttentionMetadata, StepAttention] | None = None

    def build_metadata(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """The kernels read the common tensors directly: nothing to derive, nothing to copy."""
        return common

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                out: torch.Tensor, kv_cache: torch.Tensor | None, metadata: Any) -> None:
        if kv_cache is None:
            # Profile run (never captured): the torch reference's causal attention within requests.
            _PROFILE_BACKEND.forward(layer, query, key, value, out, None, metadata)
            return
        if key is not None:
            write_kv(key, value, kv_cache, metadata.slot_mapping)
        # A FULL graph freezes the launch, so only padded shapes may pick the split count; an eager
        # call (NONE, or a PIECEWISE break) can fit it to this step's longest context, and the
        # step's layers share one bound launch (StepAttention: less host time per layer).
        if current_runtime_mode() == CUDAGraphMode.FULL:
            unified_attention(query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens,
                              metadata.block_table, layer.scale, sliding_window=_window(layer),
                              soft_cap=_soft_cap(layer))
            return
        self._step_attention(metadata)(query, kv_cache, out, layer.scale, _window(layer), _soft_cap(layer))

    def prepare_replay(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                       out: torch.Tensor, kv_cache: torch.Tensor) -> PreparedBreak | None:
        """A PIECEWISE break's replay (`attention.layer._prepare_attention_replay`): the recorded q
        and out never change, so their `layer_key` and the three addresses are computed here,
        once; each replay then only looks up the step's StepAttention. Generic (None) when the
        layer leaves the KV write to the backend (key given). Each joins a step graph of this backend's
        breaks (`step_graph_binder`), patched with its q, KV cache and out addresses."""
        if key is not None:
            return None
        replay = _BreakReplay(self, layer, query, out, kv_cache)
        return PreparedBreak(replay, StepGraphLink(self, replay.patched))

    def step_graph_binder(self, replays: Sequence[Any]) -> StepBinder | None:
        """For the PIECEWISE step graph (runner/cudagraph/step_graph.py): given one graph's break
        replays (all this backend's), a per-step `bind()` that plans the step's attention launch on
        the first break's recorded tensors WITHOUT launching it (the step graph launches every layer)
        and returns it in driver form with its stream, or None (then the step replays from Python):
        a FULL context, another KV cache than captured, no compiled kernel for the step's launch
        yet, a launch that needs a second kernel or has no driver form. None when the breaks' layer
        keys differ (no step could then share one launch). `replays`: the `_BreakReplay`s this backend's
        `prepare_replay` made."""
        if not all(isinstance(r, _BreakReplay) and r.backend is self for r in replays):
            return None
        key = replays[0].key
        if any(r.key is not key for r in replays):
            return None
        caches = [(r.index, r.kv_cache) for r in replays]
        first = replays[0]

        def bind() -> StepLaunch | None:
            context = get_forward_context()
            if context.runtime_mode == CUDAGraphMode.FULL:
                return None
            current = context.kv_caches
            for index, cache in caches:
                if current[index] is not cache:
                    return None
            step = self._step_attention(context.attn_metadata)
            if not step.bind_without_launch(key, first.query, first.kv_cache, first.out, first.scale):
                return None
            return step.native_launch(key)

        return bind

    def _step_attention(self, metadata: CommonAttentionMetadata) -> StepAttention:
        """The StepAttention of this step: made by its first layer, kept while the metadata object
        (one per step) is the same."""
        step = self._step
        if step is None or step[0] is not metadata:
            step = self._step = (metadata, StepAttention(metadata.query_start_loc, metadata.seq_lens,
                                                         metadata.block_table, metadata.max_seq_len,
                                                         metadata.max_query_len))
        return step[1]


def _window(layer: Any) -> int | None:
    """The layer's sliding window (attention.layer.Attention), None for layers that have none."""
    return getattr(layer, "sliding_window", None)


def _soft_cap(layer: Any) -> float | None:
    return getattr(layer, "logits_soft_cap", None)


class _BreakReplay:
    """One PIECEWISE attention break's replay (see `TritonPagedBackend.prepare_replay`); `patched`: its q,
    KV cache and out addresses."""

    __slots__ = ("backend", "layer", "query", "out", "kv_cache", "index", "scale", "key", "patched")

    def __init__(self, backend: TritonPagedBackend, layer: Any, query: torch.Tensor, out: torch.Tensor,
                 kv_cache: torch.Tensor) -> None:
        self.backend, self.layer, self.query, self.out, self.kv_cache = backend, layer, query, out, kv_cache
        self.index, self.scale = layer.cache_index, layer.scale
        self.key = interned_layer_key(query, kv_cache, out, self.scale, _window(layer), _soft_cap(layer))
        self.patched = (query.data_ptr(), kv_cache.data_ptr(), out.data_ptr())

    def __call__(self) -> None:
        context = get_forward_context()
        metadata, cache = context.attn_metadata, context.kv_caches[self.index]
        if cache is not self.kv_cache or context.runtime_mode == CUDAGraphMode.FULL:   # not what was captured
            self.backend.forward(self.layer, self.query, None, None, self.out, cache, metadata)
            return
        self.backend._step_attention(metadata).call_addressed(self.key, self.patched, self.query, cache,
                                                              self.out, self.scale)
