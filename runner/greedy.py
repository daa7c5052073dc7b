"""Greedy token choice on a GPU: argmax over each row of the logits in two short Triton launches.

Why not `logits.argmax(-1)`: for a decode step's few rows torch's reduction puts a whole row in
one block, so on an H100 it takes 13.4 us for SmolLM2's 49152-entry vocabulary and 37.3 us for
Llama's 128256 (`graphrunner bench profile_step --mode FULL --batch-size 1 [--shape llama-3.2-1b]`
with torch's argmax in its place): 3-6% of a one-row step, for 0.1-0.25 MB of logits; these two
launches take 1.9 + 1.2 us and 2.6 + 1.3 us.
Here pass 1 splits every row into chunks across the SMs, each program keeping the first
position of its chunk's largest value; pass 2 (one program per row) keeps the first chunk holding
the row's largest value. The result is torch's: the index of the FIRST maximum (ties go left).
NaN counts as +inf (torch ranks NaN above +inf; the two differ only for a row holding both).

Structured output's greedy rows take the same launches with the token bitmask read in pass 1
(`masked_argmax_rows`): a disallowed token counts as -inf in the rows marked constrained, which
is xgrammar's in-place masking followed by the argmax, without the masking kernel (launched
through Triton's per-call binding, on the host path the next step waits on) or writing the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from launch.fast_launch import FastLaunch, num_sms
from launch.pdl import use_pdl, wait_for_producers

BLOCK = 1024
"""Logits a program reads per loop step (8 per thread at 4 warps: one 16-byte load in bf16)."""
MAX_CHUNKS = 64
"""Chunks per row at most: pass 2 reduces them as one vector of this width (masked past the row's
count), so every row count launches one variant of it."""


@triton.jit
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, chunk_len, mask_ptr, mask_stride, constrained_ptr,
                          gate_ptr, BLOCK: tl.constexpr, MASKED: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    if GATED:
        if tl.load(gate_ptr) == 0:   # a graph's step that takes no greedy tokens: nothing to do
            return
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = chunk * chunk_len
    end = tl.minimum(start + chunk_len, V)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    if MASKED:   # an unconstrained row reads no bitmask word: its mask ends where the chunk starts
        mask_end = tl.where(tl.load(constrained_ptr + row) != 0, end, start)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row.to(tl.int64) * stride_row + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)            # NaN: above every finite logit
        if MASKED:                                       # bit idx % 32 of word idx // 32: allowed
            word = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + idx // 32, mask=idx < mask_end, other=-1)
            v = tl.where(((word >> (idx % 32)) & 1) != 0, v, float("-inf"))
        take = v > best                                  # strictly: a lane keeps the first of its largest
        best = tl.where(take, v, best)
        best_idx = tl.where(take, idx, best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    slot = row * tl.num_programs(1) + chunk
    tl.store(val_ptr + slot, top)
    tl.store(idx_ptr + slot, first)


@triton.jit(do_not_specialize=["chunks"])
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, chunks, gate_ptr, CHUNKS_PAD: tl.constexpr, GATED: tl.constexpr,
                        PDL: tl.constexpr):
    wait_for_producers(PDL)
    if GATED:
        if tl.load(gate_ptr) == 0:
            return
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < chunks
    vals = tl.load(val_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * chunks + c, mask=ok, other=2147483647)
    top = tl.max(vals, axis=0)
    first = tl.min(tl.where(vals == top, idxs, 2147483647), axis=0)
    tl.store(out_ptr + row, tl.where(first == 2147483647, 0, first).to(tl.int64))   # all -inf: index 0


_chunks_launch = FastLaunch(_argmax_chunks_kernel)
_rows_launch = FastLaunch(_argmax_rows_kernel)


def num_chunks(rows: int, vocab: int, sms: int) -> int:
    """Chunks per row: about two programs per SM over all rows, each at least one BLOCK long."""
    return max(1, min(MAX_CHUNKS, -(-2 * sms // rows), -(-vocab // BLOCK)))


def argmax_rows(logits: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum, as `logits.argmax(dim=-1)`. A 2-D
    tensor with contiguous rows; a CPU tensor takes torch's argmax (this is for the GPU).
    `gate` (a GPU int32 [1], read when the kernels run): 0 makes both launches return at once and
    leaves the result unwritten. A graph that computes every step's greedy tokens reads it so that
    a step which takes none (any row samples) skips the pass over the logits."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows takes 2-D logits with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if not logits.is_cuda or logits.shape[0] == 0 or logits.shape[1] >= 2 ** 31 - 1:
        return logits.argmax(dim=-1)
    return launch(logits, num_sms(logits.device), gate=gate)


def masked_argmax_rows(logits: torch.Tensor, bitmask: torch.Tensor, constrained: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's argmax where the rows with `constrained[row] != 0` see only the
    tokens their row of `bitmask` (int32 [rows, ceil(vocab / 32)], xgrammar's packing) allows;
    the same as masking those rows' disallowed logits to -inf and taking `argmax_rows`. GPU
    tensors (a CPU caller masks and takes torch's argmax)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("masked_argmax_rows takes 2-D logits and bitmask with contiguous rows")
    if bitmask.shape[0] < logits.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"the bitmask {tuple(bitmask.shape)} does not cover the logits {tuple(logits.shape)}")
    return launch(logits, num_sms(logits.device), (bitmask, constrained))


def queue_variants(vocab: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    """Inside compile_ahead's `queuing_launches` (start-up): queue the compile of every variant
    `argmax_rows` and `masked_argmax_rows` can launch for `vocab` logits in `dtypes`. The eager
    argmax runs on the steps whose graph did not take it (mixed batches, the sampler's greedy rows),
    so without this a variant compiled inside the serving loop. The row count changes no variant
    (`launch` keeps every pointer 16-byte aligned and pass 2 neither specialises on the chunk count
    nor pads it to a row-dependent width), so one row is queued per dtype: unmasked, and masked with
    the flags at an aligned and at a 4-byte offset (a request's row inside serving's flags)."""
    width = -(-vocab // 32)
    bitmask = torch.empty(1, width, dtype=torch.int32, device=device)
    flags = torch.empty(2, dtype=torch.int32, device=device)
    sms = num_sms(device)
    storage = torch.empty(vocab * max(d.itemsize for d in dtypes), dtype=torch.uint8, device=device)
    for dtype in dtypes:   # one allocation for all dtypes: a contiguous [1, vocab] view of it
        logits = storage[:vocab * dtype.itemsize].view(dtype).view(1, vocab)
        launch(logits, sms)
        for constrained in (flags[:1], flags[1:]):   # 16-byte aligned, and not
            launch(logits, sms, (bitmask, constrained))


def chunking(rows: int, vocab: int, sms: int) -> tuple[int, int]:
    """(chunks per row, chunk length): `num_chunks`, each chunk whole BLOCKs (none starts mid-block)."""
    chunk_len = -(-vocab // num_chunks(rows, vocab, sms))
    chunk_len = -(-chunk_len // BLOCK) * BLOCK
    return -(-vocab // chunk_len), chunk_len


def launch(logits: torch.Tensor, sms: int, masked: tuple[torch.Tensor, torch.Tensor] | None = None,
           gate: torch.Tensor | None = None) -> torch.Tensor:
    """The two launches for `sms` SMs (any device: the tests run them in Triton's interpreter);
    `masked`: (bitmask, constrained rows), as `masked_argmax_rows` takes them; `gate` as
    `argmax_rows` takes it."""
    rows, vocab = logits.shape
    chunks, chunk_len = chunking(rows, vocab, sms)
    slots = -(-rows * chunks // 4) * 4   # each half 16-byte aligned: the row count picks no variant
    scratch = torch.empty(2, slots, dtype=torch.float32, device=logits.device)
    vals, idxs = scratch[0], scratch[1].view(torch.int32)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    # Launched eagerly after every step: FastLaunch skips Triton's per-call binding (every
    # parameter positionally, in order).
    device_index = logits.device.index or 0
    pdl = use_pdl(logits.device)
    bitmask, constrained = masked if masked is not None else (out, out)   # unread without MASKED
    gate_ptr = out if gate is None else gate                               # unread without GATED
    _chunks_launch((rows, chunks), logits, vals, idxs, vocab, logits.stride(0), chunk_len, bitmask,
                   bitmask.stride(0), constrained, gate_ptr, BLOCK, masked is not None, gate is not None, pdl,
                   device_index=device_index, num_warps=4, num_stages=1, launch_pdl=pdl)
    _rows_launch((rows,), vals, idxs, out, chunks, gate_ptr, MAX_CHUNKS, gate is not None, pdl,
                 device_index=device_index, num_warps=1, num_stages=1, launch_pdl=pdl)
    return out
