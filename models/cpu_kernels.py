"""C kernels for a CPU decode step, compiled on first use with the system C compiler.

A decode step's small torch ops each cost far more inside the step than alone: the weight
streaming of every GEMM evicts the caches that the interpreter, the dispatcher and the
activations live in (on a 2-core Xeon a [32, 576] add takes several times as long right after a
GEMM as alone, and RMSNorm's seven ops were a noticeable share of a SmolLM2 bs32 decode step). Each kernel
here replaces a chain of such ops with one pass over the rows:

- `add_rms_norm`: the residual add and the whole RMSNorm. HF's order, weight * (h * rsqrt(mean(h^2)
  + eps)), in fp32; only the sum of squares adds in another order than torch's reduction (last-bit
  differences in the scale).
- `rope`: the rotation of q and k (rotate-halves); bit for bit torch's and HF's products and sums.
- `silu_mul`: silu(gate) * up, bit for bit torch's: the same Sleef exp (`Sleef_expf16_u10`, taken
  from libtorch itself) on the same 32-element chunks, glibc's expf on the rest, as torch's
  vectorised loop does; only where torch's CPU kernels are the AVX-512 ones.
- `screen_candidates`: the vocabulary passes of models/layers.screened_argmax over the bf16 logits.
- `decode_attention`: a decode step's KV write and paged attention for one layer, reading the cache
  through the block table (no gather, no mask, no dense copy), requests in parallel on torch's own
  OpenMP threads (the library links libgomp, which resolves to the copy torch loaded). Not bit for
  bit SDPA (its sums run in another order, as SDPA's do against HF's eager attention): within 2e-6 of
  a float64 reference in tests/test_cpu_kernels.py, and token for token HF in tests/test_smollm2.py.

Built with -ffp-contract=off (no fused multiply-add where torch's element-wise ops round every
product; the attention's explicit FMA intrinsics are not affected). Off with GRAPHRUNNER_CPU_KERNELS=0,
and wherever the compiler or the build is missing: the torch path then runs. The AVX-512 kernels
(`silu_mul`, `decode_attention`) also need torch's kernels to be its AVX-512 ones."""

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
"""Row counts up to this take the one-core kernels (norm, RoPE, SiLU*mul: decode steps); longer ones
(prefill) keep torch's ops, which are multi-threaded and vectorised over many rows."""

_SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GR_AVX512 1   /* Skylake-SP and later: the intrinsics below need F, BW, VL and DQ */
#include <immintrin.h>
#endif

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

/* Rotate-halves RoPE of rows x[r] = heads x dim (row stride in floats), cos | sin table rows of dim:
   out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin], out contiguous [rows, heads, dim]. Returns 0, or
   1 + the first row whose position is outside the table (nothing written). */
int gr_rope(const float* x, long stride, int rows, int heads, int dim, const int64_t* positions,
            const float* cos_sin, long max_positions, float* out) {
    int half = dim / 2;
    for (int r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return r + 1;
    for (int r = 0; r < rows; r++) {
        const float* cs = cos_sin + (size_t)positions[r] * dim;
        const float* sn = cs + half;
        for (int h = 0; h < heads; h++) {
            const float* xi = x + (size_t)r * stride + (size_t)h * dim;
            float* o = out + ((size_t)r * heads + h) * dim;
            for (int i = 0; i < half; i++) {
                float x1 = xi[i], x2 = xi[i + half];
                o[i] = x1 * cs[i] - x2 * sn[i];
                o[i + half] = x2 * cs[i] + x1 * sn[i];
            }
        }
    }
    return 0;
}

/* The vocabulary passes of screened_argmax over bf16 logits a [rows, vocab]: with
   coarse[r] = max_j a[r, j] - 2 * max_norm * slack[r], the ids j with a[r, j] >= coarse[r] for some r;
   then floor[r] = max over those ids of a[r, j] - slack[r] * norms[j], and the ids kept are those
   with a[r, j] + slack[r] * norms[j] >= floor[r] for some r (cand[k * rows + r] says for which).
   Returns the number of ids kept (ids and cand compacted to it); flag: vocab bytes of scratch. */
static inline float gr_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static inline float gr_row_max(const uint16_t* row, long vocab) {
    long c = 0;
    float top = -INFINITY;
#ifdef GR_AVX512
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (; c + 16 <= vocab; c += 16)
        best = _mm512_max_ps(best, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + c))), 16)));
    top = _mm512_reduce_max_ps(best);
#endif
    for (; c < vocab; c++) top = gr_bf16(row[c]) > top ? gr_bf16(row[c]) : top;
    return top;
}

/* flag[c] |= row[c] >= bound for c in [begin, end) */
static inline void gr_flag_at_least(const uint16_t* row, long begin, long end, float bound, uint8_t* flag) {
    long c = begin;
#ifdef GR_AVX512
    __m512 b = _mm512_set1_ps(bound);
    for (; c + 16 <= end; c += 16) {
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + c))), 16));
        __mmask16 hit = _mm512_cmp_ps_mask(v, b, _CMP_GE_OQ);
        if (hit) _mm_storeu_si128((__m128i*)(flag + c), _mm_or_si128(_mm_loadu_si128((const __m128i*)(flag + c)),
                                                                       _mm_maskz_set1_epi8(hit, 1)));
    }
#endif
    for (; c < end; c++) flag[c] |= gr_bf16(row[c]) >= bound;
}

long gr_screen(const uint16_t* a, int rows, long vocab, const float* slack, const float* norms, float max_norm,
               int64_t* ids, uint8_t* cand, float* floor_out, uint8_t* flag) {
    const long span = 2048;   /* columns per task of the second pass: each task owns its flags */
    memset(flag, 0, (size_t)vocab);
    float coarse[rows];
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            coarse[r] = gr_row_max(a + (size_t)r * vocab, vocab) - 2.0f * max_norm * slack[r];
        #pragma omp for schedule(static)
        for (long begin = 0; begin < vocab; begin += span)
            for (int r = 0; r < rows; r++)
                gr_flag_at_least(a + (size_t)r * vocab, begin, begin + span < vocab ? begin + span : vocab,
                                 coarse[r], flag);
    }
    long n = 0;
    for (long c = 0; c < vocab; c++)
        if (flag[c]) ids[n++] = c;
    for (int r = 0; r < rows; r++) {
        const uint16_t* row = a + (size_t)r * vocab;
        float fl = -INFINITY;
        for (long k = 0; k < n; k++) {
            float low = gr_bf16(row[ids[k]]) - slack[r] * norms[ids[k]];
            fl = low > fl ? low : fl;
        }
        floor_out[r] = fl;
    }
    long kept = 0;
    for (long k = 0; k < n; k++) {
        int any = 0;
        for (int r = 0; r < rows; r++) {
            uint8_t hit = gr_bf16(a[(size_t)r * vocab + ids[k]]) + slack[r] * norms[ids[k]] >= floor_out[r];
            cand[(size_t)kept * rows + r] = hit;
            any |= hit;
        }
        if (any) ids[kept++] = ids[k];
    }
    return kept;
}

#ifdef GR_AVX512
typedef __m512 (*vexp16_t)(__m512);
static vexp16_t gr_expf16;
void gr_set_expf16(void* f) { gr_expf16 = (vexp16_t)f; }

/* out[r, c] = silu(g) * u, g = gu[r * stride + c], u = gu[r * stride + cols + c]; torch's loop:
   32-element vector chunks x / (1 + exp(-x)) with Sleef's exp, the rest scalar with expf. */
void gr_silu_mul(const float* gu, float* out, int rows, int cols, long stride) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int r = 0; r < rows; r++) {
        const float* g = gu + (size_t)r * stride;
        const float* u = g + cols;
        float* o = out + (size_t)r * cols;
        int c = 0;
        for (; c + 32 <= cols; c += 32)
            for (int h = c; h < c + 32; h += 16) {
                __m512 x = _mm512_loadu_ps(g + h);
                __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
                __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, gr_expf16(neg)));
                _mm512_storeu_ps(o + h, _mm512_mul_ps(s, _mm512_loadu_ps(u + h)));
            }
        for (; c < cols; c++) o[c] = (g[c] / (1.0f + expf(-g[c]))) * u[c];
    }
}
int gr_has_avx512(void) { return 1; }

