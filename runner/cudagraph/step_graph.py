"""A PIECEWISE replay as one CUDA graph: the segments as child graphs, the attention as kernel nodes
re-parameterised for each step.

Why: a PIECEWISE replay of a 30-layer model is, per layer, one graph-segment replay and one eager
attention launch. From Python each pair costs ~15 µs of host time on an H100's host
(`graphrunner bench break_replay`: its "fast" variant spends ~530 µs a SmolLM2 bs1 step inside the
replay, 30 layers; the step graph ~130 µs), and even a C loop of `cuGraphLaunch` plus
`cuLaunchKernelEx` per layer costs several µs a layer: more than the GPU spends on a decode layer
of a small model, so the GPU waits for the host. The attention of
a step differs between layers only in three pointers (q, its KV cache, out), and between steps only
in the grid and a few scalars (token and request counts, the split count), which a decode step at a
steady batch keeps. So the segments (captured as before, kept as graphs) and one kernel node per
attention make one graph; a step whose attention launch equals the one the nodes hold launches it
with one driver call, and a step that differs first re-parameterises the nodes
(`cuGraphExecKernelNodeSetParams`, function included). The attention still reads the CURRENT step's
metadata and still handles any batch composition: its launch is planned from this step's forward
context (unified_attention.StepAttention), as an eager launch would be.

Pieces:
- the step's attention launch in driver form comes from launch/driver_launch.py;
- `library()`: a small C file compiled once with the system C compiler against the `cuda.h` that
  ships with Triton (as Triton builds its own launchers), cached by source hash, loaded with
  ctypes; None (logged once, with why) where there is no CUDA driver, compiler or header;
- `StepGraph`: one BreakableGraph's graph, built at its first replay that offers a launch in driver
  form; `run(launch, stream)` updates it when needed and launches it.

What this skips of `torch.cuda.CUDAGraph.replay`: the per-replay RNG prologue (model segments draw
no random numbers; sampling runs outside the graphs). The kernel nodes carry no PDL attribute (the
kernel's wait is then a no-op). CompilationConfig.step_graph=False keeps every replay in Python (the
capture then never asks for a step graph, runner/cudagraph/breakable.py).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import weakref
from pathlib import Path
from typing import Any, Sequence

from launch import native_build
from launch.driver_launch import PATCHED_ARGS, KernelLaunch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include "cuda.h"

typedef CUresult (*graph_create_t)(CUgraph*, unsigned int);
typedef CUresult (*add_child_t)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, CUgraph);
typedef CUresult (*add_kernel_t)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, const CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*instantiate_t)(CUgraphExec*, CUgraph, unsigned long long);
typedef CUresult (*exec_set_t)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS_v2*);
typedef CUresult (*exec_destroy_t)(CUgraphExec);
typedef CUresult (*graph_destroy_t)(CUgraph);
typedef CUresult (*graph_launch_t)(CUgraphExec, CUstream);
static graph_create_t graph_create;
static add_child_t add_child;
static add_kernel_t add_kernel;
static instantiate_t instantiate;
static exec_set_t exec_set;
static exec_destroy_t exec_destroy;
static graph_destroy_t graph_destroy;
static graph_launch_t graph_launch;

/* 0 when libcuda's entry points are found. */
int gr_init(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return 1;
  graph_create = (graph_create_t)dlsym(lib, "cuGraphCreate");
  add_child = (add_child_t)dlsym(lib, "cuGraphAddChildGraphNode");
  add_kernel = (add_kernel_t)dlsym(lib, "cuGraphAddKernelNode_v2");
  instantiate = (instantiate_t)dlsym(lib, "cuGraphInstantiateWithFlags");
  exec_set = (exec_set_t)dlsym(lib, "cuGraphExecKernelNodeSetParams_v2");
  exec_destroy = (exec_destroy_t)dlsym(lib, "cuGraphExecDestroy");
  graph_destroy = (graph_destroy_t)dlsym(lib, "cuGraphDestroy");
  graph_launch = (graph_launch_t)dlsym(lib, "cuGraphLaunch");
  return (graph_create && add_child && add_kernel && instantiate && exec_set && exec_destroy && graph_destroy
          && graph_launch) ? 0 : 2;
}

/* Kernel i's node parameters: config = grid x, y, z, threads per block, shared bytes; the first p
   parameter slots get layer i's values (the driver copies the parameters when it takes them). */
static void node_params(CUDA_KERNEL_NODE_PARAMS_v2* kp, uint64_t function, const uint32_t* config, void** params,
                        uint64_t* slots, const uint64_t* values, int p, int i) {
  for (int k = 0; k < p; ++k) slots[k] = values[i * p + k];
  memset(kp, 0, sizeof *kp);
  kp->func = (CUfunction)function;
  kp->gridDimX = config[0]; kp->gridDimY = config[1]; kp->gridDimZ = config[2];
  kp->blockDimX = config[3]; kp->blockDimY = 1; kp->blockDimZ = 1;
  kp->sharedMemBytes = config[4];
  kp->kernelParams = params;
}

/* One graph: child graph 0, kernel 0, child graph 1, ..., child graph n, in a chain; instantiated.
   out: [0] the executable, [1] the graph, [2 + i] kernel i's node. Returns 0, or
   (step << 16) | CUresult of the first failure. */
int gr_step_graph(int n, const uint64_t* graphs, uint64_t function, const uint32_t* config, void** params,
                  uint64_t* slots, const uint64_t* values, int p, uint64_t* out) {
  CUgraph graph;
  CUgraphNode prev, node;
  CUgraphExec exec;
  CUDA_KERNEL_NODE_PARAMS_v2 kp;
  CUresult r = graph_create(&graph, 0);
  if (r != CUDA_SUCCESS) return (1 << 16) | (int)r;
  r = add_child(&prev, graph, NULL, 0, (CUgraph)graphs[0]);
  for (int i = 0; i < n && r == CUDA_SUCCESS; ++i) {
    node_params(&kp, function, config, params, slots, values, p, i);
    r = add_kernel(&node, graph, &prev, 1, &kp);
    if (r != CUDA_SUCCESS) break;
    out[2 + i] = (uint64_t)node;
    r = add_child(&prev, graph, &node, 1, (CUgraph)graphs[i + 1]);
  }
  if (r != CUDA_SUCCESS) { graph_destroy(graph); return (2 << 16) | (int)r; }
  r = instantiate(&exec, graph, 0);
  if (r != CUDA_SUCCESS) { graph_destroy(graph); return (3 << 16) | (int)r; }
  out[0] = (uint64_t)exec;
  out[1] = (uint64_t)graph;
  return 0;
}

/* Every kernel node of an instantiated step graph gets this launch (function, grid, parameters). */
int gr_step_update(const uint64_t* handles, int n, uint64_t function, const uint32_t* config, void** params,
                   uint64_t* slots, const uint64_t* values, int p) {
  CUDA_KERNEL_NODE_PARAMS_v2 kp;
  for (int i = 0; i < n; ++i) {
    node_params(&kp, function, config, params, slots, values, p, i);
    CUresult r = exec_set((CUgraphExec)handles[0], (CUgraphNode)handles[2 + i], &kp);
    if (r != CUDA_SUCCESS) return (4 << 16) | (int)r;
  }
  return 0;
}

int gr_step_launch(uint64_t exec, uint64_t stream) {
  CUresult r = graph_launch((CUgraphExec)exec, (CUstream)stream);
  return r == CUDA_SUCCESS ? 0 : (5 << 16) | (int)r;
}

void gr_step_destroy(uint64_t exec, uint64_t graph) {
  exec_destroy((CUgraphExec)exec);
  graph_destroy((CUgraph)graph);
}
"""


