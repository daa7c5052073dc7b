"""The min-p, top-k and top-p threshold of every row in one launch (Triton, GPU).

Why: in torch (`Sampler._top_k_top_p_threshold`, runner/sampling/sampler.py, the CPU path and the
reference) the thresholds are ~40 small kernels over the rows' largest values (gathers, wheres,
exp, sums, a cumsum, compares), each costing more host time to launch than the device spends on
it. Here one program per row reads the row's sorted candidates (from `torch.topk`, or a full sort
when a row asks for top-p without top-k) and computes the same threshold with the same rules:

- min-p: x >= max + T * log(min_p) (`min_p_offset`, kept per plan; -inf: off); candidates below
  it count as dropped for top-k and top-p;
- top-k: the k-th candidate (ties with it kept), -inf where min-p dropped it or top_k is 0;
- top-p over the distribution exp((x - max) / T) renormalised over what min-p and top-k keep: the
  kept most-likely-first prefix whose mass above each token is < top_p * total; the threshold is
  the last such token's value (tokens tied with it are kept by the compare).

The candidates are the row's `k` largest values plus, where the vocabulary has more, one more: a
token tied with the k-th value past the candidates adds its mass to the renormalisation, and
there can be one only when that extra value equals the top-k threshold. Only then does the
program count the row's tokens >= the threshold (a pass over the row; frequent with bf16 logits,
whose values tie often). Sums and the prefix sum run in another order than torch's, so a row
whose top-p mass lands within rounding of top_p * total may keep one token more or less than the
torch path; tests/test_threshold_kernel.py compares the two on random rows in Triton's
interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from launch.fast_launch import FastLaunch

ROW_BLOCK = 2048
"""Tokens per step of the pass over the row (ties past the candidates)."""
MAX_CANDIDATE_BLOCK = 4096
"""The most candidates one step of the loops over them takes (a full sort loops)."""


@triton.jit
def _candidate_weights(values, off, K, k_threshold, min_p_threshold, v0, scale, BLOCK: tl.constexpr):
    """One block of the candidates: which min-p and top-k keep, and their exp((v - max) / T)."""
    idx = off + tl.arange(0, BLOCK)
    v = tl.load(values + idx, mask=idx < K, other=float("-inf")).to(tl.float32)
    kept = (v >= k_threshold) & (v >= min_p_threshold) & (v > float("-inf"))
    return kept, tl.where(kept, tl.exp((v - v0) / scale), 0.0)


@triton.jit
def row_threshold(values, K, C, row_x, V, scale, offset, top_k, top_p, BLOCK: tl.constexpr,
                  ROW_BLOCK: tl.constexpr):
    """One row's threshold: `values` (pointer) its C sorted candidates, the first K of them the
    top-k candidates; `row_x` (pointer) its V logits; scale, offset, top_k, top_p its settings (see
    `thresholds`). Also called by runner/sampling/logits_pass.py's sort, on the lists it sorted."""
    neg_inf = float("-inf")
    v0 = tl.load(values).to(tl.float32)                     # the row's maximum
    min_p_threshold = tl.where(offset > neg_inf, v0 + offset, neg_inf)
    kth = tl.load(values + tl.maximum(tl.minimum(top_k, K), 1) - 1).to(tl.float32)
    k_threshold = tl.where((top_k > 0) & (kth >= min_p_threshold), kth, neg_inf)

    # top-p, pass 1: the mass of the kept candidates (none for a row without top-p).
    top_p_on = top_p < 1.0
    n = tl.where(top_p_on, K, 0)
    total = 0.0
    kept_count = 0
    for off in range(0, n, BLOCK):
        kept, w = _candidate_weights(values, off, K, k_threshold, min_p_threshold, v0, scale, BLOCK)
        total += tl.sum(w, axis=0)
        kept_count += tl.sum(kept.to(tl.int32), axis=0)

    # Tokens tied with the k-th value past the candidates: possible only where the extra
    # candidate equals it.
    extra = tl.load(values + K, mask=C > K, other=neg_inf).to(tl.float32)
    ties = top_p_on & (extra == k_threshold) & (k_threshold > neg_inf) & (k_threshold < float("inf"))
    at_least = 0
    for off in range(0, tl.where(ties, V, 0), ROW_BLOCK):
        idx = off + tl.arange(0, ROW_BLOCK)
        x = tl.load(row_x + idx, mask=idx < V, other=neg_inf).to(tl.float32)
        at_least += tl.sum((x >= k_threshold).to(tl.int32), axis=0)
    beyond = tl.where(ties, at_least - kept_count, 0)
    total += tl.where(ties, beyond.to(tl.float32) * tl.exp((k_threshold - v0) / scale), 0.0)

    # top-p, pass 2: a kept candidate stays when the mass before it is < top_p * total.
    bound = top_p * total
    carry = 0.0
    kept_p = 0
    for off in range(0, n, BLOCK):
        kept, w = _candidate_weights(values, off, K, k_threshold, min_p_threshold, v0, scale, BLOCK)
        cumulative = tl.cumsum(w, axis=0) + carry
        kept_p += tl.sum((kept & (cumulative - w < bound)).to(tl.int32), axis=0)
        carry = tl.max(cumulative, axis=0)
    last = tl.load(values + tl.maximum(kept_p - 1, 0)).to(tl.float32)
    p_threshold = tl.where(top_p_on, last, neg_inf)
    return tl.maximum(min_p_threshold, tl.maximum(k_threshold, p_threshold))


@triton.jit
def _threshold_kernel(values_ptr, stride_v, x_ptr, stride_x, scale_ptr, offset_ptr, top_k_ptr, top_p_ptr, out_ptr,
                      V, C, K, BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    threshold = row_threshold(values_ptr + row.to(tl.int64) * stride_v, K, C, x_ptr + row.to(tl.int64) * stride_x, V,
                              tl.load(scale_ptr + row), tl.load(offset_ptr + row), tl.load(top_k_ptr + row),
                              tl.load(top_p_ptr + row), BLOCK, ROW_BLOCK)
    tl.store(out_ptr + row, threshold)


_launch = FastLaunch(_threshold_kernel)


def thresholds(values: torch.Tensor, k: int, logits: torch.Tensor, scale: torch.Tensor, min_p_offset: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """float32 [N, 1]: the smallest logit min-p, top-k and top-p keep in each row (-inf: all).

    values [N, C]: each row's largest logits, sorted, largest first (any float dtype): the `k`
    candidates, and where C = k + 1 the next value (for ties past the candidates); C = k = 1 for
    min-p alone (the row's maximum). logits [N, V] with contiguous rows (read only where ties
    past the candidates are possible). Per row (contiguous, [N] or [N, 1]): scale float32 (the
    temperature, 1 for greedy rows), min_p_offset float32 (scale * log(min_p), -inf: off), top_k
    int64 (0: off), top_p float32 (>= 1: off)."""
    rows, columns = values.shape
    out = torch.empty(rows, 1, dtype=torch.float32, device=values.device)
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(k), MAX_CANDIDATE_BLOCK)
    _launch((rows,), values, values.stride(0), logits, logits.stride(0), scale, min_p_offset, top_k, top_p, out,
            logits.shape[1], columns, k, block, ROW_BLOCK, device_index=values.device.index or 0, num_warps=4,
            num_stages=1)
    return out
