"""The PIECEWISE layer loop in C: segment replays and the step's attention relaunches, no interpreter.

Why: a PIECEWISE replay of a 30-layer model is, per layer, one graph-segment replay and one eager
attention launch. From Python each pair costs ~10-15 µs of host time (two C-extension calls, a
forward-context lookup, Triton's argument parsing), more than the GPU spends on a decode layer of a
small model, so the GPU waits for the host. Once the step's first attention launch is bound
(`unified_attention.StepAttention`), every later layer differs only in three pointers (q, its KV
cache, out): a loop in C does `cuGraphLaunch(segment)` + `cuLaunchKernelEx(attention)` per layer,
~3-4 µs of driver time, and the host runs ahead of the GPU again.

Pieces:
- the step's attention launch in driver form comes from attention/kernels/driver_launch.py;
- `library()`: a small C file compiled once with the system C compiler against the `cuda.h` that
  ships with Triton (as Triton builds its own launchers), cached by source hash, loaded with
  ctypes; None (logged once, with why) where there is no CUDA driver, compiler or header;
- `LayerLoop`: one BreakableGraph's segments (their `cudaGraphExec_t`) and each break's patched
  pointers, prepared at capture; `run(launch, stream)` replays the graph from its second segment on.

What the C loop skips of `torch.cuda.CUDAGraph.replay`: the per-replay RNG prologue (model segments
draw no random numbers; sampling runs outside the graphs). GRAPHRUNNER_NATIVE_LOOP=0 (read at
import) keeps the Python loop.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

from attention.kernels.driver_launch import PATCHED_ARGS, KernelLaunch

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("GRAPHRUNNER_NATIVE_LOOP", "1") != "0"
"""Read once at import; tests and benchmarks that switch it at run time set this attribute."""

_SOURCE = r"""
#include <dlfcn.h>
#include <stdint.h>
#include "cuda.h"

typedef CUresult (*launch_ex_t)(const CUlaunchConfig*, CUfunction, void**, void**);
typedef CUresult (*graph_launch_t)(CUgraphExec, CUstream);
static launch_ex_t launch_ex;
static graph_launch_t graph_launch;

/* 0 when libcuda's entry points are found. */
int gr_init(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return 1;
  launch_ex = (launch_ex_t)dlsym(lib, "cuLaunchKernelEx");
  graph_launch = (graph_launch_t)dlsym(lib, "cuGraphLaunch");
  return (launch_ex && graph_launch) ? 0 : 2;
}

/* graphs[0], kernel(values[0..p)), graphs[1], kernel(values[p..2p)), ..., graphs[n] on `stream`:
   before launch i the first p parameter slots get layer i's values (the driver copies the
   parameters at launch, so overwriting them for the next layer is safe). config: grid x, y, z,
   threads per block, shared bytes, PDL, cooperative. Returns 0, or (position << 16) | CUresult
   of the first failure (position: 2i+1 graph i, 2i+2 kernel i). */
