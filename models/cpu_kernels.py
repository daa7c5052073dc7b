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
- `silu_mul`: silu(gate) * up, bit for bit torch's: an exp that rounds as torch's Sleef exp does
  (native_build's `gr_exp`) on the chunks torch's vectorised loop takes, glibc's expf on the rest.
- `screen_candidates`: the vocabulary passes of models/layers.screened_argmax over the bf16 logits.
The decode attention's C kernel lives beside its torch twin (attention/backends/cpu_decode_attention.py).

Built by launch/native_build.cpu_library for the instruction set in force (KernelConfig.cpu_isa caps
it): AVX-512 intrinsics where the build has them (the screen), portable C the compiler vectorises for
the target everywhere else (-ffp-contract=off: no fused multiply-add where torch's element-wise ops
round every product). Off with KernelConfig.cpu_kernels=False, and wherever the compiler or the build
is missing: the torch path then runs."""

from __future__ import annotations

import ctypes

import torch

from launch import native_build

MAX_ROWS = 64
"""Row counts up to this take the one-core kernels (norm, RoPE, SiLU*mul: decode steps); longer ones
(prefill) keep torch's ops, which are multi-threaded and vectorised over many rows."""

_SOURCE = r"""
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
#else
    float lanes[16];   /* one max per lane, then across: the compiler vectorises it for the target */
    for (int j = 0; j < 16; j++) lanes[j] = -INFINITY;
    for (; c + 16 <= vocab; c += 16)
        for (int j = 0; j < 16; j++) {
            float v = gr_bf16(row[c + j]);
            lanes[j] = v > lanes[j] ? v : lanes[j];
        }
    for (int j = 0; j < 16; j++) top = lanes[j] > top ? lanes[j] : top;
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

/* out[r, c] = silu(g) * u, g = gu[r * stride + c], u = gu[r * stride + cols + c], as torch's loop does it:
   the leading whole chunks of `chunk` elements (its vector steps) x / (1 + exp(-x)) with its vector exp
   (gr_exp: the same bits), the rest with the scalar expf; chunk 0: expf throughout. */
void gr_silu_mul(const float* gu, float* out, int rows, int cols, long stride, int chunk) {
    int vector_end = chunk > 0 ? cols - cols % chunk : 0;
    for (int r = 0; r < rows; r++) {
        const float* g = gu + (size_t)r * stride;
        const float* u = g + cols;
        float* o = out + (size_t)r * cols;
        for (int c = 0; c < vector_end; c++) o[c] = (g[c] / (1.0f + gr_exp(-g[c]))) * u[c];
        for (int c = vector_end; c < cols; c++) o[c] = (g[c] / (1.0f + expf(-g[c]))) * u[c];
    }
}
"""


SIGNATURES = [
    ("gr_add_rms_norm", [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_int, ctypes.c_float], None),
    ("gr_rope", [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                 ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p], ctypes.c_int),
    ("gr_screen", [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
     + [ctypes.c_void_p] * 4, ctypes.c_long),
    ("gr_silu_mul", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int],
     None),
]


def library():
    """The loaded kernels (ctypes) for the instruction set in force, or None: switched off
    (KernelConfig.cpu_kernels), no compiler, or the build failed (launch/native_build.cpu_library)."""
    return native_build.cpu_library("cpu_kernels", _SOURCE, SIGNATURES)


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
    """silu(gate) * up of gate_up [T, 2 I] (gate first), bit for bit torch's where the build has fused
    multiply-add (avx512, avx2, neon; generic x86: within an ulp or two); None where it does not apply
    (not fp32 CPU, over MAX_ROWS rows, layout, autograd, kernels off)."""
    if not (gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and gate_up.dim() == 2
            and 0 < gate_up.shape[0] <= MAX_ROWS and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
            and _untracked(gate_up)):
        return None
    lib = library()
    if lib is None:
        return None
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols)
    lib.gr_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, cols, gate_up.stride(0),
                    native_build.torch_vector_chunk())
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
