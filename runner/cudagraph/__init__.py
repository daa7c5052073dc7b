"""CUDA graphs: mode resolution, dispatch (keys, padding), breakable PIECEWISE capture,
the FULL/PIECEWISE wrappers, the capture phase and the address check."""

from runner.cudagraph.addresses import AddressCheck, AddressMismatchError, AddressRecorder, check_addresses, tensor_addresses
from launch.break_point import active_capture, break_point
from runner.cudagraph.breakable import (CUDA_GRAPHS, BreakableCapture, BreakableGraph, BreakRecord,
                                        CudaGraphFactory, GraphLike, prime_capture_stream)
from runner.cudagraph.capture import (CapturePhase, CaptureSummary, capture_all, graph_pool,
                                      measure_graph_memory)
from runner.cudagraph.dispatcher import BatchDescriptor, CudagraphDispatcher, default_capture_sizes
from runner.cudagraph.mode_resolution import resolve_cudagraph_mode
from runner.cudagraph.wrapper import CUDAGraphWrapper

__all__ = [
    "AddressCheck", "AddressMismatchError", "AddressRecorder", "BatchDescriptor", "BreakRecord", "BreakableCapture",
    "BreakableGraph", "CUDAGraphWrapper", "CUDA_GRAPHS", "CaptureSummary", "CapturePhase", "CudaGraphFactory",
    "CudagraphDispatcher", "GraphLike", "active_capture", "break_point", "capture_all", "check_addresses",
    "default_capture_sizes", "graph_pool", "measure_graph_memory",
    "prime_capture_stream", "resolve_cudagraph_mode", "tensor_addresses",
]