/* lane t = the sum of v[t]'s 16 lanes (a transpose-and-add: 45 instructions for 16 dot products). */
static inline __m512 gr_sum16(const __m512* v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++) {
        __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
        x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

/* Request r's attention, all heads: online softmax over its positions, 16 at a time (scores of 16
   keys in one vector, one vector exp; fused multiply-adds throughout). A position's K (and V) rows
   of all KV heads are one contiguous run of the cache, read in order. `chunks` = dim / 16 is a
   constant in each inlined copy (gr_attend_one), so the loops over it unroll into registers. */
static inline __attribute__((always_inline)) void gr_attend(
        const float* q, const float* kc, const float* vc, const int32_t* table, int len, int block_size, int hkv,
        int group, const int chunks, float scale, float* out) {
    const int dim = 16 * chunks, heads = hkv * group;
    const size_t head_sz = (size_t)hkv * dim;
    float m[heads], l[heads], acc[heads * dim], p[16];
    __m512 part[16];
    for (int i = 0; i < heads; i++) {
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    for (int i = 0; i < heads * dim; i++) acc[i] = 0.f;
    for (int start = 0; start < len; start += 16) {
        int n = len - start < 16 ? len - start : 16;
        const float* krow[16];
        const float* vrow[16];
        for (int t = 0; t < n; t++) {
            int pos = start + t;
            size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
            krow[t] = kc + slot * head_sz;
            vrow[t] = vc + slot * head_sz;
        }
        __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int pos = start + 16; pos < start + 32 && pos < len; pos++) {  /* the next 16 positions */
            size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
            const char* kn = (const char*)(kc + slot * head_sz);
            const char* vn = (const char*)(vc + slot * head_sz);
            for (size_t b = 0; b < head_sz * sizeof(float); b += 64) {
                _mm_prefetch(kn + b, _MM_HINT_T0);
                _mm_prefetch(vn + b, _MM_HINT_T0);
            }
        }
        for (int hq = 0; hq < heads; hq++) {
            const size_t off = (size_t)(hq / group) * dim;
            __m512 qv[chunks];
            for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(q + (size_t)hq * dim + 16 * c);
            for (int t = 0; t < 16; t++) {
                __m512 sum = _mm512_setzero_ps();
                if (t < n)
                    for (int c = 0; c < chunks; c++)
                        sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(krow[t] + off + 16 * c), sum);
                part[t] = sum;
            }
            __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                            _mm512_mul_ps(gr_sum16(part), _mm512_set1_ps(scale)));
            float top = _mm512_reduce_max_ps(s);
            top = top > m[hq] ? top : m[hq];
            __m512 e = gr_expf16(_mm512_sub_ps(s, _mm512_set1_ps(top)));
            float corr = m[hq] == -INFINITY ? 0.f : expf(m[hq] - top);
            m[hq] = top;
            l[hq] = l[hq] * corr + _mm512_reduce_add_ps(e);
            _mm512_storeu_ps(p, e);
            __m512 a[chunks];
            for (int c = 0; c < chunks; c++) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)hq * dim + 16 * c),
                                                                 _mm512_set1_ps(corr));
            for (int t = 0; t < n; t++) {
                __m512 w = _mm512_set1_ps(p[t]);
                for (int c = 0; c < chunks; c++)
                    a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vrow[t] + off + 16 * c), a[c]);
            }
            for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + (size_t)hq * dim + 16 * c, a[c]);
        }
    }
    for (int hq = 0; hq < heads; hq++) {
        float inv = len ? 1.f / l[hq] : 0.f;
        for (int d = 0; d < dim; d++) out[(size_t)hq * dim + d] = acc[(size_t)hq * dim + d] * inv;
    }
}

