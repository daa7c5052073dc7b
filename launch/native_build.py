"""Compiling a small C source into a shared library with the system C compiler, cached by hash.

Used where a few lines of C beat what Python can reach: the CUDA step graph's driver calls
(runner/cudagraph/step_graph.py) and the CPU decode kernels (models/cpu_kernels.py for norm, RoPE,
SiLU*mul and the LM-head screen; attention/backends/cpu_decode_attention.py for the attention).
Without a compiler, callers keep their Python path. `build_cpu_library` is what the CPU kernel
libraries share: one C preamble (AVX-512 detection, torch's vector exp handed in), -march=native
keyed by the CPU's flags, OpenMP where it links."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from configs.kernel_config import active_kernel_config

logger = logging.getLogger(__name__)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def cache_dir() -> Path:
    """Where built libraries are kept: <KernelConfig.cache_dir>/native."""
    return Path(active_kernel_config().cache_dir) / "native"


def compile_shared(name: str, source: str, cc: str, flags: list[str], libs: tuple[str, ...] = (),
                   key: bytes = b"", out_dir: Path | None = None) -> Path:
    """`out_dir/{name}_{hash}.so` built from `source` with `cc flags`; built once per source, flags and
    `key` (what else the build depends on: a header, the CPU's instruction set), then found by the hash."""
    digest = hashlib.sha256(source.encode() + " ".join([cc, *flags, *libs]).encode() + key).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{name}_{digest}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            path = Path(tmp) / f"{name}.c"
            path.write_text(source)
            built = Path(tmp) / target.name
            subprocess.run([cc, *flags, "-shared", "-fPIC", str(path), "-o", str(built), *libs],
                           check=True, capture_output=True, text=True)
            os.replace(built, target)     # atomic: a concurrent build leaves one whole file
    finally:
        global _build_seconds
        _build_seconds += time.perf_counter() - started
    return target


_build_seconds = 0.0


def build_seconds() -> float:
    """Seconds this process has spent compiling libraries (the engine's start-up line counts them as compile)."""
    return _build_seconds


CPU_PREAMBLE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GR_AVX512 1   /* Skylake-SP and later: the intrinsics below need F, BW, VL and DQ */
#include <immintrin.h>
typedef __m512 (*vexp16_t)(__m512);
static vexp16_t gr_expf16;
void gr_set_expf16(void* f) { gr_expf16 = (vexp16_t)f; }
int gr_has_avx512(void) { return 1; }
#else
int gr_has_avx512(void) { return 0; }
#endif
"""
"""What every CPU kernel library starts with: GR_AVX512 where the build targets AVX-512, and there
`gr_expf16`, torch's own vector exp (`bind_torch_exp`), so exp-based kernels round as torch's do."""


def cpu_key() -> bytes:
    """What -march=native compiles for: the machine and its instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:  # not Linux: the machine name alone
        flags = ""
    return (platform.machine() + flags).encode()


def build_cpu_library(name: str, source: str, cc: str, signatures: Sequence[tuple[str, list, Any]],
                      march: str = "native", out_dir: Path | None = None) -> Any | None:
    """Compiles (or finds in the cache) and loads CPU_PREAMBLE + `source` for `-march={march}`; None when
    that fails (logged). Tries with OpenMP first, then without (no libgomp to link): the same kernels, on
    one core. `signatures`: (function, argtypes, restype) of each exported function (missing ones, e.g.
    AVX-512-only functions in a portable build, are skipped). `lib.vector_exp`: see `bind_torch_exp`.
    Built with -ffp-contract=off: no fused multiply-add where torch's element-wise ops round every product."""
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fno-math-errno"]
    key = cpu_key() if march == "native" else b""
    lib = None
    for extra in (["-fopenmp"], []):
        try:
            lib = ctypes.CDLL(str(compile_shared(name, CPU_PREAMBLE + source, cc, flags + extra, key=key,
                                                 out_dir=out_dir)))
            break
        except (OSError, subprocess.CalledProcessError) as exc:
            failure = getattr(exc, "stderr", "") or exc
            logger.log(logging.INFO if extra else logging.WARNING, "%s: building it with %s failed%s: %s", name,
                       " ".join(flags + extra), "" if extra else " (torch path instead)", failure)
    if lib is None:
        return None
    for function, args, result in [*signatures, ("gr_set_expf16", [ctypes.c_void_p], None)]:
        if hasattr(lib, function):
            getattr(lib, function).argtypes, getattr(lib, function).restype = args, result
    lib.vector_exp = bind_torch_exp(lib)
    return lib


def bind_torch_exp(lib: Any) -> bool:
    """Hands a library's AVX-512 kernels the vector exp torch's own AVX-512 kernels call
    (Sleef_expf16_u10, exported by libtorch_cpu); False (its exp-based kernels decline) where the build
    lacks AVX-512, torch runs other kernels (ATEN_CPU_CAPABILITY), or the symbol is not there."""
    import torch
    if not lib.gr_has_avx512() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        address = ctypes.cast(torch_cpu.Sleef_expf16_u10, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    lib.gr_set_expf16(address)
    return True
