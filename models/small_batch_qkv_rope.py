"""One decode row, one launch: RMSNorm (+ residual), the qkv GEMV, neox RoPE on q/k and the k/v write
into the paged KV cache (`norm_qkv_rope_cache`).

Why a kernel of its own (not `_small_rows_kernel` with flags): a program owns column PAIRS (c, c + D/2)
of the same head, accumulated side by side in the K loop as the gated path's gate and up rows, so the
epilogue rotates them without leaving registers; v heads are pairs copied as they are. Its GEMV, norm
and rounding are small_batch_kernels' one-row path (the same helpers, norm_linear's BLOCK_K: the same
fp32 summation order), so it equals norm_linear + fused_kernels.rope_and_cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from launch.fast_launch import launch_kernel
from launch.pdl import pdl_options, wait_for_producers
from models.small_batch_kernels import (M1_ACC_ELEMENTS, _load_rows, _normalise, _rms_inv, _stages, _weight_tile,
                                        block_sizes, rms_block)


@triton.jit
def _norm_qkv_rope_cache_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, b_ptr, q_out_ptr, res_out_ptr,
                                pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr,
                                K, eps, stride_xk, stride_rk, cos_sin_stride,
                                stride_c_kv, stride_c_b, stride_c_s, stride_c_h,
                                NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
                                CACHE_BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                ONE_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                RMS_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row. Units u in [0, (NUM_Q + 2 NUM_KV) * HALF): head h = u // HALF, d = u % HALF own the
    qkv columns lo = h * D + d and hi = lo + HALF (both accumulated in the same K loop, as GATED's
    gate and up rows). Epilogue: q/k heads (h < NUM_Q + NUM_KV) are rotated at positions[0]; q goes
    to q_out, rotated k and plain v to kv_cache at slot_mapping[0] (-1: no cache write).
    The GEMV, norm, rounding points and hand-pipelined K loop are _small_rows_kernel's (BLOCK_M == 1)
    to the letter."""
    pid = tl.program_id(0)
    units = (NUM_Q + 2 * NUM_KV) * HALF
    offs_u = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    u_mask = offs_u < units
    head = offs_u // HALF
    d = offs_u % HALF
    col_lo = head * (2 * HALF) + d
    w_lo = w_ptr + col_lo.to(tl.int64)[:, None] * K   # the hi column's row is HALF rows further
    offs_m = tl.arange(0, 1)
    m_mask = offs_m < 1
    w_next, w_h_next = _weight_tile(w_lo, HALF * K, 0, u_mask, K, True, BLOCK_K)
    pos = tl.load(pos_ptr)                      # step metadata and the constant table: before the wait too
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + d, mask=u_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + d, mask=u_mask, other=0.0)
    slot = tl.load(slot_ptr).to(tl.int64)
    wait_for_producers(PDL)

    if not ONE_TILE:   # pass 1: the row's rms (and residual_out, from program 0 only)
        inv = _rms_inv(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, 0, stride_xk, 0, stride_rk,
                       K, eps, pid == 0, HAS_RESIDUAL, 1, RMS_BLOCK)

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w, w_h = w_next, w_h_next
        w_next, w_h_next = _weight_tile(w_lo, HALF * K, k0 + BLOCK_K, u_mask, K, True, BLOCK_K)
        x_mask = m_mask[:, None] & k_mask[None, :]
        if ONE_TILE:
            x = _load_rows(x_ptr, res_ptr, res_out_ptr, offs_m, offs_k, x_mask, 0, stride_xk,
                           0, stride_rk, K, pid == 0, HAS_RESIDUAL)
            x32 = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(x32 * x32, axis=1) / K + eps)
        else:
            x = _load_rows(x_ptr, res_ptr, res_out_ptr, offs_m, offs_k, x_mask, 0, stride_xk,
                           0, stride_rk, K, False, HAS_RESIDUAL)
        xf = _normalise(x, inv, norm_w_ptr, offs_k, k_mask).to(tl.float32)
        acc += w.to(tl.float32) * xf
        acc_hi += w_h.to(tl.float32) * xf

    lo = tl.sum(acc, axis=1)
    hi = tl.sum(acc_hi, axis=1)
    out_ty = q_out_ptr.dtype.element_ty
    if HAS_BIAS:
        lo += tl.load(b_ptr + col_lo, mask=u_mask, other=0.0).to(tl.float32)
        hi += tl.load(b_ptr + col_lo + HALF, mask=u_mask, other=0.0).to(tl.float32)
    a = lo.to(out_ty).to(tl.float32)     # qkv as the GEMM would have stored it
    b = hi.to(out_ty).to(tl.float32)
    rotate = head < NUM_Q + NUM_KV
    out_lo = tl.where(rotate, (a * cos - b * sin).to(out_ty), a.to(out_ty))
    out_hi = tl.where(rotate, (b * cos + a * sin).to(out_ty), b.to(out_ty))

    q_mask = u_mask & (head < NUM_Q)
    tl.store(q_out_ptr + col_lo, out_lo, mask=q_mask)
    tl.store(q_out_ptr + col_lo + HALF, out_hi, mask=q_mask)
    if slot >= 0:   # -1: a padded row, nothing to cache
        kv = tl.where(head >= NUM_Q + NUM_KV, 1, 0)
        kv_head = head - NUM_Q - kv * NUM_KV
        c_mask = u_mask & (head >= NUM_Q)
        dst = (cache_ptr + (slot // CACHE_BLOCK) * stride_c_b + (slot % CACHE_BLOCK) * stride_c_s
               + kv * stride_c_kv + kv_head * stride_c_h + d)
        c_ty = cache_ptr.dtype.element_ty
        tl.store(dst, out_lo.to(c_ty), mask=c_mask)
        tl.store(dst + HALF, out_hi.to(c_ty), mask=c_mask)


def qkv_rope_block_sizes(units: int, n: int, k: int, dtype: torch.dtype, device: torch.device):
    """(BLOCK_N units, BLOCK_K) for norm_qkv_rope_cache: the gated path's sizes over `units` column
    pairs, with norm_linear's BLOCK_K for the same [n, k] weight (the same K tiling, hence the
    same fp32 summation order), BLOCK_N narrowed to keep both accumulators in the budget."""
    _, block_n, _, _ = block_sizes(1, units, k, dtype, device, gated=True)
    block_k = block_sizes(1, n, k, dtype, device)[2]
    while block_n > 1 and block_n * block_k > M1_ACC_ELEMENTS // 2:
        block_n //= 2
    return block_n, block_k


def norm_qkv_rope_cache(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_q_heads: int, num_kv_heads: int, head_dim: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row, one launch: `norm_linear` into qkv [Hq D | Hkv D | Hkv D], then
    `fused_kernels.rope_and_cache` on its q/k/v split (neox over the whole head_dim). Returns
    (rotated q [1, Hq, D] contiguous, x + residual (x itself when residual is None)); the rotated
    k and v are written into kv_cache [2, blocks, block_size, Hkv, D] at slot_mapping[0] (-1: not)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"norm_qkv_rope_cache takes one row, got x {tuple(x.shape)}")
    k = x.shape[1]
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    if tuple(qkv_weight.shape) != (n, k) or not qkv_weight.is_contiguous() or head_dim % 2:
        raise ValueError(f"qkv weight {tuple(qkv_weight.shape)} (contiguous {qkv_weight.is_contiguous()}) does "
                         f"not fit x {tuple(x.shape)} and heads ({num_q_heads}, {num_kv_heads}, {head_dim})")
    if qkv_bias is not None and not qkv_bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    if tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim) or kv_cache.shape[0] != 2 or kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not fit ({num_kv_heads}, {head_dim})")
    if cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} must rotate the whole head_dim {head_dim}")
    q_out = torch.empty((1, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        res_out = torch.empty((1, k), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    units = (num_q_heads + 2 * num_kv_heads) * half
    block_n, block_k = qkv_rope_block_sizes(units, n, k, x.dtype, x.device)
    launch_kernel(_norm_qkv_rope_cache_kernel, (triton.cdiv(units, block_n),),
        x, residual if residual is not None else x, norm_weight, qkv_weight,
        qkv_bias if qkv_bias is not None else qkv_weight, q_out, res_out if res_out is not None else q_out,
        positions, cos_sin_cache, kv_cache, slot_mapping,
        k, eps, x.stride(1), residual.stride(1) if residual is not None else 0, cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_Q=num_q_heads, NUM_KV=num_kv_heads, HALF=half, CACHE_BLOCK=kv_cache.shape[2],
        HAS_RESIDUAL=residual is not None, HAS_BIAS=qkv_bias is not None, ONE_TILE=k <= block_k,
        BLOCK_N=block_n, BLOCK_K=block_k, RMS_BLOCK=rms_block(k, 1),
        num_warps=4, num_stages=_stages(1, x.device), **pdl_options(x.device))
    return q_out, (res_out if residual is not None else x)
