"""The passes over a step's logits before the draw (Triton, GPU): the penalties, the float32 copy,
the top-k candidates and thresholds without `torch.topk`.

Why: at batch 256 over Llama's 128256 tokens every full-batch kernel moves ~130 MB, and the
sampling stage with penalties used to be a float32 copy, the penalties (a read and a write) and
`torch.topk` (a radix select: several passes and sorts, ~0.3 ms at batch 256 on an H100), while the
thresholds need only each row's few largest values. Here:

1. `_pass_kernel`, one program per (row, block of the vocabulary): reads the row's logits (any
   float dtype), where the row is constrained by structured output its token bitmask, and where
   it has penalties its slot's token flags (in the prompt, in the output) and the output counts
   of the tokens flagged as output, once; writes the penalised float32 logits (`out`: a new
   tensor, or the logits themselves in place) and the maximum of every sub-block of SUB tokens.
2. `_bound_kernel`, one program per row: m = the (k+1)-th largest sub-block maximum (by
   bisection on the values' order keys). The k+1 sub-blocks with the largest maxima hold k+1
   values >= m, so the row's (k+1)-th largest value is >= m: every value the thresholds can need
   (the k largest, the value after them, every token tied with them) is >= m, and few others are
   (on a 128256-token row of Gaussian logits, 51 to 72 for k = 50).
3. `_compact_kernel`, one program per (row, block): appends the block's values >= m and their
   tokens to the row's list (an atomic counter per row; at most CAP kept); a block whose sub-block
   maxima are all below m is not read.
4. `_sort_kernel`, one program per row: sorts the list, largest first. A row whose list overflowed
   (more than CAP values >= m: ties or a few blocks holding all the large values) takes the exact
   way instead: its (k+1)-th largest value t by bisection over the row, then the values above t
   and copies of t up to k+1, sorted. Given the rows' settings, the same program then computes
   the row's threshold (threshold_kernel.row_threshold) from what it sorted, with no launch of
   its own: a complete list of length K holds every value >= m, so the ties with the k-th value
   are all there; an overflowed row has its k largest values plus the next, whose ties past them
   it counts over the row, as after `torch.topk`.
The draw (runner/sampling/race_kernel.py) races over a row's list instead of the
row where the list is complete and the row's threshold is >= m (every token it keeps is listed).

Penalties: same formula and order as the torch path (runner/sampling/processors.py
`_apply_penalties_torch`, HF / vLLM): repetition over prompt and output tokens (divide a positive
logit, multiply a negative one), then minus frequency * count and presence * (count > 0) over
output tokens; a row whose slot is -1 has none. The results equal the torch path's up to float
rounding (the compiler may fuse a product and a subtraction); tests/test_logits_pass.py compares
them, and the candidates with `torch.topk`, in Triton's interpreter and on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from launch.fast_launch import FastLaunch
from runner.sampling.threshold_kernel import row_threshold

BLOCK = 2048
"""Tokens per program of the passes over the rows."""
MAX_SUB_BLOCK = 512
RANK_CHUNK = 32
"""List values the sort compares each value with at a time (`_sort_descending`): a [CAP, 32] tile,
32 comparisons per thread of its 8 warps at CAP 256."""
MAX_CANDIDATES = 256
"""The most candidates per row (top_k up to 255 with the one extra value the thresholds read);
more take `torch.topk`."""


@dataclass
class PenaltyColumns:
    """The penalties of every row of a batch, for the pass: row i's token state is
    `output_counts[slots[i]]` / `seen[slots[i]]` (slot -1: no penalties)."""
    slots: torch.Tensor        # [N] int64
    repetition: torch.Tensor   # [N] float32 (1: off)
    frequency: torch.Tensor    # [N] float32 (0: off)
    presence: torch.Tensor     # [N] float32 (0: off)
    output_counts: torch.Tensor   # [slots, V] int32
    seen: torch.Tensor            # [slots, V] uint8: 1 in the prompt, 2 in the output (SamplingStates.seen)


@dataclass
class Candidates:
    """Each row's largest values for the thresholds: `values[row, :K]` sorted, largest first, and
    (when C = K + 1) the next value, where `lengths[row] = (K, C)`. The lists as the compaction left
    them, for the draw (runner/sampling/race_kernel.py): `listed[row, :count[row]]` (unsorted) are
    the row's values >= `bound[row]` and `listed_ids` their tokens, complete where count <= CAP."""
    values: torch.Tensor    # [N, CAP] float32
    lengths: torch.Tensor   # [N, 2] int32
    listed: torch.Tensor    # [N, CAP] float32
    listed_ids: torch.Tensor  # [N, CAP] int32
    count: torch.Tensor     # [N] int32
    bound: torch.Tensor     # [N] float32
    threshold: torch.Tensor | None = None
    """[N, 1] float32: each row's min-p / top-k / top-p threshold, where `logits_pass` was given
    the rows' settings (runner/sampling/threshold_kernel.py's rules, in the sort's launch)."""
    maxima: torch.Tensor | None = None
    """[N, sub-blocks] float32: the pass's sub-block maxima (the bound's input)."""


