"""The CPU decode attention in C: the twin of the torch backend's decode path (torch_sdpa.py), compiled on
first use with the system C compiler (launch/native_build.build_cpu_library).

`decode_attention`: a decode step's KV write and paged attention for one layer, reading the cache
through the block table (no gather, no mask, no dense copy), 16 positions at a time, requests in
parallel on torch's own OpenMP threads (the library links libgomp, which resolves to the copy torch
loaded). Not bit for bit SDPA (its sums run in another order, as SDPA's do against HF's eager
attention): within 2e-6 of a float64 reference in tests/test_cpu_kernels.py, and token for token HF in
tests/test_smollm2.py. Two implementations of one algorithm: AVX-512 intrinsics (head dims that are
multiples of 16, with torch's AVX-512 vector exp) and portable C on 8-float vectors (GCC/clang vector
extensions) that the compiler maps to the build's instruction set (avx2, neon, generic; KernelConfig.cpu_isa
caps it). Head dims that are not a multiple of 8 take the torch path. Off with
KernelConfig.cpu_kernels=False, and wherever the compiler or the build is missing: the torch path then runs.
"""

from __future__ import annotations

import ctypes

import torch

from launch import native_build

_SOURCE = r"""
/* 8 floats in one vector (GCC/clang vector extensions): the compiler maps it to the target's registers
   (one AVX2 register, two SSE or NEON ones, scalars without SIMD). Products and sums rounded apart. */
typedef float gr_f8 __attribute__((vector_size(32)));

static inline gr_f8 gr_load8(const float* p) {
    gr_f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float gr_sum8(gr_f8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

/* The portable twin of gr_attend below (head dims that are multiples of 8): the same online softmax over
   16 positions at a time, on 8-float vectors (avx2, neon, generic builds; AVX-512 builds where torch's
   vector exp is not handed in). `chunks` = dim / 8 is a constant in each inlined copy (gr_attend_one),
   so a head's query and accumulator stay in registers. */
static inline __attribute__((always_inline)) void gr_attend_portable(
        const float* q, const float* kc, const float* vc, const int32_t* table, int len, int block_size, int hkv,
        int group, const int chunks, float scale, float* out) {
    const int dim = 8 * chunks, heads = hkv * group;
    const size_t head_sz = (size_t)hkv * dim;
    float m[heads], l[heads], s[16], p[16];
    for (int i = 0; i < heads; i++) {
        m[i] = -INFINITY;
        l[i] = 0.f;
    }
    for (int i = 0; i < heads * dim; i++) out[i] = 0.f;
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
        for (int hq = 0; hq < heads; hq++) {
            const size_t off = (size_t)(hq / group) * dim;
            gr_f8 qv[chunks], a[chunks];
            for (int c = 0; c < chunks; c++) qv[c] = gr_load8(q + (size_t)hq * dim + 8 * c);
            float top = m[hq];
            for (int t = 0; t < 16; t++) {
                s[t] = -INFINITY;
                if (t < n) {
                    gr_f8 sum = qv[0] * gr_load8(krow[t] + off);
                    for (int c = 1; c < chunks; c++) sum += qv[c] * gr_load8(krow[t] + off + 8 * c);
                    s[t] = gr_sum8(sum) * scale;
                }
                top = s[t] > top ? s[t] : top;
            }
            float total = 0.f;
            for (int t = 0; t < 16; t++) p[t] = gr_exp(s[t] - top);
            for (int t = 0; t < 16; t++) total += p[t];
            float corr = m[hq] == -INFINITY ? 0.f : gr_exp(m[hq] - top);
            m[hq] = top;
            l[hq] = l[hq] * corr + total;
            float* acc = out + (size_t)hq * dim;
            for (int c = 0; c < chunks; c++) a[c] = gr_load8(acc + 8 * c) * corr;
            for (int t = 0; t < n; t++)
                for (int c = 0; c < chunks; c++) a[c] += p[t] * gr_load8(vrow[t] + off + 8 * c);
            memcpy(acc, a, sizeof a);
        }
    }
    for (int hq = 0; hq < heads; hq++) {
        float inv = len ? 1.f / l[hq] : 0.f;
        for (int d = 0; d < dim; d++) out[(size_t)hq * dim + d] *= inv;
    }
}

#ifdef GR_AVX512
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

#endif

static void gr_attend_one(const float* q, const float* kc, const float* vc, const int32_t* table, int len,
                          int block_size, int hkv, int group, int dim, float scale, float* out) {
#ifdef GR_AVX512
    if (gr_expf16 && dim % 16 == 0) {
        switch (dim) {
            case 64: gr_attend(q, kc, vc, table, len, block_size, hkv, group, 4, scale, out); return;
            case 128: gr_attend(q, kc, vc, table, len, block_size, hkv, group, 8, scale, out); return;
            default: gr_attend(q, kc, vc, table, len, block_size, hkv, group, dim / 16, scale, out); return;
        }
    }
#endif
    switch (dim) {
        case 64: gr_attend_portable(q, kc, vc, table, len, block_size, hkv, group, 8, scale, out); break;
        case 128: gr_attend_portable(q, kc, vc, table, len, block_size, hkv, group, 16, scale, out); break;
        default: gr_attend_portable(q, kc, vc, table, len, block_size, hkv, group, dim / 8, scale, out);
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
"""

SIGNATURES = [
    ("gr_decode_attention", [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                             ctypes.c_long, ctypes.c_void_p, ctypes.c_long] + [ctypes.c_int] * 4
     + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
        ctypes.c_void_p], ctypes.c_int),
]


def library():
    """The loaded kernel (ctypes) for the instruction set in force, or None: switched off
    (KernelConfig.cpu_kernels), no compiler, or the build failed (launch/native_build.cpu_library)."""
    return native_build.cpu_library("cpu_decode_attention", _SOURCE, SIGNATURES)


def _untracked(*tensors: torch.Tensor) -> bool:
    """No autograd recording through these (it would not see a C call)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def native_attention() -> bool:
    """`decode_attention` can run here: the kernel is built (any instruction set)."""
    return library() is not None


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
    (not fp32 CPU, layout, head_dim not a multiple of 8, see `native_attention`): nothing was done.
    Out-of-range slots, lengths or block ids raise IndexError."""
    rows, heads, dim = query.shape if query.dim() == 3 else (0, 0, 0)
    kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 0
    if not (rows > 0 and dim % 8 == 0 and kv_heads and heads % kv_heads == 0
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
    if lib is None:
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
