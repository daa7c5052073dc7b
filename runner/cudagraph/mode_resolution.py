"""Resolve the configured CUDA graph mode against the device and the attention backend.

The user asks for a mode; what can run depends on the device (graphs need CUDA) and on
how much of a forward the attention backend can live inside one FULL graph
(`AttentionCGSupport`). PIECEWISE never needs backend support: attention is a break
point that runs eagerly between graph segments. Every downgrade is logged once with its
reason, so a slower-than-expected run is never a silent surprise.
"""

from __future__ import annotations

import logging

from attention.backends.base import AttentionCGSupport
from configs.graph_mode import CUDAGraphMode

logger = logging.getLogger(__name__)

_M = CUDAGraphMode
# (support, requested) -> (resolved, why). Pairs not listed keep the requested mode.
_FALLBACKS: dict[tuple[AttentionCGSupport, CUDAGraphMode], tuple[CUDAGraphMode, str]] = {
    (AttentionCGSupport.UNIFORM_DECODE, _M.FULL): (
        _M.FULL_AND_PIECEWISE,
        "the backend's attention fits a FULL graph only for uniform-decode batches; "
        "mixed/prefill batches use PIECEWISE graphs"),
    (AttentionCGSupport.NEVER, _M.FULL): (
        _M.PIECEWISE, "the backend's attention cannot be captured in a FULL graph; attention runs eagerly"),
    (AttentionCGSupport.NEVER, _M.FULL_AND_PIECEWISE): (
        _M.PIECEWISE, "the backend's attention cannot be captured in a FULL graph; attention runs eagerly"),
    (AttentionCGSupport.NEVER, _M.FULL_DECODE_ONLY): (
        _M.NONE, "the backend's attention cannot be captured in a FULL graph and FULL_DECODE_ONLY "
                 "asks for no PIECEWISE graphs"),
}

_reported: set[tuple[CUDAGraphMode, AttentionCGSupport, str, CUDAGraphMode]] = set()
"""Fallbacks already logged: an engine re-resolves per runner (and per pipeline rank)."""


def resolve_cudagraph_mode(requested: CUDAGraphMode, backend_support: AttentionCGSupport,
                           device_type: str) -> CUDAGraphMode:
    """The mode the runner will actually use; logs (once per combination) when it differs."""
    if requested == _M.NONE:
        return _M.NONE
    if device_type != "cuda":
        resolved, why, level = _M.NONE, f"device is {device_type!r}; CUDA graphs need a CUDA device", logging.INFO
    elif (backend_support, requested) in _FALLBACKS:
        resolved, why = _FALLBACKS[(backend_support, requested)]
        level = logging.WARNING
    else:
        return requested
    key = (requested, backend_support, device_type, resolved)
    if key not in _reported:
        _reported.add(key)
        logger.log(level, "cudagraph_mode %s -> %s (attention backend support %s): %s",
                   requested.name, resolved.name, backend_support.name, why)
    return resolved
