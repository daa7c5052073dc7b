"""Fused linear kernels for few rows (decode): the norm folded into the projection, SiLU*mul into gate_up.

A small model's decode step replayed from a CUDA graph is bound by the number and latency of its
kernels, not by bytes: SmolLM2-135M spends ~4 us in each of its 120 cuBLAS GEMMs per step on an
H100 (`GRAPHRUNNER_FUSED_OPS=0 graphrunner bench profile_step --mode FULL --batch-size 1`), plus an
add+RMSNorm and a SiLU*mul kernel per layer. Here one launch does what took two:

    norm_linear(x, residual, norm_w, eps, W, b)        = (RMSNorm(x + residual) @ W.T + b, x + residual)
    norm_gate_up_silu(x, residual, norm_w, eps, W, b)  = (silu(gate) * up, x + residual), [gate|up] = norm(..) @ W.T + b
    linear(x, W, b)                                    = x @ W.T + b   (a plain GEMV, for o_proj / down_proj)
    linear_all_reduce(x, W, push)                      = x @ W.T summed over the tensor-parallel ranks in the
                                                         GEMV's epilogue (one row; models/push_all_reduce.py)
    norm_qkv_rope_cache(x, residual, ..., kv_cache, slots) = norm_linear into qkv, then neox RoPE on q/k and
                                                         k/v written into the paged cache (one row only)

`norm_qkv_rope_cache` (`_norm_qkv_rope_cache_kernel`, one decode row; models/small_batch_qkv_rope.py,
re-exported here so the decoder layer finds every one-row kernel in this module) has its own kernel: a program
owns column PAIRS (c, c + D/2) of the same head, accumulated side by side in the K loop as GATED's
gate and up rows, so the epilogue can rotate them without leaving registers; v heads are pairs
copied as they are. Its GEMV, norm and rounding are the M == 1 path below, with norm_linear's
BLOCK_K (the same fp32 summation order), so it equals norm_linear + rope_and_cache.

Design (one kernel, `_small_rows_kernel`, specialised by constexpr flags):
  * grid = (cdiv(N, BLOCK_N),): a program owns BLOCK_N output columns for ALL rows (M <= MAX_ROWS),
    so every weight element is read exactly once; no split-K (it would need a second launch or
    atomics). One row on a GPU: thin programs (BLOCK_N 2, ONE_ROW_TILES, measured) stream the
    weight at up to ~3 TB/s on an H100, above cuBLAS's GEMV.
  * the norm: every program computes the rms of each row itself (first pass over x, which is at
    most a few thousand elements and sits in L2), then re-normalises x tile by tile while streaming
    its weight tile. Only the programs of column tile 0 store residual_out: no races.
  * M == 1: no tensor cores; an elementwise multiply into a [BLOCK_N, BLOCK_K] fp32 accumulator,
    reduced once after the K loop. M > 1: rows padded to BLOCK_M = max(16, next_pow2(M)) and
    tl.dot (model dtype in, fp32 accumulate); fp32 weights use input_precision="ieee" (true fp32,
    not tf32: the GPU tests compare graph modes with greedy parity in fp32).
  * K need not be a power of two (576, 1536): the K loop masks its last tile.
  * rounding points are exactly those of the unfused path: the residual add in the model dtype,
    normalise in fp32 -> model dtype -> times the norm weight -> model dtype (models.layers.RMSNorm,
    `_add_rms_norm_kernel`); GEMM in fp32, + bias, rounded to the model dtype; gate and up rounded
    to the model dtype before silu(gate) (rounded) * up (rounded), as `_silu_and_mul_kernel`.
  * no host syncs and no value-dependent allocation: everything runs inside CUDA graph capture.

One-row tiles are measured (`graphrunner bench gemv_configs`, ONE_ROW_TILES); the tl.dot tiles of
2..MAX_ROWS rows are not tuned (the model sends only one row here: models.layers.SMALL_BATCH_MAX_ROWS)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from configs.kernel_config import active_kernel_config
from launch.fast_launch import FastLaunch, num_sms
from launch.pdl import use_pdl, wait_for_producers
from models.push_all_reduce import (ProjectionReduce, PushAllReduce, lane_bits, push_lanes,
                                    summed_lanes, tag_of_call)

MAX_ROWS = 32
"""Most rows the kernels take (BLOCK_M = 32 then; the accumulator and the x tile grow with it).
Which row counts the model actually sends here is models.layers.SMALL_BATCH_MAX_ROWS."""


@triton.jit
def _load_rows(x_ptr, res_ptr, res_out_ptr, offs_m, offs_k, mask, stride_xm, stride_xk, stride_rm, stride_rk,
               K, STORE_RESIDUAL, HAS_RESIDUAL: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] (+ residual, added in the model dtype; stored into residual_out when
    STORE_RESIDUAL is true)."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :] * stride_rk, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if STORE_RESIDUAL:
            tl.store(res_out_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=mask)
    return x


@triton.jit
def _rms_inv(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, stride_xm, stride_xk, stride_rm, stride_rk, K, eps,
             STORE_RESIDUAL, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, RMS_BLOCK: tl.constexpr):
    """1 / rms of each row of x (+ residual), in a pass of its own over K (the rows are at most a
    few thousand elements and sit in L2); residual_out is stored on the way when STORE_RESIDUAL.
    RMS_BLOCK is K's power of two (up to 8192): one round trip to L2 and the same summation as
    `_add_rms_norm_kernel`, the unfused path."""
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, RMS_BLOCK):
        offs_k = k0 + tl.arange(0, RMS_BLOCK)
        mask = m_mask[:, None] & (offs_k < K)[None, :]
        x = _load_rows(x_ptr, res_ptr, res_out_ptr, offs_m, offs_k, mask, stride_xm, stride_xk,
                       stride_rm, stride_rk, K, STORE_RESIDUAL, HAS_RESIDUAL)
        x32 = x.to(tl.float32)
        sum_sq += tl.sum(x32 * x32, axis=1)
    return tl.rsqrt(sum_sq / K + eps)


@triton.jit
def _weight_tile(w_rows, up_offset, k0, n_mask, K, GATED: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile [BLOCK_N, BLOCK_K] at k0 of the weight rows (and of the up rows, `up_offset` further,
    when GATED; else the same tile again, never used). A tile past K is all masked: no loads."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w_mask = n_mask[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
    if GATED:
        w_up = tl.load(w_rows + up_offset + offs_k[None, :], mask=w_mask, other=0.0)
    else:
        w_up = w
    return w, w_up


@triton.jit
def _normalise(x, inv, norm_w_ptr, offs_k, k_mask):
    """RMSNorm's rounding points: x * inv in fp32, to the model dtype, times the weight, to the
    model dtype (models.layers.RMSNorm, `_add_rms_norm_kernel`)."""
    nw = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0)
    h = (x.to(tl.float32) * inv[:, None]).to(x.dtype).to(tl.float32) * nw.to(tl.float32)[None, :]
    return h.to(x.dtype)


@triton.jit
def _small_rows_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
                       M, N, K, eps, stride_xm, stride_xk, stride_rm, stride_rk,
                       ar_buffer_ptrs, ar_tickets_ptr, ar_slot_words,
                       HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, IEEE: tl.constexpr, ONE_TILE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       RMS_BLOCK: tl.constexpr, PDL: tl.constexpr,
                       ALL_REDUCE: tl.constexpr, AR_RANK: tl.constexpr, AR_WORLD: tl.constexpr,
                       AR_ELEM_BITS: tl.constexpr, AR_LANES: tl.constexpr, AR_STRONG: tl.constexpr,
                       AR_TIMEOUT_NS: tl.constexpr, AR_RECORD: tl.constexpr):
    """out[M, N] = prologue(x) @ W[N, K].T (+ b); GATED: W is [2N, K] = [gate; up] and
    out = silu(gate) * up. W contiguous; out and residual_out contiguous [M, N] / [M, K].
    ONE_TILE (K <= BLOCK_K): x is read once and the rms computed in the K loop's only iteration,
    after the weight loads are issued, instead of in a pass of its own.
    The K loop is pipelined by hand, one tile ahead: the first weight tile is requested before
    the rms pass (and, with PDL, before waiting for the kernel that produces x), each later one
    before the current tile is used, so DRAM latency overlaps the work instead of preceding it.
    ALL_REDUCE (one row, N whole tiles of AR_LANES 32-bit lanes): the output is summed over the
    tensor-parallel ranks in the epilogue (`linear_all_reduce`): the program pushes its rounded
    columns into the peers' buffers and adds theirs (models/push_all_reduce.py's protocol). Its
    columns come from a ticket (a call counter in device memory, shared by the grid's programs), not
    from its program id: ticket t takes column tile t % grid of call t // grid + 1, so a program
    waiting for the peer's same tile runs only once every lower tile of its rank has been started,
    and each rank's lowest waiting tile is one its peer also starts: the ranks never wait on each
    other in a circle, however the GPUs schedule the programs. Only such GEMVs touch the counter, and
    two of them never overlap (a kernel between them waits for the first to end), so taking the
    ticket before the PDL wait is safe."""
    if ALL_REDUCE:
        programs = tl.num_programs(0)
        ticket = tl.atomic_add(ar_tickets_ptr, 1, sem="relaxed")
        pid_n = ticket % programs
        tag32, parity = tag_of_call(ticket // programs + 1)
    else:
        pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    w_next, w_up_next = _weight_tile(w_rows, N * K, 0, n_mask, K, GATED, BLOCK_K)
    wait_for_producers(PDL)

    if HAS_NORM and not ONE_TILE:  # pass 1: each row's rms (and residual_out, from column tile 0 only)
        inv = _rms_inv(x_ptr, res_ptr, res_out_ptr, offs_m, m_mask, stride_xm, stride_xk, stride_rm, stride_rk,
                       K, eps, pid_n == 0, HAS_RESIDUAL, BLOCK_M, RMS_BLOCK)

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w, w_up = w_next, w_up_next
        w_next, w_up_next = _weight_tile(w_rows, N * K, k0 + BLOCK_K, n_mask, K, GATED, BLOCK_K)
        x_mask = m_mask[:, None] & k_mask[None, :]
        if HAS_NORM and ONE_TILE:   # the whole row is here: its rms, and residual_out from tile 0
            x = _load_rows(x_ptr, res_ptr, res_out_ptr, offs_m, offs_k, x_mask, stride_xm, stride_xk,
                           stride_rm, stride_rk, K, pid_n == 0, HAS_RESIDUAL)
            x32 = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(x32 * x32, axis=1) / K + eps)
        else:
            x = _load_rows(x_ptr, res_ptr, res_out_ptr, offs_m, offs_k, x_mask, stride_xm, stride_xk,
                           stride_rm, stride_rk, K, False, HAS_RESIDUAL)
        if HAS_NORM:
            x = _normalise(x, inv, norm_w_ptr, offs_k, k_mask)
        if BLOCK_M == 1:
            xf = x.to(tl.float32)  # [1, BLOCK_K] against [BLOCK_N, BLOCK_K]
            acc += w.to(tl.float32) * xf
            if GATED:
                acc_up += w_up.to(tl.float32) * xf
        else:
            xw = x.to(w.dtype)
            if IEEE:
                acc = tl.dot(xw, tl.trans(w), acc, input_precision="ieee")
                if GATED:
                    acc_up = tl.dot(xw, tl.trans(w_up), acc_up, input_precision="ieee")
            else:
                acc = tl.dot(xw, tl.trans(w), acc)
                if GATED:
                    acc_up = tl.dot(xw, tl.trans(w_up), acc_up)

    if BLOCK_M == 1:
        res = tl.sum(acc, axis=1)[None, :]
        res_up = tl.sum(acc_up, axis=1)[None, :]
    else:
        res = acc
        res_up = acc_up
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        res += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            res_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = res.to(out_ty).to(tl.float32)
        up = res_up.to(out_ty).to(tl.float32)
        res = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * up
    if ALL_REDUCE:   # row 0 (the only one): its columns rounded, as lanes, summed with the peers'
        if AR_ELEM_BITS == 32:
            lo = tl.reshape(res, [AR_LANES])
            hi = tl.zeros_like(lo)
        else:   # columns 2i and 2i + 1: lane i's low and high half
            lo, hi = tl.split(tl.reshape(res, [AR_LANES, 2]))
        bits = lane_bits(lo, hi, AR_ELEM_BITS, out_ty)
        lane_offs = pid_n * AR_LANES + tl.arange(0, AR_LANES)
        lane_mask = lane_offs < N * AR_ELEM_BITS // 32
        push_lanes(bits, lane_offs, lane_mask, ar_buffer_ptrs, tag32, parity, ar_slot_words, AR_RANK, AR_WORLD,
                   AR_STRONG)
        summed = summed_lanes(bits, lane_offs, lane_mask, ar_buffer_ptrs, tag32, parity, ar_slot_words, pid_n,
                              AR_RANK, AR_WORLD, AR_ELEM_BITS, out_ty, AR_STRONG, AR_TIMEOUT_NS, 1, AR_RECORD)
        tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + lane_offs, summed, mask=lane_mask)
    else:
        out_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], res.to(out_ty), mask=out_mask)


_small_rows_launch = FastLaunch(_small_rows_kernel)

M1_ACC_ELEMENTS = 8192
"""fp32 accumulator elements a program of the M == 1 path holds (BLOCK_N x BLOCK_K, both tiles for
gate_up): 64 registers a thread at 4 warps."""

INTERPRETER_SMS = 8
"""The SM count block_sizes assumes for CPU tensors (Triton's interpreter, the tests): few programs,
since the interpreter's cost is per program."""


ONE_ROW_TILES = dict(block_n=2, block_k=1024, num_warps=4, num_stages=1)
"""A GPU's one-row tiles (BLOCK_N plain columns, or gate/up or RoPE column pairs at half of it).
Measured on an H100 (`graphrunner bench gemv_configs`: 16 configurations, bf16, cold weights):
2 x 1024 with 4 warps is the fastest or within 3% of it for every weight of SmolLM2-135M,
Llama-3.2-1B and Llama-3-8B, and beats cuBLAS on all but SmolLM2's LM head (tied): e.g. Llama-3-8B
gate_up 84.5 -> 79.0 us (2974 GB/s), its LM head 381 -> 337 us, Llama-3.2-1B down 15.8 -> 13.7.
Many thin programs (N / 2 of them) keep enough loads in flight; one 16-byte load per thread and
row per iteration; the loop is not pipelined (num_stages 3 measured the same as 1)."""


def one_row_block_n() -> int:
    """BLOCK_N of a one-row GEMV on a GPU: KernelConfig.one_row_block_n when set, else ONE_ROW_TILES'.
    Why 2 stays the default: 4 x 1024 wins in isolation on many weights (`graphrunner bench
    gemv_configs`: on an H200 Llama-3-8B down 33.1 -> 29.4 us, its TP=2 qkv shard 9.8 -> 8.4), but in
    the decode step (`GRAPHRUNNER_ONE_ROW_BLOCK_N=4 graphrunner bench decode --modes FULL
    --batch-sizes 1`) it is 3% faster on an H200 for Llama-3-8B and 0.7-2% slower on an H100 for
    Llama-3-8B and Llama-3.2-1B (docs/PERFORMANCE.md, "One-row GEMV tiles")."""
    return active_kernel_config().one_row_block_n or ONE_ROW_TILES["block_n"]


def one_row_block_k() -> int:
    """BLOCK_K of a one-row GEMV on a GPU: KernelConfig.one_row_block_k when set, else ONE_ROW_TILES'.
    A program requests its first K tile before it waits for the kernel producing x (PDL), so a wider
    tile would stream more of its weight while that kernel (an all-reduce, under tensor parallelism)
    ends; measured in the step it loses more than that gains: Llama-3-8B bs 1 on two H200s, TP=1 /
    TP=2 4.49 / 2.80 ms with 1024, 4.77 / 2.94 with 2048, 6.17 / 3.62 with 4096
    (`GRAPHRUNNER_ONE_ROW_BLOCK_K=N graphrunner bench decode --shapes llama-3-8b --modes FULL
    --batch-sizes 1 --tensor-parallel-size 1 2`; docs/PERFORMANCE.md, "One-row GEMV tiles")."""
    return active_kernel_config().one_row_block_k or ONE_ROW_TILES["block_k"]


def block_sizes(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, gated: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for `rows` x [n outputs, k inputs]. One row on a GPU:
    ONE_ROW_TILES (BLOCK_K down to K's power of two). Otherwise untuned: BLOCK_N is the largest
    power of two in [min, 64] whose grid still has ~2 programs per SM (min 16 for tl.dot, 8 for
    the elementwise one-row path of the interpreter, whose cost is per program); BLOCK_K as wide
    as the fp32 accumulator budget allows (one row) or 64-128 (tl.dot, pipelined through shared
    memory)."""
    block_m = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
    if block_m == 1 and device.type == "cuda":
        t = ONE_ROW_TILES
        block_n = one_row_block_n() // (2 if gated else 1)
        return 1, block_n, max(16, min(one_row_block_k(), triton.next_power_of_2(k))), t["num_warps"]
    sms = num_sms(device) if device.type == "cuda" else INTERPRETER_SMS
    min_n = 8 if block_m == 1 else 16
    block_n = 64
    while block_n > min_n and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    if block_m == 1:   # the fp32 accumulator(s) [BLOCK_N, BLOCK_K]: ~8192 elements, 64 registers a thread
        block_k = M1_ACC_ELEMENTS // (2 if gated else 1) // block_n
    else:
        block_k = 64 if dtype == torch.float32 or gated or block_m > 16 else 128
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    return block_m, block_n, block_k, 4


RMS_ELEMENTS = 8192
"""Elements of x (rows x columns) the separate rms pass loads at once: a whole row up to K = 8192
for one row (64 fp32 registers a thread at 4 warps)."""


def rms_block(k: int, block_m: int) -> int:
    """The rms pass's tile width: K's power of two (one iteration, the unfused norm's summation)
    within RMS_ELEMENTS for BLOCK_M rows."""
    return max(16, min(triton.next_power_of_2(k), RMS_ELEMENTS // block_m))


def _stages(rows: int, device: torch.device) -> int:
    return ONE_ROW_TILES["num_stages"] if rows == 1 and device.type == "cuda" else 3


def _launch(x, residual, norm_weight, eps, weight, bias, gated: bool, config: tuple | None = None,
            reduce: ProjectionReduce | None = None):
    """`config` = (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides block_sizes for one row
    (`graphrunner bench gemv_configs` sweeps it). `reduce`: all-reduce the output in the epilogue
    (`linear_all_reduce`, which checks that the tiles allow it)."""
    if x.dim() != 2:
        raise ValueError(f"expected 2-D x, got {tuple(x.shape)}")
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"small-row kernels take 1..{MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != k or not weight.is_contiguous() or (gated and weight.shape[0] % 2):
        raise ValueError(f"weight {tuple(weight.shape)} (contiguous {weight.is_contiguous()}) does not fit x "
                         f"{tuple(x.shape)}")
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        res_out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = block_sizes(rows, n, k, x.dtype, x.device, gated)
    stages = _stages(rows, x.device)
    pdl = use_pdl(x.device)
    if config is not None:
        if rows != 1:
            raise ValueError("a config override is for one row")
        block_n, block_k, warps, stages = config
    # FastLaunch: the LM head and NONE-mode steps launch this eagerly, where Triton's own launch
    # path costs tens of microseconds of host time (every parameter positionally, in order).
    _small_rows_launch(
        (triton.cdiv(n, block_n),),
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, out, res_out if res_out is not None else out,
        rows, n, k, float(eps), x.stride(0), x.stride(1),
        residual.stride(0) if residual is not None else 0, residual.stride(1) if residual is not None else 0,
        *(reduce[:3] if reduce is not None else (out, out, 0)),
        norm_weight is not None, residual is not None, bias is not None,
        gated, x.dtype == torch.float32, k <= block_k, block_m, block_n, block_k, rms_block(k, block_m), pdl,
        reduce is not None, *_reduce_constants(reduce, x.dtype, block_n),
        device_index=x.device.index or 0, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out, (res_out if residual is not None else x)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T + bias, x + residual) in one launch; x [M, K] (any strides),
    weight [N, K] contiguous, M <= MAX_ROWS. Without a residual the second result is x itself
    (the first layer: its input is the residual stream)."""
    return _launch(x, residual, norm_weight, eps, weight, bias, gated=False)


def norm_gate_up_silu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, x + residual) with [gate | up] = RMSNorm(x + residual) @ gate_up_weight.T + bias,
    gate_up_weight [2I, K] packed gate rows then up rows (as GatedMLP.gate_up_proj); one launch."""
    return _launch(x, residual, norm_weight, eps, gate_up_weight, bias, gated=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for x [M <= MAX_ROWS, K] (any strides), weight [N, K] contiguous."""
    return _launch(x, None, None, 0.0, weight, bias, gated=False)[0]


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, push: PushAllReduce) -> torch.Tensor | None:
    """x @ weight.T summed over the tensor-parallel group, in one launch: a row-parallel projection
    (o_proj, down_proj) of one decode row whose GEMV all-reduces its own output, so the step has no
    all-reduce kernel of its own, nor the launch gaps around one. None when this product cannot
    (rows, tiles or size; decided from shapes alone, the same on every rank): the caller then runs
    `linear` and all-reduces after it. The sum equals `linear` then `push.all_reduce_`, bit for bit."""
    if x.dim() != 2 or x.shape[0] != 1:
        return None
    n, k = weight.shape
    _, block_n, _, _ = block_sizes(1, n, k, x.dtype, x.device)
    bits = 8 * x.dtype.itemsize
    if n % block_n or block_n * bits % 32:
        return None
    reduce = push.projection_reduce(n * x.element_size(), x.dtype, x.device, triton.cdiv(n, block_n))
    if reduce is None:
        return None
    return _launch(x, None, None, 0.0, weight, None, gated=False, reduce=reduce)[0]


def _reduce_constants(reduce: ProjectionReduce | None, dtype: torch.dtype, block_n: int) -> tuple:
    """The kernel's AR_* constexprs (RANK, WORLD, ELEM_BITS, LANES, STRONG, TIMEOUT_NS, RECORD); fixed
    values when it does not all-reduce, so those variants compile once."""
    if reduce is None:
        return 0, 1, 32, 1, False, 0, False
    bits = 8 * dtype.itemsize
    return reduce.rank, reduce.world, bits, block_n * bits // 32, reduce.strong, reduce.timeout_ns, reduce.record



# The one-row qkv + RoPE + KV-write kernel lives in its own file (it reuses this file's helpers, hence
# imported after them); the decoder layer reaches it through this module (models.layers.small_batch).
from models.small_batch_qkv_rope import (_norm_qkv_rope_cache_kernel, norm_qkv_rope_cache,  # noqa: E402,F401
                                         qkv_rope_block_sizes)
