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


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
        residual.stride(0) if residual is not None else 0, cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr):
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
    _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](x, out, x.stride(0), cols, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, q_stride_t, q_stride_h, k_stride_t,
                 k_stride_h, num_q_heads, num_k_heads, cache_stride, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cache_ptr + pos * cache_stride + offs, mask=mask, other=0.0)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + offs, mask=mask, other=0.0)
    if head < num_q_heads:
        src = q_ptr + token * q_stride_t + head * q_stride_h
        dst = q_out_ptr + (token * num_q_heads + head) * 2 * HALF
    else:
        src = k_ptr + token * k_stride_t + (head - num_q_heads) * k_stride_h
        dst = k_out_ptr + (token * num_k_heads + head - num_q_heads) * 2 * HALF
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + offs, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + HALF + offs, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox RoPE over the whole head_dim of q [T, Hq, D] and k [T, Hk, D] (strided views are fine,
    the last dim must be contiguous); one launch for both. Returns new contiguous tensors."""
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    q_out = torch.empty((tokens, num_q, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, num_k, dim), dtype=k.dtype, device=k.device)
    half = dim // 2
    _rope_kernel[(tokens, num_q + num_k)](
        q, k, q_out, k_out, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q, num_k, cos_sin_cache.stride(0), HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q_out, k_out
