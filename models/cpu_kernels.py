"""C kernels for a CPU decode step, compiled on first use with the system C compiler.

A decode step's small torch ops each cost far more inside the step than alone: the weight
streaming of every GEMM evicts the caches that the interpreter, the dispatcher and the
activations live in (measured on a 2-core Xeon: a [32, 576] add 3.8 us alone, 18 us right after
a GEMM; RMSNorm's seven ops 85 us a call in a SmolLM2 step, 5.0 ms of a 75 ms step). One C call
does the residual add and the whole RMSNorm in one pass over the rows.

Rounding: HF's order, weight * (h * rsqrt(mean(h^2) + eps)), in fp32, with no fused multiply-add
(-ffp-contract=off); only the sum of squares adds in another order than torch's reduction (last-bit
differences in the scale). Off with GRAPHRUNNER_CPU_KERNELS=0, and wherever the compiler or the
build is missing: the torch reference path then runs."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess

import torch

logger = logging.getLogger(__name__)

MAX_ROWS = 64
"""Row counts up to this take the C kernel (decode steps); longer ones (prefill) keep torch's ops,
which are multi-threaded and vectorised over many rows, where the C loop runs on one core."""

_SOURCE = r"""
#include <math.h>
#include <stddef.h>

/* h = x (+ res, written to new_res); out = w * (h * (1 / sqrt(sum(h^2) / cols + eps))) */
void gr_add_rms_norm(const float* x, const float* res, float* out, float* new_res, const float* w,
                     int rows, int cols, float eps) {
    for (int r = 0; r < rows; r++) {
        const float* h = x + (size_t)r * cols;
        float* o = out + (size_t)r * cols;
        if (res) {
            const float* rr = res + (size_t)r * cols;
            float* nr = new_res + (size_t)r * cols;
            for (int c = 0; c < cols; c++) nr[c] = h[c] + rr[c];
            h = nr;
        }
        float lanes[16] = {0};
        int c = 0;
        for (; c + 16 <= cols; c += 16)
            for (int j = 0; j < 16; j++) lanes[j] += h[c + j] * h[c + j];
        float sum = 0.f;
        for (int j = 0; j < 16; j++) sum += lanes[j];
        for (; c < cols; c++) sum += h[c] * h[c];
        float scale = 1.0f / sqrtf(sum / (float)cols + eps);
        for (int k = 0; k < cols; k++) o[k] = (h[k] * scale) * w[k];
    }
}
"""


def _cpu_key() -> bytes:
    """What -march=native compiles for: the machine and its instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:  # not Linux: the machine name alone
        flags = ""
    return (platform.machine() + flags).encode()


@functools.cache
def library():
    """The loaded kernels (ctypes), or None (switched off, no compiler, the build failed; logged once)."""
    if os.environ.get("GRAPHRUNNER_CPU_KERNELS", "1") == "0":
        return None
    from models.native_build import compile_shared, compiler
    cc = compiler()
    if cc is None:
        logger.info("CPU decode kernels off: no C compiler")
        return None
    try:
        path = compile_shared("cpu_kernels", _SOURCE, cc, ["-O3", "-march=native", "-ffp-contract=off",
                                                          "-fno-math-errno"], key=_cpu_key())
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("CPU decode kernels off: building them failed: %s", getattr(exc, "stderr", "") or exc)
        return None
    vp = ctypes.c_void_p
    lib.gr_add_rms_norm.argtypes = [vp, vp, vp, vp, vp, ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.gr_add_rms_norm.restype = None
    return lib


def _applies(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.is_contiguous()
            and 0 < t.shape[0] <= MAX_ROWS)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm(x + residual) -> (out, x + residual), or RMSNorm(x) -> out without a residual; None
    where the kernel does not apply (not a small fp32 CPU matrix, autograd recording, kernels off)."""
    if not _applies(x) or not (weight.dtype == torch.float32 and weight.is_contiguous()
                               and weight.numel() == x.shape[1]):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None  # autograd would not see the C call
    if residual is not None and not (_applies(residual) and residual.shape == x.shape):
        return None
    lib = library()
    if lib is None:
        return None
    rows, cols = x.shape
    out = torch.empty_like(x)
    if residual is None:
        lib.gr_add_rms_norm(x.data_ptr(), None, out.data_ptr(), None, weight.data_ptr(), rows, cols, eps)
        return out
    summed = torch.empty_like(x)
    lib.gr_add_rms_norm(x.data_ptr(), residual.data_ptr(), out.data_ptr(), summed.data_ptr(), weight.data_ptr(),
                        rows, cols, eps)
    return out, summed