int gr_layer_loop(int n, const uint64_t* graphs, uint64_t stream, uint64_t function,
                  const uint32_t* config, void** params, uint64_t* slots, const uint64_t* values, int p) {
  CUlaunchAttribute attrs[2];
  CUlaunchConfig cfg;
  int num_attrs = 0;
  cfg.gridDimX = config[0]; cfg.gridDimY = config[1]; cfg.gridDimZ = config[2];
  cfg.blockDimX = config[3]; cfg.blockDimY = 1; cfg.blockDimZ = 1;
  cfg.sharedMemBytes = config[4];
  cfg.hStream = (CUstream)stream;
  if (config[5]) {
    attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  if (config[6]) {
    attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[num_attrs].value.cooperative = 1;
    ++num_attrs;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = num_attrs;
  for (int i = 0; i < n; ++i) {
    CUresult r = graph_launch((CUgraphExec)graphs[i], (CUstream)stream);
    if (r != CUDA_SUCCESS) return ((2 * i + 1) << 16) | (int)r;
    for (int k = 0; k < p; ++k) slots[k] = values[i * p + k];
    if (config[0] * config[1] * config[2] > 0) {
      r = launch_ex(&cfg, (CUfunction)function, params, 0);
      if (r != CUDA_SUCCESS) return ((2 * i + 2) << 16) | (int)r;
    }
  }
  CUresult r = graph_launch((CUgraphExec)graphs[n], (CUstream)stream);
  return r == CUDA_SUCCESS ? 0 : ((2 * n + 1) << 16) | (int)r;
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


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def cache_dir() -> Path:
    return Path(os.environ.get("GRAPHRUNNER_CACHE_DIR") or Path.home() / ".cache" / "graphrunner") / "native"


def build(include: Path, cc: str, out_dir: Path | None = None) -> Path:
    """Compile the loop into a shared library (once per source and header: cached by their hash)."""
    digest = hashlib.sha256(_SOURCE.encode() + (include / "cuda.h").read_bytes()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"layer_loop_{digest}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        source = Path(tmp) / "layer_loop.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I", str(include), str(source), "-o", str(built), "-ldl"],
                       check=True, capture_output=True, text=True)
        os.replace(built, target)     # atomic: a concurrent build leaves one whole file
    return target


_library: Any = None
_library_tried = False


def library() -> Any | None:
    """The loaded loop (ctypes), or None where it cannot run here (logged once, with why)."""
    global _library, _library_tried
    if _library_tried:
        return _library
    _library_tried = True
    include, cc = cuda_header_dir(), compiler()
    if include is None or cc is None:
        logger.info("PIECEWISE layer loop stays in Python: %s", "no cuda.h from Triton" if include is None else "no C compiler")
        return None
    try:
        lib = ctypes.CDLL(str(build(include, cc)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("PIECEWISE layer loop stays in Python: building it failed: %s", detail)
        return None
    if lib.gr_init() != 0:
        logger.info("PIECEWISE layer loop stays in Python: no CUDA driver (libcuda.so.1)")
        return None
    u64p, vp = ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p
    lib.gr_layer_loop.argtypes = [ctypes.c_int, u64p, ctypes.c_uint64, ctypes.c_uint64,
                                  ctypes.POINTER(ctypes.c_uint32), vp, u64p, u64p, ctypes.c_int]
    lib.gr_layer_loop.restype = ctypes.c_int
    _library = lib
    return lib


def graph_exec(segment: Any) -> int | None:
    """A captured torch.cuda.CUDAGraph's `cudaGraphExec_t`, or None (a fake, or a torch without
    `raw_cuda_graph_exec`)."""
    raw = getattr(segment, "raw_cuda_graph_exec", None)
    if raw is None:
        return None
    try:
        return int(raw())
    except (RuntimeError, TypeError):
        return None


class LayerLoop:
    """A BreakableGraph replayed from its second segment on in C, given the step's bound launch:
    segments[1..n] and, between them, the launch with breaks[1..n-1]'s patched arguments.
    `run_loop` is the C function (or a fake with its signature, in tests)."""

    def __init__(self, execs: Sequence[int], patched: Sequence[Sequence[int]], run_loop: Any) -> None:
        if len(execs) != len(patched) + 1 or any(len(p) != PATCHED_ARGS for p in patched):
            raise ValueError(f"{len(execs)} segments for {len(patched)} patched launches")
        self.count = len(patched)
        self.execs = (ctypes.c_uint64 * len(execs))(*execs)
        self.values = (ctypes.c_uint64 * (PATCHED_ARGS * max(1, len(patched))))(*(v for p in patched for v in p))
        self.run_loop = run_loop
        self.runs = 0
        """Replays that took the loop (for tests and benchmarks)."""

    def run(self, launch: KernelLaunch, stream: int) -> None:
        status = self.run_loop(self.count, self.execs, stream, launch.function, launch.config,
                               ctypes.addressof(launch.params), launch.blob, self.values, PATCHED_ARGS)
        if status:
            position, code = status >> 16, status & 0xFFFF
            what = f"segment {position // 2 + 1}" if position % 2 else f"the attention launch of break {position // 2}"
            raise RuntimeError(f"PIECEWISE layer loop: the driver refused {what} (CUresult {code})")
        self.runs += 1


def layer_loop(segments: Sequence[Any], patched: Sequence[Sequence[int]]) -> LayerLoop | None:
    """A LayerLoop over `segments` (all but the first, which Python replays before the first break
    binds the step's launch) and the patched arguments of breaks 1..n-1, or None where the loop
    cannot run (disabled, no library, a segment without an exec handle)."""
    if not ENABLED or len(segments) < 2:
        return None
    execs = [graph_exec(segment) for segment in segments[1:]]
    if any(e is None for e in execs):
        return None
    lib = library()
    if lib is None:
        return None
    return LayerLoop(execs, patched, lib.gr_layer_loop)