static void gr_attend_one(const float* q, const float* kc, const float* vc, const int32_t* table, int len,
                          int block_size, int hkv, int group, int dim, float scale, float* out) {
    switch (dim) {
        case 64: gr_attend(q, kc, vc, table, len, block_size, hkv, group, 4, scale, out); break;
        case 128: gr_attend(q, kc, vc, table, len, block_size, hkv, group, 8, scale, out); break;
        default: gr_attend(q, kc, vc, table, len, block_size, hkv, group, dim / 16, scale, out);
    }
}

/* Decode attention of `rows` requests with one new token each, over the paged cache
   [2, num_blocks, block_size, hkv, dim]: writes the new k, v rows (hkv heads of dim, heads
   contiguous) at slots[r] (skipped where < 0), then out[r] ([hkv * group, dim] contiguous) =
   softmax(scale * q k^T) v over the seq_lens[r] positions of the request's block table row. Requests
   run in parallel (OpenMP: torch's own thread pool when it is the libgomp torch loaded).
   Returns 0, or 1 (a slot), 2 (a seq_len), 3 (a block id) out of range: then nothing was written. */
int gr_decode_attention(const float* q, long q_stride, const float* k, long k_stride, const float* v,
                        long v_stride, float* cache, long num_blocks, int block_size, int hkv, int group, int dim,
                        const int32_t* table, long table_stride, int table_width, const int32_t* seq_lens,
                        const int64_t* slots, int rows, float scale, float* out) {
    long slot_count = num_blocks * block_size;
    for (int r = 0; r < rows; r++) {
        if (slots[r] >= slot_count) return 1;
        if (seq_lens[r] < 0 || seq_lens[r] > (long)table_width * block_size) return 2;
        for (int b = 0; b * block_size < seq_lens[r]; b++)
            if (table[r * table_stride + b] < 0 || table[r * table_stride + b] >= num_blocks) return 3;
    }
    size_t head_sz = (size_t)hkv * dim;
    float* kc = cache;
    float* vc = cache + (size_t)slot_count * head_sz;
    for (int r = 0; r < rows; r++) {
        if (slots[r] < 0) continue;
        memcpy(kc + (size_t)slots[r] * head_sz, k + (size_t)r * k_stride, head_sz * sizeof(float));
        memcpy(vc + (size_t)slots[r] * head_sz, v + (size_t)r * v_stride, head_sz * sizeof(float));
    }
    #pragma omp parallel for schedule(dynamic)
    for (int r = 0; r < rows; r++)
        gr_attend_one(q + (size_t)r * q_stride, kc, vc, table + r * table_stride, seq_lens[r], block_size, hkv,
                      group, dim, scale, out + (size_t)r * hkv * group * dim);
    return 0;
}
#else
int gr_has_avx512(void) { return 0; }
#endif
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
    from models.native_build import compiler
    cc = compiler()
    if cc is None:
        logger.info("CPU decode kernels off: no C compiler")
        return None
    return build(cc)


def build(cc: str, march: str = "native", out_dir=None):
    """Compiles (or finds in the cache) and loads the kernels for `-march={march}`; None when that fails.
    Tries with OpenMP first, then without (no libgomp to link): the same kernels, on one core."""
    from models.native_build import compile_shared
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fno-math-errno"]
    key = _cpu_key() if march == "native" else b""
    lib = None
    for extra in (["-fopenmp"], []):
        try:
            lib = ctypes.CDLL(str(compile_shared("cpu_kernels", _SOURCE, cc, flags + extra, key=key, out_dir=out_dir)))
            break
        except (OSError, subprocess.CalledProcessError) as exc:
            failure = getattr(exc, "stderr", "") or exc
            logger.log(logging.INFO if extra else logging.WARNING, "CPU decode kernels: building them with %s "
                       "failed%s: %s", " ".join(flags + extra), "" if extra else " (torch path instead)", failure)
    if lib is None:
        return None
    vp, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    for name, args, result in [
            ("gr_add_rms_norm", [vp, vp, vp, vp, vp, i32, i32, f32], None),
            ("gr_rope", [vp, i64, i32, i32, i32, vp, vp, i64, vp], i32),
            ("gr_screen", [vp, i32, i64, vp, vp, f32, vp, vp, vp, vp], i64),
            ("gr_silu_mul", [vp, vp, i32, i32, i64], None),
            ("gr_decode_attention", [vp, i64, vp, i64, vp, i64, vp, i64, i32, i32, i32, i32, vp, i64, i32, vp, vp,
                                     i32, f32, vp], i32),
            ("gr_set_expf16", [vp], None)]:
        if hasattr(lib, name):   # the last three only in an AVX-512 build
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    lib.vector_exp = _bind_torch_exp(lib)
    return lib


