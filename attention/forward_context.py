"""The forward context: what the attention op of every layer reads during one forward.

The model's forward signature stays `(input_ids, positions)`; the per-step state
(attention metadata, KV caches, graph mode) travels here instead. This is what lets a
PIECEWISE graph replay a *new* step's metadata: the eager attention segments read the
context that is current at replay time, not the one seen at capture.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from configs.graph_mode import CUDAGraphMode


@dataclass
class ForwardContext:
    attn_metadata: Any | None
    """Backend metadata for this step; None only for a forward with no KV cache."""
    kv_caches: list[torch.Tensor] | None
    """One tensor per local layer, [2, num_blocks, block_size, num_kv_heads, head_dim]; None in the profile run."""
    attn_backend: Any
    """The `AttentionBackend` instance whose `forward` the attention op calls."""
    runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: Any | None = None


_state = threading.local()


def get_forward_context() -> ForwardContext:
    context = getattr(_state, "context", None)
    if context is None:
        raise RuntimeError("attention ran outside set_forward_context(): no metadata for this forward")
    return context


def current_runtime_mode() -> CUDAGraphMode:
    """The graph mode of the forward in progress; NONE (eager) outside any forward context."""
    context = getattr(_state, "context", None)
    return CUDAGraphMode.NONE if context is None else context.runtime_mode


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    previous = getattr(_state, "context", None)
    _state.context = context
    try:
        yield context
    finally:
        _state.context = previous
