"""The attention backend interface and its declared CUDA-graph support."""

from __future__ import annotations

import abc
import enum
from typing import Any, ClassVar

import torch

from attention.metadata import CommonAttentionMetadata
from launch.break_point import PreparedBreak


class AttentionCGSupport(enum.Enum):
    """How much of a forward a backend's attention can be captured in a FULL graph."""

    ALWAYS = "ALWAYS"
    """Any batch, prefill and mixed included: the launch depends only on padded shapes."""
    UNIFORM_DECODE = "UNIFORM_DECODE"
    """Only batches where every request adds one token."""
    NEVER = "NEVER"
    """Never inside a FULL graph (it may still run as a PIECEWISE break point)."""


class AttentionBackend(abc.ABC):
    """One attention implementation: builds its metadata and runs the op for a layer.

    `forward` writes the result into `out` (a caller-provided buffer): inside a
    PIECEWISE capture a freshly allocated result would live outside the graph pool.
    """

    name: ClassVar[str]
    cudagraph_support: ClassVar[AttentionCGSupport]
    kv_written_by_layer: ClassVar[bool] = False
    """True if `forward` accepts key/value None, meaning the layer has already written this step's
    (rotated) keys and values at metadata.slot_mapping, as the fused RoPE + KV-write kernel does."""

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Backend metadata for one step; must only hold views of `common`'s tensors
        (plus per-step Python ints) so that FULL graphs see fixed addresses."""
        return common

    @abc.abstractmethod
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                out: torch.Tensor, kv_cache: torch.Tensor | None, metadata: Any) -> None:
        """query [T, Hq, D], key/value [T, Hkv, D], out [T, Hq, D]. With a KV cache:
        write key/value at metadata.slot_mapping (-1 skips; key/value None: already written, see
        `kv_written_by_layer`), then attend over the cache.
        Without one (profile run): causal attention within each request's new tokens."""

    def prepare_replay(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                       out: torch.Tensor, kv_cache: torch.Tensor) -> PreparedBreak | None:
        """A PIECEWISE break's replay of `forward` on these recorded tensors, faster than the generic call
        (launch/break_point.py: what it may offer, a step graph included), or None: the generic call."""
        return None