def _bind_torch_exp(lib) -> bool:
    """Hands the AVX-512 kernels the vector exp torch's own AVX-512 kernels call (Sleef_expf16_u10,
    exported by libtorch_cpu); False (silu_mul and decode_attention decline) where the build lacks
    AVX-512, torch runs other kernels (ATEN_CPU_CAPABILITY), or the symbol is not there."""
    if not lib.gr_has_avx512() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        address = ctypes.cast(torch_cpu.Sleef_expf16_u10, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    lib.gr_set_expf16(address)
    return True


def _applies(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.is_contiguous()
            and 0 < t.shape[0] <= MAX_ROWS)


def _untracked(*tensors: torch.Tensor) -> bool:
    """No autograd recording through these (it would not see a C call)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """RMSNorm(x + residual) -> (out, x + residual), or RMSNorm(x) -> out without a residual; None
    where the kernel does not apply (not a small fp32 CPU matrix, autograd recording, kernels off)."""
    if not _applies(x) or not (weight.dtype == torch.float32 and weight.is_contiguous()
                               and weight.numel() == x.shape[1]):
        return None
    if not _untracked(x, weight):
        return None
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


def rope(qk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-halves RoPE of qk [T, heads, D] (rows may be strided, heads contiguous inside a row) at
    positions [T] (int64) from the cos | sin table [max_positions, D] -> a new contiguous [T, heads, D];
    None where it does not apply (not fp32 CPU, over MAX_ROWS rows, layout, autograd, kernels off)."""
    if not (qk.device.type == "cpu" and qk.dtype == torch.float32 and qk.dim() == 3 and 0 < qk.shape[0] <= MAX_ROWS
            and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2] and qk.shape[2] % 2 == 0
            and cos_sin.dtype == torch.float32 and cos_sin.device.type == "cpu" and cos_sin.is_contiguous()
            and cos_sin.dim() == 2 and cos_sin.shape[1] == qk.shape[2]
            and positions.dtype == torch.int64 and positions.is_contiguous() and positions.device.type == "cpu"
            and positions.shape == (qk.shape[0],) and _untracked(qk)):
        return None
    lib = library()
    if lib is None:
        return None
    rows, heads, dim = qk.shape
    out = torch.empty(rows, heads, dim)
    bad = lib.gr_rope(qk.data_ptr(), qk.stride(0), rows, heads, dim, positions.data_ptr(), cos_sin.data_ptr(),
                      cos_sin.shape[0], out.data_ptr())
    if bad:
        raise IndexError(f"position {int(positions[bad - 1])} is outside the rotary table of "
                         f"{cos_sin.shape[0]} positions")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up [T, 2 I] (gate first), bit for bit torch's; None where it does not
    apply (see `_bind_torch_exp`; not fp32 CPU, over MAX_ROWS rows, layout, autograd, kernels off)."""
    if not (gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and gate_up.dim() == 2
            and 0 < gate_up.shape[0] <= MAX_ROWS and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
            and _untracked(gate_up)):
        return None
    lib = library()
    if lib is None or not lib.vector_exp:
        return None
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols)
    lib.gr_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, cols, gate_up.stride(0))
    return out


def screen_candidates(approx: torch.Tensor, slack: torch.Tensor, norms: torch.Tensor, max_norm: float):
    """models/layers.screened_argmax's passes over the vocabulary in one C call: (ids [C] ascending,
    candidates [R, C] bool, floor [R, 1]) from its bf16 logits approx [R, V], slack [R] and the head's
    row norms [V]; None where it does not apply (kernels off, not bf16 / fp32 CPU, layout)."""
    if not (approx.device.type == "cpu" and approx.dtype == torch.bfloat16 and approx.dim() == 2
            and approx.is_contiguous() and slack.dtype == norms.dtype == torch.float32
            and slack.device.type == norms.device.type == "cpu" and slack.is_contiguous() and norms.is_contiguous()
            and slack.shape == (approx.shape[0],) and norms.shape == (approx.shape[1],)):
        return None
    lib = library()
    if lib is None:
        return None
    rows, vocab = approx.shape
    ids = torch.empty(vocab, dtype=torch.int64)
    candidates = torch.empty(vocab * rows, dtype=torch.bool)
    floor = torch.empty(rows, 1)
    flag = torch.empty(vocab, dtype=torch.uint8)
    kept = lib.gr_screen(approx.data_ptr(), rows, vocab, slack.data_ptr(), norms.data_ptr(), max_norm,
                         ids.data_ptr(), candidates.data_ptr(), floor.data_ptr(), flag.data_ptr())
    return ids[:kept], candidates[: kept * rows].view(kept, rows).t(), floor


def native_attention() -> bool:
    """`decode_attention` can run here: the kernels are built for AVX-512 and have torch's vector exp."""
    lib = library()
    return lib is not None and lib.vector_exp