@triton.jit
def _order_key(x):
    """int32 keys in the order of the float32 values x (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    """The float32 value of an `_order_key`."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _pass_kernel(x_ptr, stride_x, out_ptr, stride_out, max_ptr, stride_max, slots_ptr, counts_ptr, stride_counts,
                 seen_ptr, stride_seen, rep_ptr, freq_ptr, pres_ptr, bitmask_ptr, stride_bitmask, constrained_ptr,
                 V, BLOCK: tl.constexpr, SUB: tl.constexpr, PENALTIES: tl.constexpr, WRITE: tl.constexpr,
                 MAXIMA: tl.constexpr, MASKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if MASKED:   # structured output first: a constrained row's disallowed tokens to -inf
        limit = tl.where(tl.load(constrained_ptr + row) != 0, V, 0)
        word = tl.load(bitmask_ptr + row * stride_bitmask + offs // 32, mask=offs < limit, other=-1)
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
    if PENALTIES:
        slot = tl.load(slots_ptr + row)
        has = offs < tl.where(slot >= 0, V, 0)   # a row without penalties reads no state
        slot = tl.maximum(slot, 0).to(tl.int64)
        flags = tl.load(seen_ptr + slot * stride_seen + offs, mask=has, other=0)
        # The counts only where the token is in the output: few sectors of the row are read.
        count = tl.load(counts_ptr + slot * stride_counts + offs, mask=has & ((flags & 2) != 0), other=0)
        rep = tl.load(rep_ptr + row)
        freq = tl.load(freq_ptr + row)
        pres = tl.load(pres_ptr + row)
        seen = flags != 0
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        x = x - freq * count.to(tl.float32)
        x = x - pres * (count > 0).to(tl.float32)
    if WRITE:
        tl.store(out_ptr + row * stride_out + offs, x, mask=ok)
    if MAXIMA:
        subs = tl.max(tl.reshape(x, [BLOCK // SUB, SUB]), axis=1)
        tl.store(max_ptr + row * stride_max + block * (BLOCK // SUB) + tl.arange(0, BLOCK // SUB), subs)



@triton.jit
def _kth_key(keys, k):
    """The k-th largest of int32 `keys` (k >= 1, at most their number), by bisection on the key."""
    lo = tl.min(keys, axis=0).to(tl.int64)
    hi = tl.max(keys, axis=0).to(tl.int64)
    for _ in range(32):   # the largest t with count(keys >= t) >= k
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((keys >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit(do_not_specialize=["k1"])   # k + 1 is only compared with: one variant for every top-k
def _bound_kernel(max_ptr, stride_max, num, bound_ptr, counter_ptr, k1, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NB)
    m = tl.load(max_ptr + row * stride_max + idx, mask=idx < num, other=float("-inf"))
    tl.store(bound_ptr + row, _key_value(_kth_key(_order_key(m), k1)))
    tl.store(counter_ptr + row, 0)


@triton.jit
def _compact_kernel(x_ptr, stride_x, max_ptr, stride_max, bound_ptr, counter_ptr, list_ptr, ids_ptr, stride_list, V,
                    CAP, BLOCK: tl.constexpr, SUB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    bound = tl.load(bound_ptr + row)
    subs = tl.load(max_ptr + row * stride_max + block * (BLOCK // SUB) + tl.arange(0, BLOCK // SUB))
    if tl.max(subs, axis=0) >= bound:   # most blocks hold no value >= the bound: their maxima say so
        offs = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        take = (offs < V) & (x >= bound)
        # One atomic per value taken (a block takes a few): no scan over the block.
        pos = tl.atomic_add(counter_ptr + row + tl.zeros([BLOCK], tl.int64), 1, mask=take)
        keep = take & (pos < CAP)
        tl.store(list_ptr + row * stride_list + pos, x, mask=keep)
        tl.store(ids_ptr + row * stride_list + pos, offs, mask=keep)


@triton.jit
def _sort_descending(v, out, n, CAP: tl.constexpr, CHUNK: tl.constexpr):
    """`v` ([CAP] float32, -inf from position `n` on) stored to `out` (CAP floats) largest first, by
    rank: a value's place is the number of the first n values before it in the order of their keys
    (`_order_key`, descending; a tie goes by position), counted over CHUNK values of `out` at a
    time; the -inf after them stay where they are. Why not `tl.sort`: its bitonic network is
    unrolled over CAP values at compile time, which made this kernel the start-up's longest compile
    (docs/PERFORMANCE.md, "The sort kernel by rank"); the ranks are one loop of comparisons over
    the n values a row has (a few more than k: see the module docstring), and place each of them
    once (the keys order every float, NaN and -0.0 included). Reads `out` after a barrier, so `v`
    may come from there."""
    idx = tl.arange(0, CAP)
    key = _order_key(v)
    tl.debug_barrier()   # the overflow branch's reads of `out` end before it is written
    tl.store(out + idx, v)
    tl.debug_barrier()
    place = tl.zeros([CAP], dtype=tl.int32)
    for start in range(0, n, CHUNK):
        j = start + tl.arange(0, CHUNK)
        other = _order_key(tl.load(out + j, mask=j < n, other=0.0))
        before = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None]) & (j[None, :] < idx[:, None]))
        place += tl.sum((before & (j[None, :] < n)).to(tl.int32), axis=1)
    tl.debug_barrier()   # every rank is counted before the values move
    tl.store(out + place, v, mask=idx < n)


@triton.jit(do_not_specialize=["k1"])
def _sort_kernel(list_ptr, stride_list, counter_ptr, x_ptr, stride_x, values_ptr, stride_values, lengths_ptr, V, k1,
                 scale_ptr, offset_ptr, top_k_ptr, top_p_ptr, threshold_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                 THRESHOLDS: tl.constexpr, RANK_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, CAP)
    count = tl.load(counter_ptr + row)
    out = values_ptr + row * stride_values
    base = x_ptr + row * stride_x
    K = count
    C = count
    if count <= CAP:   # every value >= the bound: sorted, they are the candidates (ties included)
        v = tl.load(list_ptr + row * stride_list + idx, mask=idx < count, other=float("-inf"))
    else:   # overflow: the exact k+1 largest, from the row itself
        K = k1 - 1
        C = k1
        lo = tl.full([], 2147483647, tl.int64)
        hi = tl.full([], -2147483648, tl.int64)
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            keys = _order_key(tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32))
            keys = tl.where(offs < V, keys, 2147483647)
            lo = tl.minimum(lo, tl.min(keys, axis=0).to(tl.int64))
            keys = tl.where(offs < V, keys, -2147483648)
            hi = tl.maximum(hi, tl.max(keys, axis=0).to(tl.int64))
        for _ in range(32):   # the largest t with count(row >= t) >= k + 1: the (k+1)-th largest key
            mid = lo + (hi - lo + 1) // 2
            n = 0
            for off in range(0, V, BLOCK):
                offs = off + tl.arange(0, BLOCK)
                keys = _order_key(tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32))
                n += tl.sum(((offs < V) & (keys.to(tl.int64) >= mid)).to(tl.int32), axis=0)
            enough = n >= k1
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        t = lo.to(tl.int32)
        # The values above t (fewer than k + 1), then copies of t up to k + 1.
        tl.store(out + idx, tl.where(idx < k1, _key_value(t), float("-inf")))
        tl.debug_barrier()
        n = 0
        for off in range(0, V, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            above = (offs < V) & (_order_key(x) > t)
            pos = n + tl.cumsum(above.to(tl.int32), axis=0) - 1
            tl.store(out + pos, x, mask=above)
            n += tl.sum(above.to(tl.int32), axis=0)
        tl.debug_barrier()
        v = tl.load(out + idx)
    _sort_descending(v, out, C, CAP, RANK_CHUNK)
    tl.store(lengths_ptr + row * 2, K)
    tl.store(lengths_ptr + row * 2 + 1, C)
    if THRESHOLDS:   # the row's min-p / top-k / top-p threshold from the sorted list, in the same launch
        tl.debug_barrier()
        threshold = row_threshold(out, K, C, base, V, tl.load(scale_ptr + row), tl.load(offset_ptr + row),
                                  tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), CAP, BLOCK)
        tl.store(threshold_ptr + row, threshold)


_launch_pass = FastLaunch(_pass_kernel)   # launched every step: no JITFunction.run per call
_launch_bound = FastLaunch(_bound_kernel)
_launch_compact = FastLaunch(_compact_kernel)
_launch_sort = FastLaunch(_sort_kernel)


def sub_block(vocab: int, columns: int) -> int:
    """SUB: the power of two (at most MAX_SUB_BLOCK) whose sub-blocks of a row number >= columns
    (whole ones: the bound needs `columns` real maxima)."""
    return max(1, min(MAX_SUB_BLOCK, BLOCK, triton.next_power_of_2(vocab // columns + 1) // 2))


def list_capacity(columns: int) -> int:
    """CAP: room in a row's list for 4x the candidates (128 at least): a row overflows only when
    ties or a few blocks hold most of its large values."""
    return max(128, triton.next_power_of_2(4 * columns))


def _carve(rows: int, parts: dict, device: torch.device) -> tuple[dict, dict]:
    """Contiguous tensors `name: (dtype, columns)` ([rows, columns], or [rows] for 0 columns) cut
    from one float32 and one int32 allocation, each starting 16-byte aligned."""
    carved: tuple[dict, dict] = ({}, {})
    for which, dtype in enumerate((torch.float32, torch.int32)):
        sizes = {name: rows * max(columns, 1) for name, (kind, columns) in parts.items() if kind == dtype}
        flat = torch.empty(sum(-(-size // 4) * 4 for size in sizes.values()), dtype=dtype, device=device)
        start = 0
        for name, size in sizes.items():
            columns = parts[name][1]
            piece = flat[start:start + size]
            carved[which][name] = piece.view(rows, columns) if columns else piece
            start += -(-size // 4) * 4
    return carved


def _candidates(rows: int, num: int, cap: int, with_threshold: bool, device: torch.device,
                workspace: dict | None) -> Candidates:
    """The step's buffers: the last step's, kept in `workspace` (the caller's dict), where the
    shapes are the same (decode steps of one batch), else new ones."""
    key = (rows, num, cap, with_threshold, device)
    if workspace is None:
        workspace = {}
    if workspace.get("key") != key:
        floats, ints = _carve(rows, {"maxima": (torch.float32, num), "listed": (torch.float32, cap),
                                     "values": (torch.float32, cap), "bound": (torch.float32, 0),
                                     "lengths": (torch.int32, 2), "ids": (torch.int32, cap),
                                     "count": (torch.int32, 0), "threshold": (torch.float32, 1)}, device)
        found = Candidates(floats["values"], ints["lengths"], floats["listed"], ints["ids"], ints["count"],
                           floats["bound"], floats["threshold"] if with_threshold else None, floats["maxima"])
        workspace.update(key=key, found=found)
    return workspace["found"]


def logits_pass(logits: torch.Tensor, out: torch.Tensor | None, penalties: PenaltyColumns | None,
                columns: int, mask: tuple[torch.Tensor, torch.Tensor] | None = None,
                settings: tuple[torch.Tensor, ...] | None = None, workspace: dict | None = None) -> Candidates | None:
    """The passes over `logits` [N, V] (any float dtype, contiguous rows): with `mask` (a
    structured-output bitmask, int32 [N, >= V / 32] in xgrammar's packing, and int32 [N], nonzero
    for the rows it constrains), the disallowed tokens of those rows to -inf first; with
    `penalties`, their penalties; with `out` (float32 [N, V], contiguous rows; may be `logits` itself), the resulting
    float32 logits written there; with `columns` = k + 1 > 1 (at most MAX_CANDIDATES and V), the
    rows' candidates for top-k thresholds of k or less (else None), and with `settings` (per
    row, contiguous: scale, min_p_offset, top_k, top_p, as threshold_kernel.thresholds takes them)
    their thresholds too (`Candidates.threshold`). `workspace`: a dict the caller keeps across
    steps, in which the buffers of a step are kept for the next step of the same shapes (no
    allocation per step; only the step's kernels, in stream order, touch them)."""
    rows, vocab = logits.shape
    assert columns <= MAX_CANDIDATES and columns <= vocab, (columns, vocab)
    assert out is not None or columns, "the pass would do nothing"
    device, index = logits.device, logits.device.index or 0
    blocks = triton.cdiv(vocab, BLOCK)
    sub = sub_block(vocab, columns) if columns else BLOCK
    num, cap = blocks * (BLOCK // sub), list_capacity(columns)
    maxima = found = None
    if columns:
        found = _candidates(rows, num, cap, settings is not None, device, workspace)
        maxima = found.maxima
    p = penalties
    dummy = maxima if maxima is not None else out   # a pointer for the arguments the constexprs switch off
    bitmask, constrained = mask if mask is not None else (dummy, dummy)
    if rows and (out is not None and (p is not None or mask is not None or out is not logits) or columns):
        _launch_pass((rows, blocks), logits, logits.stride(0), dummy if out is None else out,
                     0 if out is None else out.stride(0), dummy, 0 if maxima is None else maxima.stride(0),
                     dummy if p is None else p.slots, dummy if p is None else p.output_counts,
                     0 if p is None else p.output_counts.stride(0),
                     dummy if p is None else p.seen, 0 if p is None else p.seen.stride(0),
                     dummy if p is None else p.repetition, dummy if p is None else p.frequency,
                     dummy if p is None else p.presence, bitmask, 0 if mask is None else bitmask.stride(0),
                     constrained, vocab, BLOCK, sub, p is not None, out is not None, maxima is not None,
                     mask is not None, device_index=index, num_warps=8, num_stages=1)
    if not columns or rows == 0:
        return found
    x, bound, counter, listed = logits if out is None else out, found.bound, found.count, found.listed
    _launch_bound((rows,), maxima, maxima.stride(0), num, bound, counter, columns, triton.next_power_of_2(num),
                  device_index=index, num_warps=8, num_stages=1)
    _launch_compact((rows, blocks), x, x.stride(0), maxima, maxima.stride(0), bound, counter, listed,
                    found.listed_ids, listed.stride(0), vocab, cap, BLOCK, sub, device_index=index, num_warps=8,
                    num_stages=1)
    scale, offset, top_k, top_p = settings if settings is not None else (bound,) * 4
    _launch_sort((rows,), listed, listed.stride(0), counter, x, x.stride(0), found.values, found.values.stride(0),
                 found.lengths, vocab, columns, scale, offset, top_k, top_p,
                 bound if found.threshold is None else found.threshold, cap, BLOCK, settings is not None, RANK_CHUNK,
                 device_index=index, num_warps=8, num_stages=1)
    return found
