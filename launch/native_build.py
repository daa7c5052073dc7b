"""Compiling a small C source into a shared library with the system C compiler, cached by hash.

Used where a few lines of C beat what Python can reach: the CUDA step graph's driver calls
(runner/cudagraph/step_graph.py) and the CPU decode kernels (models/cpu_kernels.py for norm, RoPE,
SiLU*mul and the LM-head screen; attention/backends/cpu_decode_attention.py for the attention).
Without a compiler, callers keep their Python path. `cpu_library` is what the CPU kernel libraries
share: the instruction set chosen once per process (the best the CPU runs, capped by
KernelConfig.cpu_isa, logged once), one build per instruction set (its own compiler flags and cache
key), one C preamble (the ISA's macros, a portable vector-friendly exp, torch's AVX-512 exp handed in),
OpenMP where it links."""

from __future__ import annotations

import ctypes
import functools
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


ISA_FLAGS: dict[str, list[str]] = {
    "avx512": ["-march=native"],          # chosen only where the host has AVX-512 F/BW/VL/DQ: tuned for it
    "avx2": ["-march=x86-64-v3"],         # AVX2, FMA, F16C, BMI: any AVX2 CPU, whatever builds it
    "neon": ["-march=armv8-a"],           # aarch64: Advanced SIMD (NEON) and FMA are part of the base ISA
    "generic": [],                        # see isa_flags: the architecture's baseline, no vector extensions
}
"""Compiler flags of each instruction set the CPU kernels are built for. The C sources have AVX-512
intrinsics (GR_AVX512) and portable C beside them, written so that the compiler vectorises it for
the target (lane arrays, branch-free selects): avx2, neon and generic builds compile the portable C
for their target."""

ISA_ORDER: dict[str, tuple[str, ...]] = {"x86_64": ("avx512", "avx2", "generic"), "aarch64": ("neon", "generic")}
"""Each architecture's instruction sets, best first; `generic` runs everywhere."""


def machine() -> str:
    """x86_64, aarch64 (macOS's arm64 too), or the platform's own name."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def isa_flags(isa: str) -> list[str]:
    """Compiler flags that build for `isa` on this machine's architecture."""
    if isa == "generic":   # x86-64 baseline is SSE2; aarch64 without its Advanced SIMD; elsewhere the default
        return {"x86_64": ["-march=x86-64", "-mtune=generic"], "aarch64": ["-march=armv8-a+nosimd"]}.get(machine(), [])
    return ISA_FLAGS[isa]


def _cpuinfo_value(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line whose key starts with one of `keys`; None where
    there is no such line or no /proc/cpuinfo (not Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith(keys)), None)
    except OSError:
        return None
    return None if line is None else line.split(":", 1)[1].strip()


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 `flags`, aarch64 `Features`); None where unreadable."""
    flags = _cpuinfo_value("flags", "Features")
    return None if flags is None else set(flags.split())


@functools.cache
def cpu_vendor() -> str | None:
    """/proc/cpuinfo's `vendor_id` (GenuineIntel, AuthenticAMD, ...); None where there is none (aarch64,
    not Linux)."""
    return _cpuinfo_value("vendor_id")


@functools.cache
def host_isas() -> tuple[str, ...]:
    """The instruction sets this CPU runs, best first (always ending in `generic`). From /proc/cpuinfo;
    elsewhere (no /proc) from the kernels torch picked for this CPU."""
    order = ISA_ORDER.get(machine(), ("generic",))
    flags = _cpu_flags()
    if flags is None:
        import torch
        capability = torch.backends.cpu.get_cpu_capability()
        flags = {"AVX512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c", "bmi2", "movbe"},
                 "AVX2": {"avx2", "fma", "f16c", "bmi2", "movbe"}}.get(capability, set())
    needs = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
             "avx2": {"avx2", "fma", "f16c", "bmi2", "movbe"}, "neon": set(), "generic": set()}
    return tuple(isa for isa in order if needs[isa] <= flags)


def cpu_isa(cap: str = "auto") -> str:
    """The instruction set the CPU kernels are built for: the best of `host_isas()` at or below `cap`
    (KernelConfig.cpu_isa; `auto`: no cap). A cap of another architecture (neon on x86) leaves `generic`.
    Logged once per cap."""
    return _chosen_isa(cap, host_isas())


@functools.cache
def _chosen_isa(cap: str, host: tuple[str, ...]) -> str:
    order = ISA_ORDER.get(machine(), ("generic",))
    allowed = order if cap == "auto" else order[order.index(cap):] if cap in order else ("generic",)
    isa = next(isa for isa in host if isa in allowed)
    logger.info("CPU kernels: instruction set %s (this CPU runs %s; KernelConfig.cpu_isa=%s)", isa,
                ", ".join(host), cap)
    return isa


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
#ifdef __FP_FAST_FMAF
#define GR_FMA(a, b, c) fmaf(a, b, c)   /* one instruction where the target has fused multiply-add */
int gr_exp_is_sleefs(void) { return 1; }
#else
#define GR_FMA(a, b, c) ((a) * (b) + (c))
int gr_exp_is_sleefs(void) { return 0; }
#endif

/* exp(d), SLEEF's expf_u10 step for step (the vector exp torch's CPU kernels call): with fused
   multiply-add, equal to it to the last bit for every float (tests/test_cpu_kernels.py::
   test_the_portable_exp_is_torchs_vector_exp_bit_for_bit; with its stride = 1, all 2^32 inputs);
   without, within an ulp or two. Branch-free, so loops over it vectorise. */
static inline float gr_exp(float d) {
    float x = d > -110.f ? d : -110.f;            /* q fits an int (NaN too); outside, the selects below decide */
    x = x < 110.f ? x : 110.f;
    float qf = (x * 1.442695040888963407359924681001892137426645954152985934135449406931f + 12582912.f) - 12582912.f;
    int q = (int)qf;                              /* rounded to nearest even, as SLEEF's vrint */
    float s = GR_FMA(qf, -0.693145751953125f, x);
    s = GR_FMA(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = GR_FMA(u, s, 0.00139304355252534151077271f);
    u = GR_FMA(u, s, 0.00833336077630519866943359f);
    u = GR_FMA(u, s, 0.0416664853692054748535156f);
    u = GR_FMA(u, s, 0.166666671633720397949219f);
    u = GR_FMA(u, s, 0.5f);
    u = 1.0f + GR_FMA(s * s, u, s);
    int h = q >> 1;                               /* u * 2^q in two steps, as SLEEF's ldexp2 */
    uint32_t b1 = (uint32_t)(h + 127) << 23, b2 = (uint32_t)(q - h + 127) << 23;
    float p1, p2;
    memcpy(&p1, &b1, 4);
    memcpy(&p2, &b2, 4);
    u = u * p1 * p2;
    u = d < -104.f ? 0.f : u;
    u = d > 100.f ? INFINITY : u;
    return d != d ? d : u;
}
"""
"""What every CPU kernel library starts with: GR_AVX512 where the build targets AVX-512, and there
`gr_expf16`, torch's own vector exp (`bind_torch_exp`); `gr_exp`, the portable exp that rounds as
torch's vector exp does (GR_FMA: fused where the target has it)."""


