"""Write this step's keys and values into the paged KV cache at their slots.

One program per token row, so the grid depends only on the padded token count: a captured
launch stays valid whatever slots later steps hold. Slot -1 (padded rows) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from launch.fast_launch import launch_kernel


@triton.jit
def kv_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_b, stride_c_s, stride_c_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = cache_ptr + block * stride_c_b + offset * stride_c_s + heads[:, None] * stride_c_h + dims[None, :]
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (int64, -1 = skip). The head dim must be contiguous; other strides are free."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or kv_cache.shape[3:] != key.shape[1:] or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"write_kv shapes disagree: key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"kv_cache {tuple(kv_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("write_kv needs a contiguous head dim in key, value and kv_cache")
    if num_tokens == 0:
        return
    launch_kernel(kv_write_kernel, (num_tokens,),
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )
