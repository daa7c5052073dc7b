"""Fused Triton kernels for the small per-layer ops (the CUDA path of models/layers.py).

Inside a CUDA graph the decode step of a small model is bound by the number of kernels,
not bytes: an fp32 RMSNorm written in torch is ~9 launches, neox RoPE on q and k ~17, and
SiLU·mul 3. These kernels do each in one launch, with the same rounding points as the
torch reference (add in the model dtype, normalise in fp32, scale by the weight in the
model dtype), so fp32 results match HF to float noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from launch.fast_launch import launch_kernel
from launch.pdl import pdl_options, wait_for_producers


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add happens in the model dtype
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x32 * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm(x [+ residual]) over the last dim of a 2-D tensor; returns out or (out, x + residual)."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(cols)
    launch_kernel(_add_rms_norm_kernel, (rows,),
        x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
        residual.stride(0) if residual is not None else 0, cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **pdl_options(x.device))
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up.to(tl.float32)).to(up.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for x [T, 2n]."""
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    block = 1024
    launch_kernel(_silu_and_mul_kernel, (rows, triton.cdiv(cols, block)), x, out, x.stride(0), cols, BLOCK=block,
           num_warps=4, **pdl_options(x.device))
    return out


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(u) = 1 - 2 / (e^(2u) + 1)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    tanh = 1.0 - 2.0 / (tl.math.exp2(inner * (2.0 * 1.4426950408889634)) + 1.0)
    act = (0.5 * gate * (1.0 + tanh)).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up.to(tl.float32)).to(up.dtype), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[:, :n]) * x[:, n:] for x [T, 2n] (Gemma's gated MLP), rounded as `silu_and_mul`."""
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    block = 1024
    launch_kernel(_gelu_tanh_and_mul_kernel, (rows, triton.cdiv(cols, block)), x, out, x.stride(0), cols, BLOCK=block,
           num_warps=4, **pdl_options(x.device))
    return out


@triton.jit
def _rotate_into(src, dst, pos_ptr, token, cos_sin_ptr, cos_sin_stride, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """dst = neox-rotate(src) for one head at the token's position; fp32 math, rounded to src's
    dtype (as the torch reference), then stored in dst's dtype."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + offs, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + offs, mask=mask, other=0.0)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + offs, (a * cos - b * sin).to(x1.dtype).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, (b * cos + a * sin).to(x1.dtype).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, q_stride_t, q_stride_h, k_stride_t,
                 k_stride_h, num_q_heads, num_k_heads, cache_stride, HALF: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        _rotate_into(q_ptr + token * q_stride_t + head * q_stride_h, q_out_ptr + (token * num_q_heads + head) * 2 * HALF,
                     pos_ptr, token, cache_ptr, cache_stride, HALF, BLOCK)
    else:
        k_head = head - num_q_heads
        _rotate_into(k_ptr + token * k_stride_t + k_head * k_stride_h, k_out_ptr + (token * num_k_heads + k_head) * 2 * HALF,
                     pos_ptr, token, cache_ptr, cache_stride, HALF, BLOCK)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox RoPE over the whole head_dim of q [T, Hq, D] and k [T, Hk, D] (strided views are fine,
    the last dim must be contiguous); one launch for both. Returns new contiguous tensors."""
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    q_out = torch.empty((tokens, num_q, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, num_k, dim), dtype=k.dtype, device=k.device)
    half = dim // 2
    launch_kernel(_rope_kernel, (tokens, num_q + num_k),
        q, k, q_out, k_out, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q, num_k, cos_sin_cache.stride(0), HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
        **pdl_options(q.device))
    return q_out, k_out


@triton.jit
def _rotate_heads(src, src_stride_h, dst, dst_stride_h, heads, num_heads, cos, sin, norm_w_ptr, eps,
                  HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    """dst head h = neox-rotate(src head h) for the tile's `heads` below num_heads; cos / sin [1,
    BLOCK] of the token's position. fp32 math, rounded to src's dtype (as the torch reference),
    then stored in dst's dtype. With NORM each head is first RMS-normalised over its 2 * HALF values
    with `norm_w_ptr`'s weight (Qwen3's q_norm / k_norm) at `_add_rms_norm_kernel`'s rounding
    points: the sum of squares in fp32, normalise in fp32, round, multiply by the weight, round."""
    offs = tl.arange(0, BLOCK)
    col_ok = offs < HALF
    ok = (heads < num_heads)[:, None] & col_ok[None, :]
    at = src + heads[:, None] * src_stride_h + offs[None, :]
    x1 = tl.load(at, mask=ok, other=0.0)
    x2 = tl.load(at + HALF, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        w1 = tl.load(norm_w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        a = ((a * inv).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * inv).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    to = dst + heads[:, None] * dst_stride_h + offs[None, :]
    tl.store(to, (a * cos - b * sin).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)
    tl.store(to + HALF, (b * cos + a * sin).to(x1.dtype).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr,
                           q_norm_ptr, k_norm_ptr, norm_eps,
                           q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                           num_q_heads, num_k_heads, cos_sin_stride,
                           stride_c_kv, stride_c_b, stride_c_s, stride_c_h,
                           HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr,
                           QK_NORM: tl.constexpr, PDL: tl.constexpr):
    """Program (token, tile) over the token's q, k and v heads, HEADS heads a tile: a q tile is
    rotated into q_out; at the token's slot (-1: padded row, skip) a k tile is rotated and a v tile
    copied into the paged cache. QK_NORM: q and k heads are RMS-normalised (q_norm_ptr /
    k_norm_ptr weights) before RoPE."""
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    q_tiles = tl.cdiv(num_q_heads, HEADS)
    k_tiles = tl.cdiv(num_k_heads, HEADS)
    offs = tl.arange(0, BLOCK)
    col_ok = offs < HALF
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + offs, mask=col_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + offs, mask=col_ok, other=0.0)[None, :]
    if tile < q_tiles:
        _rotate_heads(q_ptr + token * q_stride_t, q_stride_h, q_out_ptr + token * num_q_heads * 2 * HALF, 2 * HALF,
                      tile * HEADS + tl.arange(0, HEADS), num_q_heads, cos, sin, q_norm_ptr, norm_eps, HALF, BLOCK,
                      QK_NORM)
    else:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            at_slot = cache_ptr + (slot // BLOCK_SIZE) * stride_c_b + (slot % BLOCK_SIZE) * stride_c_s
            if tile < q_tiles + k_tiles:
                _rotate_heads(k_ptr + token * k_stride_t, k_stride_h, at_slot, stride_c_h,
                              (tile - q_tiles) * HEADS + tl.arange(0, HEADS), num_k_heads, cos, sin, k_norm_ptr,
                              norm_eps, HALF, BLOCK, QK_NORM)
            else:
                heads = (tile - q_tiles - k_tiles) * HEADS + tl.arange(0, HEADS)
                ok = (heads < num_k_heads)[:, None] & col_ok[None, :]
                src = v_ptr + token * v_stride_t + heads[:, None] * v_stride_h + offs[None, :]
                dst = at_slot + stride_c_kv + heads[:, None] * stride_c_h + offs[None, :]
                tl.store(dst, tl.load(src, mask=ok, other=0.0).to(dst.dtype.element_ty), mask=ok)
                tl.store(dst + HALF, tl.load(src + HALF, mask=ok, other=0.0).to(dst.dtype.element_ty), mask=ok)


ROPE_CACHE_HEADS = 8
"""Heads a program of `rope_and_cache` takes (a tile of one token's q, k or v heads). A program per
(token, head) of one warp made 262144 programs of 128 values each for an 8192-token chunk of
Qwen3-0.6B. On an H100, bf16 (`graphrunner bench fused_ops`, Qwen3-0.6B heads): 319 -> 56 us at
8192 tokens, 83 -> 19 us at 2048, 13.6 -> 8.2 us at 256. One program per token, every head in
its loop, was as fast from 2048 tokens on but 1.5x slower at one token (4.8 -> 7.4 us)."""


def rope_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """Neox RoPE on q [T, Hq, D] (returned as a new contiguous tensor) and on k [T, Hk, D], with the
    rotated k and v [T, Hk, D] written straight into kv_cache [2, blocks, block_size, Hk, D] at
    slot_mapping [T] (-1 skips). One launch instead of RoPE + KV write: the small-batch decode
    step is bound by launches, and the rotated k never round-trips through memory.

    qk_norm = (q weight [D], k weight [D], eps): each q and k head is RMS-normalised first, at the
    rounding points of `add_rms_norm` on that head (Qwen3's q_norm / k_norm), so the norms cost no launch
    and q / k no contiguous copy (`add_rms_norm` takes rows, which q and k, strided views of the
    projection, are not)."""
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    if v.shape != k.shape or kv_cache.shape[3:] != k.shape[1:] or slot_mapping.shape[0] != tokens:
        raise ValueError(f"rope_and_cache shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, kv_cache {tuple(kv_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("rope_and_cache needs a contiguous head dim in q, k, v and kv_cache")
    if qk_norm is not None and (qk_norm[0].shape != (dim,) or qk_norm[1].shape != (dim,)):
        raise ValueError(f"rope_and_cache: q/k norm weights {tuple(qk_norm[0].shape)} / {tuple(qk_norm[1].shape)} "
                         f"do not match head_dim {dim}")
    q_out = torch.empty((tokens, num_q, dim), dtype=q.dtype, device=q.device)
    half = dim // 2
    q_norm, k_norm, eps = (q, q, 0.0) if qk_norm is None else qk_norm
    tiles = triton.cdiv(num_q, ROPE_CACHE_HEADS) + 2 * triton.cdiv(num_k, ROPE_CACHE_HEADS)
    launch_kernel(_rope_and_cache_kernel, (tokens, tiles),
        q, k, v, q_out, positions, cos_sin_cache, kv_cache, slot_mapping, q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_q, num_k, cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HALF=half, BLOCK=triton.next_power_of_2(half), BLOCK_SIZE=kv_cache.shape[2], HEADS=ROPE_CACHE_HEADS,
        QK_NORM=qk_norm is not None, num_warps=2, **pdl_options(q.device))
    return q_out