def cuda_header_dir() -> Path | None:
    """The directory of the `cuda.h` Triton ships for its own launchers, or None."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    include = Path(nvidia.__file__).parent / "include"
    return include if (include / "cuda.h").is_file() else None


def build_library(include: Path, cc: str, out_dir: Path | None = None) -> Path:
    """Compile the step-graph functions into a shared library (once per source and header: cached by their hash)."""
    return native_build.compile_shared("step_graph", _SOURCE, cc, ["-O2", "-I", str(include)], libs=("-ldl",),
                          key=(include / "cuda.h").read_bytes(), out_dir=out_dir)


_library: Any = None
_library_tried = False


def library() -> Any | None:
    """The loaded step-graph functions (ctypes), or None where it cannot run here (logged once, with why)."""
    global _library, _library_tried
    if _library_tried:
        return _library
    _library_tried = True
    include, cc = cuda_header_dir(), native_build.compiler()
    if include is None or cc is None:
        logger.info("PIECEWISE replays stay in Python: %s", "no cuda.h from Triton" if include is None else "no C compiler")
        return None
    try:
        lib = ctypes.CDLL(str(build_library(include, cc)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("PIECEWISE replays stay in Python: building it failed: %s", detail)
        return None
    if lib.gr_init() != 0:
        logger.info("PIECEWISE replays stay in Python: no CUDA driver (libcuda.so.1)")
        return None
    u64, u64p, u32p, vp, i = (ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                              ctypes.c_void_p, ctypes.c_int)
    lib.gr_step_graph.argtypes = [i, u64p, u64, u32p, vp, u64p, u64p, i, u64p]
    lib.gr_step_update.argtypes = [u64p, i, u64, u32p, vp, u64p, u64p, i]
    lib.gr_step_launch.argtypes = [u64, u64]
    lib.gr_step_destroy.argtypes = [u64, u64]
    for name in ("gr_step_graph", "gr_step_update", "gr_step_launch"):
        getattr(lib, name).restype = i
    lib.gr_step_destroy.restype = None
    _library = lib
    return lib


def kept_graph(segment: Any) -> int | None:
    """A captured torch.cuda.CUDAGraph's `cudaGraph_t` (kept: `keep_graph=True`), or None (a fake, a
    graph not kept, or a torch without `raw_cuda_graph`)."""
    raw = getattr(segment, "raw_cuda_graph", None)
    if raw is None:
        return None
    try:
        return int(raw()) or None
    except (RuntimeError, TypeError):
        return None


_FAILED_AT = {1: "creating the step graph", 2: "adding its nodes", 3: "instantiating it",
              4: "updating its attention nodes", 5: "launching it"}


def _check(status: int) -> None:
    if status:
        where, code = status >> 16, status & 0xFFFF
        raise RuntimeError(f"PIECEWISE step graph: the CUDA driver failed {_FAILED_AT.get(where, where)} "
                           f"(CUresult {code})")


class StepGraph:
    """One BreakableGraph's segments and attention launches as ONE CUDA graph: child graph 0,
    attention 0, child graph 1, ..., child graph n, built at the first step that offers a launch in
    driver form. `run(launch, stream)` re-parameterises the attention nodes only when the step's
    launch differs from the one they hold (function, grid or any parameter: a decode step at the
    same batch size and split count leaves them as they are) and launches the graph: one driver
    call for the whole forward instead of a replay and a launch per layer. `functions` is the C
    library (or a fake with its functions, in tests)."""

    def __init__(self, graphs: Sequence[int], patched: Sequence[Sequence[int]], functions: Any) -> None:
        if len(graphs) != len(patched) + 1 or any(len(p) != PATCHED_ARGS for p in patched):
            raise ValueError(f"{len(graphs)} segments for {len(patched)} attention launches")
        self.count = len(patched)
        self.graphs = (ctypes.c_uint64 * len(graphs))(*graphs)
        self.values = (ctypes.c_uint64 * (PATCHED_ARGS * len(patched)))(*(v for p in patched for v in p))
        self.handles = (ctypes.c_uint64 * (2 + len(patched)))()
        """After the build: the executable, the graph, then each attention node."""
        self.functions = functions
        self._applied: tuple | None = None
        self.runs = 0
        """Replays launched as the step graph (for tests and benchmarks)."""
        self.updates = 0
        """Replays that had to re-parameterise the attention nodes first."""

    def run(self, launch: KernelLaunch, stream: int) -> None:
        config = launch.config
        state = (launch.function, config[0], config[1], config[2], bytes(launch.blob))
        f = self.functions
        if self._applied is None:
            _check(f.gr_step_graph(self.count, self.graphs, launch.function, config, ctypes.addressof(launch.params),
                                   launch.blob, self.values, PATCHED_ARGS, self.handles))
            weakref.finalize(self, f.gr_step_destroy, int(self.handles[0]), int(self.handles[1]))
        elif state != self._applied:
            _check(f.gr_step_update(self.handles, self.count, launch.function, config,
                                    ctypes.addressof(launch.params), launch.blob, self.values, PATCHED_ARGS))
            self.updates += 1
        self._applied = state
        _check(f.gr_step_launch(self.handles[0], stream))
        self.runs += 1


def make_step_graph(segments: Sequence[Any], patched: Sequence[Sequence[int]]) -> StepGraph | None:
    """A StepGraph over `segments` and the attention launches between them (`patched`: each
    break's q, KV cache and out addresses), or None where it cannot run (a segment not
    kept as a graph, no library)."""
    if len(segments) < 2:
        return None
    graphs = [kept_graph(segment) for segment in segments]
    if any(g is None for g in graphs):
        return None
    lib = library()
    if lib is None:
        return None
    return StepGraph(graphs, patched, lib)
