"""One Triton kernel for paged attention over variable-length queries: prefill (with or without a
prefix-cached context), chunked prefill and decode, mixed in one launch.

Why it can live inside a CUDA graph: the grid depends only on the padded batch shape. Program
(q_block, kv_head[, split]) finds its request from `query_start_loc` in memory, reads its loop
bounds from `seq_lens`, and exits when there is nothing for it to do. A replay with new metadata
(same padded shapes) therefore runs the same launch correctly.

Layout of the work (the vLLM design):
- A q block is BLOCK_Q consecutive query tokens of ONE request times all GROUP query heads that
  share a KV head: BLOCK_M = BLOCK_Q * GROUP rows (padded to a power of two, at least 16 so
  `tl.dot` applies). K/V tiles are read once per group, not once per query head.
- Request r owns the virtual q blocks starting at `query_start_loc[r] // BLOCK_Q + r`; with
  `cdiv(T, BLOCK_Q) + num_reqs` programs along axis 0 every request is covered, whatever its
  length. Programs that land past the last request zero the padded token rows of `out`, so
  those rows are finite (0) rather than stale.
- Split-KV (flash decoding): with num_splits > 1 each program takes a contiguous share of the
  KV tiles its q block needs, at least MIN_SPLIT_TILES of them (a short context may keep fewer
  "active" splits). Inside a CUDA graph (KernelConfig.fused_merge auto or off) each split writes
  (max, sum, unnormalised acc) to scratch and `merge_splits_kernel` combines them: there it is the
  faster. In an eager launch (auto or on; a second launch would cost host time) one active split
  writes `out` itself, and otherwise the last split to finish, counted by an atomic ticket, merges
  them in the same launch (FUSED_MERGE). This buys parallelism for small batches with long
  contexts. The
  split count is fixed per launch (a FULL graph: per captured size, from padded shapes alone, up
  to MAX_SPLITS); the kernel computes on the device how many of those splits the context fills,
  and the partials go to one persistent scratch buffer (`split_scratch`), so a replay finds them
  at the captured addresses.
- Two tile shapes, one kernel: decode-like steps take BLOCK_M = 16 rows; a step with long
  queries (prefill, chunked prefill, mixed) takes the prefill tiles (BLOCK_M = 128 rows, deeper
  pipelining, `launch_config`), so each K/V tile feeds a full tensor-core dot. Either way the
  tiles past a q block's last query are never loaded, and the tiles wholly before its first query
  run without building a mask (`_attend_tiles`, MASKED off): only the diagonal tiles are masked.
Scores are kept in the log2 domain (scale * log2(e) folded in) so the softmax uses exp2.
DOT_FP32 (CPU only) upcasts the dot operands: Triton's interpreter multiplies bf16 tensors as their
raw 16-bit patterns (numpy has no bf16), so interpreted bf16 dots are wrong without it.

Why one file of ~700 lines: it is one op, the kernel and its host-side launch (`_plan`, `StepAttention`).
The launch passes every kernel parameter positionally in signature order (launch/fast_launch.py's
contract), and StepAttention patches the first three by position, so a change to the kernel's
parameters is a change to the launch in the same commit; split apart, the two would drift.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from configs.kernel_config import active_kernel_config
from launch.driver_launch import KernelLaunch, kernel_launch
from launch.fast_launch import FastLaunch, num_sms
from launch.pdl import use_pdl, wait_for_producers

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_splits", "window"])
def attention_kernel(
    q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, ticket_ptr,
    scale_log2, window, soft_cap_log2, num_tokens, num_reqs, num_q_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_b, stride_c_s, stride_c_h, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, REQ_CHUNK: tl.constexpr,
    SPLIT_KV: tl.constexpr, DOT_FP32: tl.constexpr, FUSED_MERGE: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, PDL: tl.constexpr,
):
    # The last q blocks of a request see the most keys: launched first (block order reversed), they
    # do not leave a long tail behind the short ones in a long prefill.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Everything up to the PDL wait reads only the step's metadata (query_start_loc, seq_lens, the
    # block table): uploaded before the step's first kernel and written by none, so with PDL these
    # dependent loads overlap the kernel before, and after the wait the first K/V tile is one load away.
    # Which request owns this q block: the last r whose first virtual block is <= q_block. The
    # first virtual blocks grow with r, so the owners are a prefix: count them REQ_CHUNK at a time
    # (vectorised loads, no dependent binary search, and no batch-size constexpr to recompile for).
    owners = num_reqs * 0                          # an int32 scalar, like the sums added to it
    for base in range(0, num_reqs + 1, REQ_CHUNK):
        reqs = base + tl.arange(0, REQ_CHUNK)
        starts = tl.load(qsl_ptr + reqs, mask=reqs <= num_reqs, other=0) // BLOCK_Q + reqs
        owners += tl.sum(((starts <= q_block) & (reqs <= num_reqs)).to(tl.int32), axis=0)
    req = owners - 1
    q_start = tl.load(qsl_ptr + req)
    local_block = q_block - (q_start // BLOCK_Q + req)
    is_req = req < num_reqs                        # else: a program past the last request
    q_len = tl.load(qsl_ptr + req + 1, mask=is_req, other=0) - q_start
    seq_len = tl.load(seq_lens_ptr + req, mask=is_req, other=0)
    context_len = seq_len - q_len

    # KV positions this q block needs, and this split's share of their tiles (at least
    # MIN_SPLIT_TILES: the splits past `active` have none, and exit before loading q).
    first_q_pos = context_len + local_block * BLOCK_Q
    kv_end = tl.minimum(first_q_pos + BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if HAS_WINDOW:   # the block's first query sees no key at or before its position - window
        first_tile = tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N
    else:
        first_tile = num_tiles * 0
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles - first_tile, num_splits), MIN_SPLIT_TILES)
    active = tl.cdiv(num_tiles - first_tile, tiles_per_split)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    # Tiles below `full_hi` are wholly visible to every query of the block (keys at or before its
    # first query's position): no mask is built for them, only for the diagonal tiles after.
    if HAS_WINDOW:
        full_hi = tile_lo
    else:
        full_hi = tl.maximum(tl.minimum((first_q_pos + 1) // BLOCK_N, tile_hi), tile_lo)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cols = tl.arange(0, BLOCK_N)
    next_block = _tile_blocks(table_row, tile_lo, cols, kv_end, BLOCK_N, BLOCK_SIZE)   # the first tile's
    wait_for_producers(PDL)   # q and the KV cache (this step's k/v) come from the kernels before

    rows = tl.arange(0, BLOCK_M)
    q_off = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM

    if not is_req:
        # Past the last request: zero padded token rows (with separate-kernel splits, the merge
        # kernel does it; every split program of this block writes the same zeros otherwise).
        if FUSED_MERGE or not SPLIT_KV:
            tokens = (q_start // BLOCK_Q + local_block) * BLOCK_Q + q_off
            pad_ok = (q_off < BLOCK_Q) & (tokens >= q_start) & (tokens < num_tokens)
            dst = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(dst, tl.zeros([BLOCK_M, D_PAD], dtype=out_ptr.dtype.element_ty),
                     mask=pad_ok[:, None] & dim_ok[None, :])
        return
    if local_block * BLOCK_Q >= q_len:
        return
    if FUSED_MERGE:
        if split >= active:
            return

    q_idx = local_block * BLOCK_Q + q_off          # query index within the request
    row_ok = (q_off < BLOCK_Q) & (q_idx < q_len)
    tokens = (q_start + q_idx).to(tl.int64)
    q_pos = context_len + q_idx                    # absolute position: sees KV positions <= q_pos
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32 if DOT_FP32 else cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i, l_i, acc, next_block = _attend_tiles(
        q, m_i, l_i, acc, next_block, tile_lo, full_hi, cache_ptr, table_row, cols, dims, kv_end, q_pos,
        kv_head, window, scale_log2, soft_cap_log2, stride_c_kv, stride_c_b, stride_c_s, stride_c_h,
        HEAD_DIM, D_PAD, BLOCK_N, BLOCK_SIZE, DOT_FP32, False, HAS_WINDOW, HAS_SOFT_CAP)
    m_i, l_i, acc, next_block = _attend_tiles(
        q, m_i, l_i, acc, next_block, full_hi, tile_hi, cache_ptr, table_row, cols, dims, kv_end, q_pos,
        kv_head, window, scale_log2, soft_cap_log2, stride_c_kv, stride_c_b, stride_c_s, stride_c_h,
        HEAD_DIM, D_PAD, BLOCK_N, BLOCK_SIZE, DOT_FP32, True, HAS_WINDOW, HAS_SOFT_CAP)

    dst = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    row_parts = (tokens * num_q_heads + heads) * num_splits
    if not SPLIT_KV:
        _store_normalised(dst, acc, l_i, out_mask)
    elif not FUSED_MERGE:   # the merge kernel follows
        _store_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row_parts + split, m_i, l_i, acc, row_ok, dims, D_PAD)
    elif active == 1:   # the only split: nothing to merge
        _store_normalised(dst, acc, l_i, out_mask)
    else:
        _store_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row_parts + split, m_i, l_i, acc, row_ok, dims, D_PAD)
        # The last active split of this (q block, KV head) to finish merges them all. Every
        # thread's partials are stored before the barrier; the ticket's acq_rel atomic publishes
        # them to, and acquires the others' for, the last arrival, which reads them past L1 (.cg)
        # and resets the ticket for the next launch or replay.
        tl.debug_barrier()
        ticket = ticket_ptr + q_block * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
        if arrived == active - 1:
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
            _merge_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row_parts, active, row_ok, dims, dst,
                            out_mask, BLOCK_M, D_PAD, MAX_SPLITS)


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, next_block, tile_lo, tile_hi, cache_ptr, table_row, cols, dims, kv_end, q_pos,
                  kv_head, window, scale_log2, soft_cap_log2, stride_c_kv, stride_c_b, stride_c_s, stride_c_h,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  DOT_FP32: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFT_CAP: tl.constexpr):
    """Online softmax over KV tiles tile_lo..tile_hi-1 (K and V read [BLOCK_N, D] as stored, one
    position's head_dim contiguous). MASKED: causal, kv_end and window masks; else every key of
    every tile is visible (the caller guarantees it). Returns the running (max, sum, acc) and the
    block ids of the tile after the last (prefetched one tile ahead)."""
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + cols
        block = next_block
        next_block = _tile_blocks(table_row, tile + 1, cols, kv_end, BLOCK_N, BLOCK_SIZE)   # one tile ahead
        kv_off = (block * stride_c_b + (pos % BLOCK_SIZE) * stride_c_s + kv_head * stride_c_h)[:, None] + dims[None, :]
        if MASKED:
            kv_mask = (pos < kv_end)[:, None] & (dims < HEAD_DIM)[None, :]
            k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)                     # [BLOCK_N, D_PAD]
            v = tl.load(cache_ptr + stride_c_kv + kv_off, mask=kv_mask, other=0.0)
        elif HEAD_DIM == D_PAD:
            k = tl.load(cache_ptr + kv_off)
            v = tl.load(cache_ptr + stride_c_kv + kv_off)
        else:
            k = tl.load(cache_ptr + kv_off, mask=(dims < HEAD_DIM)[None, :], other=0.0)
            v = tl.load(cache_ptr + stride_c_kv + kv_off, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        if HAS_SOFT_CAP:   # cap * tanh(score / cap), in the log2 domain: soft_cap_log2 = cap * log2(e)
            s = soft_cap_log2 * _tanh(s / soft_cap_log2)
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & (pos < kv_end)[None, :]
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # fully masked rows stay at 0
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc, next_block


@triton.jit
def _merge_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, row_parts, active, row_ok, dims, dst, out_mask,
                    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M) over the `active` splits of each row.
    The maxima and sums of all splits are one [MAX_SPLITS, BLOCK_M] load, so the global max is
    known first and each split's accumulator then adds in independently (unrolled, masked past
    `active`)."""
    splits = tl.arange(0, MAX_SPLITS)
    ok = (splits[:, None] < active) & row_ok[None, :]
    parts = row_parts[None, :] + splits[:, None]
    m_s = tl.load(part_max_ptr + parts, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_sum_ptr + parts, mask=ok, other=0.0, cache_modifier=".cg")
    m_all = tl.max(m_s, axis=0)
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)        # no split saw a key: weights 0
    l_all = tl.sum(l_s * tl.math.exp2(m_s - m_ref[None, :]), axis=0)
    o_all = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for split_i in tl.static_range(MAX_SPLITS):
        ok_s = row_ok & (tl.full([BLOCK_M], split_i, tl.int32) < active)
        m_s1 = tl.load(part_max_ptr + row_parts + split_i, mask=ok_s, other=float("-inf"), cache_modifier=".cg")
        a_s = tl.load(part_acc_ptr + (row_parts + split_i)[:, None] * D_PAD + dims[None, :], mask=ok_s[:, None],
                      other=0.0, cache_modifier=".cg")
        o_all += a_s * tl.math.exp2(m_s1 - m_ref)[:, None]
    _store_normalised(dst, o_all, l_all, out_mask)


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (e^(2x) + 1): saturates to +-1 without overflow trouble (e^(2x) = inf -> 1)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _tile_blocks(table_row, tile, cols, kv_end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The physical KV block of each position of KV tile `tile` (int64; 0 past kv_end, unloaded)."""
    pos = tile * BLOCK_N + cols
    return tl.load(table_row + pos // BLOCK_SIZE, mask=pos < kv_end, other=0).to(tl.int64)


@triton.jit
def _store_partials(part_max_ptr, part_sum_ptr, part_acc_ptr, part, m_i, l_i, acc, row_ok, dims, D_PAD: tl.constexpr):
    """One split's (max, sum, unnormalised acc) of each row, for the merge."""
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _store_normalised(dst, acc, l, mask):
    """out = acc / l (rows with no visible key: l = 0, acc = 0 -> 0)."""
    result = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(dst, result.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def merge_splits_kernel(
    out_ptr, qsl_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    num_reqs, num_q_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (token row, query head): out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)."""
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, D_PAD)
    dst = out_ptr + token * stride_ot + head * stride_oh + dims
    if token >= tl.load(qsl_ptr + num_reqs):       # padded token row: no request wrote scratch
        tl.store(dst, tl.zeros([D_PAD], dtype=out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (token * num_q_heads + head) * num_splits + splits
    m_s = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    m = tl.max(m_s, axis=0)
    w = tl.math.exp2(m_s - m)                       # empty splits: m_s = -inf -> weight 0
    total = tl.sum(l_s * w, axis=0)
    result = tl.sum(acc_s * w[:, None], axis=0) / total
    tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


MAX_SPLITS = 64
"""A power of two: the merge reads all splits of a row as one MAX_SPLITS-wide vector. 64 lets one
long sequence (batch 1, 8 KV heads) spread over 512 programs: about four per SM of an H100, the
parallelism a stream over the KV cache needs to approach the memory bandwidth."""
REQ_CHUNK = 64
"""Requests scanned per step of the owner search. Batch-dependent values (token and request
counts, splits) are runtime arguments, never constexprs or specialised ints: every capture size
then shares one compiled kernel per (model shape, tiles, split or not), so capturing 67 sizes does
not JIT-compile dozens of variants on a cold Triton cache."""
EAGER_TILES_PER_SPLIT = 4
"""An eager call splits only contexts of at least this many KV tiles per split: below that the
merge launch costs more host time (PIECEWISE runs it eagerly) than the split saves on the GPU."""
PREFILL_MIN_QUERY = 16
"""A step whose longest query has at least this many tokens takes the prefill tiles (BLOCK_M 128
rows): the K/V tiles a program loads then serve 128 / GROUP query tokens instead of 16 / GROUP,
and the dots fill the tensor cores. Decode-like steps keep the small tiles."""


def min_split_tiles() -> int:
    """KV tiles a split takes at least, inside the kernel (KernelConfig.min_split_tiles, read at each
    call): a context shorter than num_splits times this keeps fewer active splits; the splits past
    them exit at once (no stores, no ticket). 1 is the fastest on an H100 (`graphrunner bench decode
    --modes FULL --batch-sizes 1 --no-hf` with `--kernel-config '{"min_split_tiles": N}'`, N = 1, 2, 4:
    FULL bs1 Llama-3.2-1B 1.219 / 1.238 / 1.233 ms, Llama-3-8B 5.957 / 6.040 / 6.014 ms): with ~3-tile
    contexts, parallel one-tile splits plus a merge beat one program walking the context."""
    return active_kernel_config().min_split_tiles


MERGE_TICKETS = 1 << 16
"""Arrival counters for the in-kernel merge, one per (q block, KV head) program column: 64K int32
(256 KiB) per device covers every capture size; a launch that needs more takes the merge kernel."""
_tickets: dict[torch.device, torch.Tensor] = {}


def _merge_tickets(device: torch.device, needed: int, eager: bool = True) -> torch.Tensor | None:
    """The device's ticket counters (zero between launches: the last arrival resets its own), or
    None for the separate merge kernel: KernelConfig.fused_merge off (or auto for a launch made
    for a graph: inside a CUDA graph capture, or not `eager`), too many programs, or no buffer yet
    while a graph is being captured (one made there would live in the graph's pool). Made at the
    first call outside a capture; the engine's warm-up runs eagerly before any capture.
    `eager`: the caller gave the step's max_seq_len, as eager calls do; a FULL-mode call does not,
    captured or not (the start-up's forwards that queue the compiles of the captures,
    launch/compile_ahead.py, must pick the variants the graphs will launch)."""
    fused = active_kernel_config().fused_merge
    if fused is None:   # auto: the merge kernel for a graph, the in-kernel merge in an eager launch
        fused = eager and not _capturing(device)
    if not fused or needed > MERGE_TICKETS:
        return None
    tickets = _tickets.get(device)
    if tickets is None:
        if _capturing(device):
            return None
        tickets = _tickets[device] = torch.zeros(MERGE_TICKETS, dtype=torch.int32, device=device)
    return tickets


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


SPLIT_ROWS = 512
"""At most this many (token row x split) pairs: splits pay off for decode-like steps, where few
programs would otherwise each stream a long context; big batches have parallelism already, and
the scratch (rows x splits x Hq x D floats, 8 MiB for Llama-3-8B heads) stays small."""
_scratch_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_retired_scratch: list[tuple[torch.Tensor, torch.Tensor]] = []
"""Scratch replaced by a larger one: kept alive, as graphs captured before may still read it."""


def split_scratch(device: torch.device, rows: int, d_pad: int, num_q_heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(acc [rows * d_pad], max [rows], sum [rows]) float32 for the split partials of `rows`
    (token x head x split) rows: views of one persistent per-device buffer, made for at least
    SPLIT_ROWS x `num_q_heads` rows (all any default split needs), so every FULL graph and eager
    step reads partials at the same addresses and no launch allocates. Made or grown only outside
    a capture (the engine's warm-up runs eagerly first); a capture that needs more than there is
    gets its own from the graph pool. The layers of a step share it: they run one after another
    on the stream."""
    held = _scratch_buffers.get(device)
    if held is None or held[0].numel() < rows * d_pad or held[1].numel() < 2 * rows:
        if _capturing(device):
            part_stats = torch.empty(2 * rows, dtype=torch.float32, device=device)
            return torch.empty(rows * d_pad, dtype=torch.float32, device=device), part_stats[:rows], part_stats[rows:]
        if held is not None:
            _retired_scratch.append(held)
        size = max(rows, SPLIT_ROWS * num_q_heads, 0 if held is None else held[1].numel() // 2)
        acc_size = max(size * d_pad, 0 if held is None else held[0].numel())
        held = _scratch_buffers[device] = (torch.empty(acc_size, dtype=torch.float32, device=device),
                                           torch.empty(2 * size, dtype=torch.float32, device=device))
    part_acc, part_stats = held
    size = part_stats.numel() // 2
    return part_acc[: rows * d_pad], part_stats[:rows], part_stats[size: size + rows]


def default_num_splits(num_tokens: int, num_reqs: int, num_kv_heads: int, device: torch.device,
                       max_seq_len: int | None = None) -> int:
    """KV splits per q block: enough (request, kv head, split) programs to give every SM about
    four. On an H100 this picks 64 / 8 / 2 splits for bs 1 / 8 / 32 with 8 KV heads
    (`graphrunner bench attention --context-len 32768`; docs/PERFORMANCE.md). Inside a captured
    graph only padded shapes are known (the graph replays whatever was chosen at capture; the kernel
    then keeps only the splits the context fills, at least min_split_tiles tiles each); an eager
    call may pass the step's `max_seq_len`, and then gets a split only per EAGER_TILES_PER_SPLIT KV
    tiles, so a short context skips the split scratch and the merge (PIECEWISE runs attention eagerly,
    where each launch is host time)."""
    if device.type != "cuda" or num_reqs == 0:
        return 1
    wanted = min(4 * num_sms(device) // (num_reqs * num_kv_heads), MAX_SPLITS, SPLIT_ROWS // num_tokens)
    if max_seq_len is not None:
        wanted = min(wanted, -(-max_seq_len // launch_config(device)["BLOCK_N"]) // EAGER_TILES_PER_SPLIT)
    return 1 << (wanted.bit_length() - 1) if wanted >= 2 else 1


def use_prefill_tiles(num_tokens: int, num_reqs: int, max_query_len: int | None = None) -> bool:
    """Whether a step takes the prefill tiles: its longest query has PREFILL_MIN_QUERY tokens or more
    (`max_query_len`, known to an eager call), or, inside a graph, where only padded shapes are
    known, its token rows are that many and at least twice its request rows (a uniform decode batch
    never is)."""
    if max_query_len is not None:
        return max_query_len >= PREFILL_MIN_QUERY
    return num_tokens >= PREFILL_MIN_QUERY and num_tokens >= 2 * num_reqs


def tile_sizes(num_q_heads: int, num_kv_heads: int, prefill: bool = False,
               device: torch.device | None = None) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): BLOCK_M rows = BLOCK_Q tokens x GROUP heads, at least 16 for tl.dot
    (prefill: at least launch_config's BLOCK_M rows)."""
    group = num_q_heads // num_kv_heads
    least = launch_config(device or torch.device("cuda"), True)["BLOCK_M"] if prefill else 16
    block_m = max(least, triton.next_power_of_2(group))
    return block_m, block_m // group


@functools.cache
def launch_config(device: torch.device, prefill: bool = False) -> dict:
    """KV tile length and the compiler's warps / pipelining depth (tuned on an H100 with
    `graphrunner bench attention`), for decode-like steps or (prefill) the prefill tiles, whose
    BLOCK_M is given here too; the interpreter gets short tiles (faster in numpy). Cached, as
    every eager call reads it: do not mutate the result."""
    if device.type == "cpu":
        return dict(BLOCK_N=32, num_warps=4, num_stages=1, **(dict(BLOCK_M=32) if prefill else {}))
    if prefill:
        return dict(PREFILL_CONFIG)
    return dict(BLOCK_N=128, num_warps=4, num_stages=2)


PREFILL_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
"""The prefill tiles on a GPU (`graphrunner bench attention --prefill-len 8192`, docs/PERFORMANCE.md)."""


@functools.cache
def _constexprs(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
                prefill: bool = False) -> dict:
    """The kernel's compile-time arguments, which depend on the model, the device and the tiles
    only: computed once, not per call (an eager PIECEWISE step calls the kernel once per layer)."""
    block_m, block_q = tile_sizes(num_q_heads, num_kv_heads, prefill, device)
    config = {k: v for k, v in launch_config(device, prefill).items() if k != "BLOCK_M"}
    return dict(GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
                BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, REQ_CHUNK=REQ_CHUNK,
                DOT_FP32=device.type == "cpu", PDL=use_pdl(device), **config)


_attention_launch = FastLaunch(attention_kernel)
_merge_launch = FastLaunch(merge_splits_kernel)


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      scale: float, num_splits: int | None = None, max_seq_len: int | None = None,
                      sliding_window: int | None = None, soft_cap: float | None = None,
                      max_query_len: int | None = None, prefill_tiles: bool | None = None) -> None:
    """Causal paged attention of query [T, Hq, D] over kv_cache [2, num_blocks, block_size, Hkv, D]
    into out [T, Hq, D]. Request r's queries are rows query_start_loc[r]:query_start_loc[r+1] and
    its KV is the first seq_lens[r] positions of its block_table row. Rows past
    query_start_loc[-1] are set to 0. No host sync, no value-dependent allocation: capturable.
    `max_seq_len` (eager calls only: a graph would freeze it) lets the split count fit the step.
    `sliding_window` (a query at p sees keys > p - window) and `soft_cap` (scores -> cap * tanh(s / cap))
    are per-layer constants of the launch (constexpr flags, runtime values): capturable too.
    `max_query_len` (eager calls only) picks the tiles from the step's longest query
    (`use_prefill_tiles`; inside a graph, from padded shapes); `prefill_tiles` forces the choice."""
    launch = _plan(query, kv_cache, out, query_start_loc, seq_lens, block_table, scale, num_splits, max_seq_len,
                   sliding_window, soft_cap, max_query_len, prefill_tiles)
    if launch is not None:
        launch.run()


class _Launch:
    """One attention launch, its arguments bound (the split merge's too, when it needs its own kernel)."""

    def __init__(self, grid: tuple, args: tuple, options: dict, merge: tuple | None) -> None:
        self.grid, self.args, self.options, self.merge = grid, args, options, merge

    def run(self):
        """Launch; returns the attention kernel FastLaunch ran (None: it took Triton's own path)."""
        kernel = _attention_launch(self.grid, *self.args, **self.options)
        if self.merge is not None:
            grid, args, options = self.merge
            _merge_launch(grid, *args, **options)
        return kernel


def _plan(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
          seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, num_splits: int | None,
          max_seq_len: int | None, sliding_window: int | None = None, soft_cap: float | None = None,
          max_query_len: int | None = None, prefill_tiles: bool | None = None) -> _Launch | None:
    """Check the arguments and bind the launch (None: nothing to launch)."""
    # Eager PIECEWISE calls this once per layer per step: each tensor's shape and strides are read
    # once (every .stride(i) call is a dispatch), and no Triton helper runs on the host.
    num_tokens, num_q_heads, head_dim = query.shape
    cache_shape = kv_cache.shape
    num_kv_heads = cache_shape[3]
    num_reqs = seq_lens.shape[0]
    q_stride, out_stride, cache_stride, table_stride = query.stride(), out.stride(), kv_cache.stride(), block_table.stride()
    if out.shape != query.shape or cache_shape[4] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"unified_attention shapes disagree: query {tuple(query.shape)}, "
                         f"out {tuple(out.shape)}, kv_cache {tuple(kv_cache.shape)}")
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] != num_reqs:
        raise ValueError(f"metadata for {num_reqs} requests: query_start_loc {tuple(query_start_loc.shape)}, "
                         f"block_table {tuple(block_table.shape)}")
    if q_stride[2] != 1 or out_stride[2] != 1 or cache_stride[4] != 1 or table_stride[1] != 1:
        raise ValueError("unified_attention needs a contiguous head dim and contiguous block_table rows")
    if num_tokens == 0:
        return None
    if num_reqs == 0:
        out.zero_()
        return None
    if prefill_tiles is None:
        prefill_tiles = use_prefill_tiles(num_tokens, num_reqs, max_query_len)
    device = query.device
    constexprs = _constexprs(num_q_heads, num_kv_heads, head_dim, cache_shape[2], device, prefill_tiles)
    q_blocks = -(-num_tokens // constexprs["BLOCK_Q"]) + num_reqs
    if num_splits is None:   # prefill tiles: parallel over q blocks already, split only a short query
        num_splits = default_num_splits(num_tokens, q_blocks if prefill_tiles else num_reqs, num_kv_heads, device,
                                        max_seq_len)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    d_pad = constexprs["D_PAD"]
    grid = (q_blocks, num_kv_heads, num_splits)
    # The in-kernel merge holds a [BLOCK_M, D] accumulator per split: for the prefill tiles' 128
    # rows that is too many registers, so their (rare) splits always take the merge kernel.
    tickets = None if prefill_tiles else _merge_tickets(device, grid[0] * num_kv_heads, max_seq_len is not None)
    fused_merge = num_splits > 1 and tickets is not None
    if num_splits > 1:
        part_acc, part_max, part_sum = split_scratch(device, num_tokens * num_q_heads * num_splits, d_pad, num_q_heads)
    else:
        part_acc = part_max = part_sum = seq_lens     # unused (not `out`: StepAttention keeps these)
    c = constexprs
    device_index = device.index or 0
    # Every parameter positionally, constexprs included, in signature order (FastLaunch's contract).
    # query, kv_cache and out come first: StepAttention swaps them per layer.
    args = (query, kv_cache, out, query_start_loc, seq_lens, block_table,
            part_acc, part_max, part_sum, tickets if tickets is not None else seq_lens,
            scale * LOG2E, sliding_window or 0, (soft_cap or 0.0) * LOG2E, num_tokens, num_reqs, num_q_heads, num_splits,
            q_stride[0], q_stride[1], out_stride[0], out_stride[1],
            cache_stride[0], cache_stride[1], cache_stride[2], cache_stride[3], table_stride[0],
            c["GROUP"], c["HEAD_DIM"], d_pad, c["BLOCK_SIZE"], c["BLOCK_M"], c["BLOCK_Q"], c["BLOCK_N"],
            c["REQ_CHUNK"], num_splits > 1, c["DOT_FP32"], fused_merge, min_split_tiles(), MAX_SPLITS,
            sliding_window is not None, soft_cap is not None, c["PDL"])
    options = dict(device_index=device_index, num_warps=c["num_warps"], num_stages=c["num_stages"],
                   launch_pdl=c["PDL"])
    merge = None
    if num_splits > 1 and not fused_merge:
        merge = ((num_tokens, num_q_heads),
                 (out, query_start_loc, part_acc, part_max, part_sum, num_reqs, num_q_heads, num_splits,
                  out_stride[0], out_stride[1], head_dim, d_pad, MAX_SPLITS, c["PDL"]),
                 dict(device_index=device_index, num_warps=4, num_stages=3, launch_pdl=c["PDL"]))
    return _Launch(grid, args, options, merge)


def layer_key(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
              sliding_window: int | None = None, soft_cap: float | None = None) -> tuple:
    """What may differ between two layers' calls and would change the launch: shapes, strides,
    dtypes, 16-byte alignment (Triton specialises on it), the scale, the sliding window and soft-cap."""
    return (query.shape, query.stride(), query.dtype, query.data_ptr() % 16 == 0, out.shape, out.stride(),
            out.dtype, out.data_ptr() % 16 == 0, kv_cache.shape, kv_cache.stride(), kv_cache.dtype,
            kv_cache.data_ptr() % 16 == 0, scale, sliding_window, soft_cap)


def _masking(key: tuple) -> tuple:
    """(sliding_window, soft_cap) of a `layer_key`: its last two fields."""
    return key[-2:]


_interned_keys: dict[tuple, tuple] = {}


def interned_layer_key(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
                       sliding_window: int | None = None, soft_cap: float | None = None) -> tuple:
    """`layer_key`, one object for equal keys (the layers of a model share theirs), so a
    StepAttention compares a PIECEWISE break's key by identity instead of field by field."""
    key = layer_key(query, kv_cache, out, scale, sliding_window, soft_cap)
    return _interned_keys.setdefault(key, key)


class StepAttention:
    """`unified_attention` for the eager calls of one step (every layer of a PIECEWISE replay or a
    NONE step), at a fraction of the host cost: the first call checks and binds the launch (split
    count, grid, strides, scratch, the compiled kernel); later calls whose q, KV cache and out have
    that call's shapes, strides, dtypes and alignment (`layer_key`; the layers of a model do)
    swap in their three tensors and relaunch the compiled kernel directly. Why: a PIECEWISE step
    of a 30-layer model launches attention 30 times from Python, and the checks, the split choice
    and FastLaunch's key cost more host time than the launch itself. A layer that differs, a split
    merge that needs its own kernel, or Triton's ordinary launch path (hooks, interpreter) falls
    back to `unified_attention` for that call. Split scratch is shared by the step's layers
    (they run one after another on the stream). Never use one across steps: it keeps `max_seq_len`
    and `max_query_len` (which pick the split count and the tiles)."""

    def __init__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 max_seq_len: int | None, max_query_len: int | None = None) -> None:
        self.metadata = (query_start_loc, seq_lens, block_table)
        self.max_seq_len = max_seq_len
        self.max_query_len = max_query_len
        self._key: tuple | None = None
        self._kernel = None
        self._grid: tuple = ()
        self._rest: tuple = ()
        """Every argument after query, kv_cache and out, tensors as their device addresses (the C
        launcher takes an int as it is; a tensor costs it a `data_ptr()` call and a driver query)."""
        self._alive: tuple = ()   # the tensors behind those addresses
        self._direct = None   # FastLaunch.direct_launch of the bound kernel, grid and stream (None: relaunch)
        self._native: tuple[KernelLaunch, int] | bool | None = None   # native_launch's answer, once worked out
        self._device_index = 0
        self._stream = None
        self.relaunches = 0
        """Calls that took the bound launch (for tests)."""

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> None:
        self.call_keyed(layer_key(query, kv_cache, out, scale, sliding_window, soft_cap), query, kv_cache, out, scale)

    def call_keyed(self, key: tuple, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                   scale: float) -> None:
        """`__call__` with `layer_key(query, kv_cache, out, scale)` already known (a PIECEWISE
        break computes it once at capture: its tensors never change)."""
        if self._kernel is not None and key == self._key:
            self._relaunch(query, kv_cache, out)
            return
        launch = _plan(query, kv_cache, out, *self.metadata, scale, None, self.max_seq_len, *_masking(key),
                       self.max_query_len)
        if launch is None:
            return
        kernel = launch.run()
        if kernel is not None and launch.merge is None and self._kernel is None:
            self._bind(key, kernel, launch)

    def bind_without_launch(self, key: tuple, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                            scale: float) -> bool:
        """Bind the step's launch for layers with `key` from these tensors without launching it (the
        PIECEWISE step graph launches every layer, runner/cudagraph/step_graph.py). False where it
        cannot be bound: nothing to launch, a split merge that needs its own kernel, no compiled
        kernel for this launch yet (an eager call compiles it), or another key already bound."""
        if self._kernel is not None:
            return key is self._key or key == self._key
        launch = _plan(query, kv_cache, out, *self.metadata, scale, None, self.max_seq_len, *_masking(key),
                       self.max_query_len)
        if launch is None or launch.merge is not None:
            return False
        kernel = _attention_launch.compiled_kernel(launch.args, **launch.options)
        if kernel is None:
            return False
        self._bind(key, kernel, launch)
        return True

    def _bind(self, key: tuple, kernel: Any, launch: "_Launch") -> None:
        self._key, self._kernel, self._grid = key, kernel, launch.grid
        self._alive = launch.args[3:]
        self._rest = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self._alive)
        self._device_index = launch.options["device_index"]
        self._stream = _attention_launch.stream_of(self._device_index)   # the step's stream
        self._direct = _attention_launch.direct_launch(kernel, launch.grid, self._stream)

    def call_addressed(self, key: tuple, addresses: tuple[int, int, int], query: torch.Tensor,
                       kv_cache: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """`call_keyed` for tensors that never move (a PIECEWISE break's recorded q, KV cache and
        out), with their `addresses` (data_ptr) computed once: once the step's launch is bound, a
        call is Triton's C launch on ints alone (`FastLaunch.direct_launch` where offered). Equal keys are one
        object when they come from `interned_layer_key`: then `is` decides."""
        if self._kernel is not None and (key is self._key or key == self._key):
            self._relaunch(*addresses)
            return
        self.call_keyed(key, query, kv_cache, out, scale)

    def native_launch(self, key: tuple) -> tuple[KernelLaunch, int] | None:
        """The bound launch in driver form with this step's grid and arguments, and its stream, for
        layers whose `layer_key` is `key` (the PIECEWISE step graph's attention nodes,
        runner/cudagraph/step_graph.py), or None: nothing bound, another key, or a launch without
        a driver form (launch/driver_launch.py). Worked out once per step."""
        if self._kernel is None or not (key is self._key or key == self._key):
            return None
        if self._native is None:
            launch = kernel_launch(self._kernel, self._grid, (0, 0, 0) + self._rest)
            self._native = (launch, self._stream) if launch is not None else False
        return self._native or None

    def _relaunch(self, query, kv_cache, out) -> None:
        """The bound launch with this layer's q, KV cache and out (tensors or their addresses)."""
        if self._direct is not None:
            self._direct(query, kv_cache, out, *self._rest)
        else:
            _attention_launch.relaunch(self._kernel, self._grid, (query, kv_cache, out) + self._rest,
                                       self._device_index, self._stream)
        self.relaunches += 1