def cpu_key() -> bytes:
    """What -march=native compiles for: the machine and its instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:  # not Linux: the machine name alone
        flags = ""
    return (platform.machine() + flags).encode()


def build_cpu_library(name: str, source: str, cc: str, signatures: Sequence[tuple[str, list, Any]],
                      isa: str, out_dir: Path | None = None) -> Any | None:
    """Compiles (or finds in the cache) and loads CPU_PREAMBLE + `source` for instruction set `isa`
    (`isa_flags`); None when that fails (logged). Tries with OpenMP first, then without (no libgomp to
    link): the same kernels, on one core. `signatures`: (function, argtypes, restype) of each exported
    function. `lib.isa`: the instruction set; `lib.vector_exp`: see `bind_torch_exp`. Built with
    -ffp-contract=off: no fused multiply-add where torch's element-wise ops round every product."""
    flags = ["-O3", *isa_flags(isa), "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    key = cpu_key() if "-march=native" in flags else machine().encode()
    lib = None
    for extra in (["-fopenmp"], []):
        try:
            lib = ctypes.CDLL(str(compile_shared(f"{name}_{isa}", CPU_PREAMBLE + source, cc, flags + extra, key=key,
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
    lib.isa = isa
    lib.vector_exp = bind_torch_exp(lib)
    return lib


def cpu_library(name: str, source: str, signatures: Sequence[tuple[str, list, Any]]) -> Any | None:
    """The CPU kernel library `name` (ctypes) for the instruction set in force (`cpu_isa` of
    KernelConfig.cpu_isa), built on first use and loaded once per process and instruction set; None
    where KernelConfig.cpu_kernels is off, there is no C compiler, or the build failed (logged once)."""
    config = active_kernel_config()
    if not config.cpu_kernels:
        return None
    isa = cpu_isa(config.cpu_isa)
    if (name, isa) not in _loaded:
        cc = compiler()
        if cc is None:
            logger.info("%s off: no C compiler (torch path instead)", name)
        _loaded[name, isa] = build_cpu_library(name, source, cc, signatures, isa) if cc else None
    return _loaded[name, isa]


_loaded: dict[tuple[str, str], Any] = {}
"""(library name, instruction set) -> the loaded library, or None where it could not be built."""


def forget_loaded_libraries() -> None:
    """Load (and build) again on next use: for tests that change the compiler or the build."""
    _loaded.clear()


def bind_torch_exp(lib: Any) -> bool:
    """Hands a library's AVX-512 kernels the vector exp torch's own AVX-512 kernels call
    (Sleef_expf16_u10, exported by libtorch_cpu); False (those kernels take their portable twins) where
    the build lacks AVX-512, torch runs other kernels (ATEN_CPU_CAPABILITY), or the symbol is not there."""
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


@functools.cache
def torch_vector_chunk() -> int:
    """How many leading elements of a row torch's vectorised element-wise loops take per step (two
    vectors), the rest going through the scalar function: 32 floats with its AVX-512 kernels, 16 with
    AVX2 or SVE-256, 8 with NEON (aarch64's default); 0 on x86 without either (its vector exp is the
    scalar one per lane). What bit-for-bit twins of torch's exp-based ops (SiLU) must follow."""
    import torch
    capability = torch.backends.cpu.get_cpu_capability()
    chunks = {"AVX512": 32, "AVX2": 16, "SVE256": 16}
    return chunks.get(capability, 8 if machine() == "aarch64" and capability == "DEFAULT" else 0)