def _heads_rows(t: torch.Tensor, heads: int, dim: int) -> bool:
    """[T, heads, dim] fp32 CPU with contiguous heads inside each (possibly strided) row."""
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3 and t.shape[1:] == (heads, dim)
            and t.stride(2) == 1 and t.stride(1) == dim)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, scale: float,
                     out: torch.Tensor) -> bool:
    """A decode step's attention for one layer in one C call: key/value [R, Hkv, D] written into the paged
    kv_cache [2, num_blocks, block_size, Hkv, D] at slots [R] (-1: skipped), then out [R, Hq, D] =
    attention of query [R, Hq, D] (one token per request, already rotated) over each request's
    seq_lens[r] cached positions through block_table [R, W] (int32). False where it does not apply
    (not fp32 CPU, layout, head_dim not a multiple of 16, see `native_attention`): nothing was done.
    Out-of-range slots, lengths or block ids raise IndexError."""
    rows, heads, dim = query.shape if query.dim() == 3 else (0, 0, 0)
    kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 0
    if not (rows > 0 and dim % 16 == 0 and kv_heads and heads % kv_heads == 0
            and _heads_rows(query, heads, dim) and _heads_rows(key, kv_heads, dim) and _heads_rows(value, kv_heads, dim)
            and key.shape[0] >= rows and value.shape[0] >= rows and out.is_contiguous() and out.shape == query.shape
            and out.dtype == torch.float32 and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
            and kv_cache.device.type == "cpu" and kv_cache.shape[0] == 2 and kv_cache.shape[4] == dim
            and block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.stride(1) == 1
            and block_table.shape[0] >= rows and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
            and seq_lens.shape[0] >= rows and slots.dtype == torch.int64 and slots.is_contiguous()
            and slots.shape[0] >= rows and block_table.device.type == seq_lens.device.type == slots.device.type == "cpu"
            and _untracked(query, key, value)):
        return False
    lib = library()
    if lib is None or not lib.vector_exp:   # the softmax takes the same vector exp
        return False
    error = lib.gr_decode_attention(
        query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
        kv_cache.data_ptr(), kv_cache.shape[1], kv_cache.shape[2], kv_heads, heads // kv_heads, dim,
        block_table.data_ptr(), block_table.stride(0), block_table.shape[1], seq_lens.data_ptr(), slots.data_ptr(),
        rows, scale, out.data_ptr())
    if error:
        what = {1: "a slot", 2: "a sequence length", 3: "a block id"}[error]
        raise IndexError(f"decode attention: {what} is outside the KV cache of {kv_cache.shape[1]} blocks")
    return True
