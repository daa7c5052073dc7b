"""The all-reduce of a tensor-parallel decode step in one kernel: each rank pushes its partial sums
into every peer's buffer over NVLink (the buffers are mapped into each other's processes through
CUDA IPC: runner/distributed/comm.push_all_reduce) and adds what the peers pushed into its own.
`PushAllReduce.all_reduce_`; `tensor_parallel_all_reduce` takes it for the tensors it accepts, when
ParallelConfig.push_all_reduce_max_bytes is above 0 (the default, 131072 bytes: docs/PARALLEL.md).

Why not NCCL for these: a decode step of a tensor-parallel Llama-3-8B all-reduces one 8 KiB row
twice per layer, 64 times a step at batch 1. In the replayed step NCCL's kernel takes ~6.5 us, plus
a launch gap on each side since it is launched without programmatic dependent launch (PDL): ~17%
of the TP=2 step (`graphrunner bench profile_step --shape llama-3-8b --tensor-parallel-size 2`;
docs/PERFORMANCE.md, "Tensor parallelism"). Here the data crosses NVLink once, as stores (no round
trip of loads), with no separate flag and no fence, and the kernel takes part in PDL like the
decode kernels around it.

Protocol (NCCL's "LL" idea): the tensor is read as 32-bit lanes; a rank sends each lane as one
64-bit word (tag << 32) | lane, stored strong and single-copy atomic, so a reader that finds its
tag in a word has that word's data. Per program j of a grid that is the same for every call:
- tag = this program's call count (a counter in device memory, so graph replays count too; every
  rank makes the same calls in the same order, so the tags agree across ranks), sent as 32 bits
  that are never 0 (the buffers start zeroed). The count is read and advanced by one atomic whose
  result all the program's threads share: read by every thread and stored by one, a warp that read
  after the store counted the call one ahead, so its lanes pushed and waited with the next call's
  tag in the next call's slot and both ranks stalled (the rare start-up stall of
  docs/PARALLEL.md, "Push all-reduce");
- words go to slot [tag % 2][this rank] of every peer's buffer;
- the program then polls its lanes of slot [tag % 2][peer] in its own buffer until every word
  carries the tag, and sums the ranks' values in rank order (its own from x): the same fp32 sum,
  bit for bit, on every rank.
Two slots suffice: a rank writes a peer's slot (parity p) again two calls later, which it reaches
only after that peer pushed the call in between, i.e. after the peer's reads of that slot ended.
A word left from two calls before carries another tag, so stale data is never taken for new.
A peer that never arrives (crashed mid-step) makes the kernel trap after the TP group's timeout
(`peer_timeout_s`: ParallelConfig.distributed_init_timeout_s, the time NCCL's collectives of the
same group are given), which surfaces as a CUDA error on this rank instead of a hang. With
`timeout_record` on (ParallelConfig.push_all_reduce_timeout_record), the program first writes what
it waited for into a record in pinned host memory, which outlives the CUDA context the trap
destroys (`PushAllReduce.timeouts`: the call, the peer, and the calls the peer's two slots held),
so the error can say whether the peer never came or came with another call count. Off by default:
any code on the timeout path changes how ptxas schedules the whole GEMV, and that schedule made the
TP=2 Llama-3-8B step 7 us slower (docs/PARALLEL.md, "Push all-reduce").

The same protocol also runs inside a GEMV: a one-row o_proj / down_proj sums its own output in its
epilogue (models/small_batch_kernels.linear_all_reduce, `push_lanes` and `summed_lanes` here), so
the step launches no all-reduce kernel at all. Its words go to a second region of the buffers, with
a call count of its own (`PushAllReduce.projection_reduce`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from launch.compile_ahead import launch
from launch.pdl import pdl_options, wait_for_producers

PROGRAMS = 32
"""Programs of every call (fixed, whatever the size: a program's lanes and counter must mean the
same in every call). In `graphrunner bench all_reduce`'s graph on two H100s, 16, 32 and 64 programs
cost the same at 1-8 rows of 4096 bf16 (~3.6 us, NCCL ~7 us); 32 was the best of the three over
16 and 32 rows (5.1 / 7.8 us; 16 programs 5.9 / 9.4, 64 programs 6.8 / 7.1)."""
BLOCK = 1024
"""Lanes a program moves per iteration (4 warps, 8 a thread)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MARK_BYTES = 8
"""The end of each buffer: a random number its rank writes at set-up, which every peer reads back
through its mapping before the first push."""
PEER_TIMEOUT_S = 600
"""How long a program waits for a peer's words before it traps, where no timeout is given
(torch's default for a process group); an engine passes its TP group's."""
TIMEOUT_RECORDS = 8
"""Rows of the timeout record: a program that times out writes row (its column tile or program
id) % TIMEOUT_RECORDS."""
TIMEOUT_FIELDS = 8
"""A row: written (1), site (0: the all-reduce kernel, 1: a GEMV's epilogue), rank, peer, the
call it waited for, the lowest and highest call found in the peer's slot of that call's parity,
the highest call found in the other parity's slot. A call's tag is its count."""
_RECORD_ROWS = tl.constexpr(TIMEOUT_RECORDS)
_RECORD_FIELDS = tl.constexpr(TIMEOUT_FIELDS)


@triton.jit
def _store_words(ptrs, words, mask, STRONG: tl.constexpr):
    """64-bit stores a peer polls: strong at system scope and single-copy atomic on a GPU (plain
    stores in Triton's interpreter)."""
    if STRONG:
        tl.inline_asm_elementwise(
            """{
            .reg .pred %p;
            setp.ne.s32 %p, $3, 0;
            @%p st.relaxed.sys.global.b64 [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,l,r", args=[ptrs, words, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, words, mask=mask)


@triton.jit
def _load_words(ptrs, mask, STRONG: tl.constexpr):
    if STRONG:
        words = tl.inline_asm_elementwise(
            """{
            .reg .pred %p;
            setp.ne.s32 %p, $2, 0;
            mov.u64 $0, 0;
            @%p ld.relaxed.sys.global.b64 $0, [$1];
            }""",
            "=l,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int64, is_pure=False, pack=1)
    else:
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    return words


@triton.jit
def _untagged(words, tag32, mask):
    """How many of the masked words do not (yet) carry the tag in their upper half."""
    return tl.sum(((((words >> 32) & 0xFFFFFFFF) != tag32) & mask).to(tl.int32), axis=0)


@triton.jit
def _nanoseconds():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence_system():
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def record_timeout(buffer_ptrs, program, tag32, source, words, other_words, mask,
                   SITE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, STRONG: tl.constexpr):
    """Write this program's timeout row (TIMEOUT_FIELDS) into the record at buffer_ptrs[WORLD]
    (pinned host memory); STRONG: fenced at system scope, so it reaches the host before the trap.
    `words` / `other_words`: the peer's words last polled from the call's slot / the other slot."""
    record = tl.load(buffer_ptrs + WORLD).to(tl.pointer_type(tl.int64))
    row = record + (program % _RECORD_ROWS) * _RECORD_FIELDS
    found = (words >> 32) & 0xFFFFFFFF
    waiting = (found != tag32) & mask
    tl.store(row + 1, SITE)
    tl.store(row + 2, RANK)
    tl.store(row + 3, source)
    tl.store(row + 4, tag32.to(tl.int64))
    tl.store(row + 5, tl.min(tl.where(waiting, found, 0xFFFFFFFF), axis=0))
    tl.store(row + 6, tl.max(tl.where(waiting, found, 0), axis=0))
    tl.store(row + 7, tl.max(tl.where(mask, (other_words >> 32) & 0xFFFFFFFF, 0), axis=0))
    if STRONG:
        _fence_system()
    tl.store(row, 1)
    if STRONG:
        _fence_system()


@triton.jit
def _lane_values(bits, ELEM_BITS: tl.constexpr, DTYPE: tl.constexpr):
    """A 32-bit lane's values in fp32: (value, 0) for fp32, (low half, high half) for 16-bit types."""
    if ELEM_BITS == 32:
        lo = bits.to(tl.float32, bitcast=True)
        hi = tl.zeros_like(lo)
    else:
        lo = (bits & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
        hi = ((bits >> 16) & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def lane_bits(lo, hi, ELEM_BITS: tl.constexpr, DTYPE: tl.constexpr):
    """The inverse of _lane_values, rounding each fp32 value to DTYPE."""
    if ELEM_BITS == 32:
        bits = lo.to(tl.int32, bitcast=True)
    else:
        lo16 = lo.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = (hi16 << 16) | lo16
    return bits


@triton.jit
def tag_of_call(call):
    """(tag32, parity) of a call counted from 1: the tag as 32 bits that are never 0 (the buffers
    start zeroed, so a zeroed word never matches), and the slot it uses."""
    return (call - 1) % 0xFFFFFFFF + 1, call % 2


@triton.jit
def push_lanes(bits, offs, mask, buffer_ptrs, tag32, parity, slot_words,
               RANK: tl.constexpr, WORLD: tl.constexpr, STRONG: tl.constexpr):
    """Store this rank's lanes `bits` (int32, at lane offsets `offs`) as tagged words into slot
    [parity][RANK] of every peer's buffer."""
    words = (tag32.to(tl.int64) << 32) | (bits.to(tl.int64) & 0xFFFFFFFF)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_words = tl.load(buffer_ptrs + peer).to(tl.pointer_type(tl.int64))
            _store_words(peer_words + ((parity * WORLD + RANK) * slot_words) + offs, words, mask, STRONG)


@triton.jit
def summed_lanes(bits, offs, mask, buffer_ptrs, tag32, parity, slot_words, program,
                 RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BITS: tl.constexpr, DTYPE: tl.constexpr,
                 STRONG: tl.constexpr, TIMEOUT_NS: tl.constexpr, SITE: tl.constexpr, RECORD: tl.constexpr):
    """The lanes at `offs` summed over the ranks: this rank's `bits` and, polled from slot
    [parity][peer] of its own buffer until every word carries the tag, each peer's, added in fp32
    in rank order (the same sum, bit for bit, on every rank) and rounded to DTYPE. After TIMEOUT_NS
    without them: with RECORD, the timeout record's row of `program` (`record_timeout`, SITE); then a
    trap."""
    own_words = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(tl.int64))
    acc_lo = tl.zeros(bits.shape, dtype=tl.float32)
    acc_hi = tl.zeros(bits.shape, dtype=tl.float32)
    for source in tl.static_range(WORLD):   # rank order
        if source == RANK:
            source_bits = bits
        else:
            src = own_words + ((parity * WORLD + source) * slot_words) + offs
            words = _load_words(src, mask, STRONG)
            if STRONG:
                began = _nanoseconds()
            while _untagged(words, tag32, mask) > 0:
                words = _load_words(src, mask, STRONG)
                if STRONG:
                    if _nanoseconds() - began > TIMEOUT_NS:
                        if RECORD:
                            other = own_words + (((1 - parity) * WORLD + source) * slot_words) + offs
                            record_timeout(buffer_ptrs, program, tag32, source, words,
                                           _load_words(other, mask, STRONG), mask, SITE, RANK, WORLD, STRONG)
                        _trap()
            source_bits = (words & 0xFFFFFFFF).to(tl.int32)
        lo, hi = _lane_values(source_bits, ELEM_BITS, DTYPE)
        acc_lo += lo
        acc_hi += hi
    return lane_bits(acc_lo, acc_hi, ELEM_BITS, DTYPE)


@triton.jit
def _push_all_reduce_kernel(x_ptr, lanes, buffer_ptrs, counter_ptr, slot_words,
                            RANK: tl.constexpr, WORLD: tl.constexpr, ELEM_BITS: tl.constexpr,
                            BLOCK: tl.constexpr, STRONG: tl.constexpr, TIMEOUT_NS: tl.constexpr,
                            RECORD: tl.constexpr, PDL: tl.constexpr):
    """x (`lanes` 32-bit lanes) summed over the ranks, in place. buffer_ptrs[r]: rank r's buffer,
    int64 words [2 slots][WORLD][slot_words], and buffer_ptrs[WORLD] the timeout record;
    counter_ptr: this rank's call count per program.
    Every lane of the program is pushed before any is polled, so the peers' latencies overlap."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    x_lanes = x_ptr.to(tl.pointer_type(tl.int32))
    wait_for_producers(PDL)          # x is the projection's output: nothing is read before this
    call = tl.atomic_add(counter_ptr + pid, 1, sem="relaxed") + 1   # one read for all threads (module docstring)
    tag32, parity = tag_of_call(call)
    for start in range(pid * BLOCK, lanes, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < lanes
        bits = tl.load(x_lanes + offs, mask=mask, other=0)
        push_lanes(bits, offs, mask, buffer_ptrs, tag32, parity, slot_words, RANK, WORLD, STRONG)
    for start in range(pid * BLOCK, lanes, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < lanes
        bits = tl.load(x_lanes + offs, mask=mask, other=0)
        summed = summed_lanes(bits, offs, mask, buffer_ptrs, tag32, parity, slot_words, pid, RANK, WORLD,
                               ELEM_BITS, dtype, STRONG, TIMEOUT_NS, 0, RECORD)
        tl.store(x_lanes + offs, summed, mask=mask)


class ProjectionReduce(NamedTuple):
    """What a one-row GEMV needs to all-reduce its own output in its epilogue
    (models/small_batch_kernels.linear_all_reduce): the ranks' buffers of the fused region, its grid's
    call counter, and the protocol's constants."""
    buffer_ptrs: torch.Tensor
    tickets: torch.Tensor
    slot_words: int
    rank: int
    world: int
    strong: bool
    timeout_ns: int
    record: bool


TICKET_GRIDS = 4
"""Grid sizes whose GEMVs may all-reduce in their epilogue (one call counter each). A decoder has one:
o_proj and down_proj both write the hidden size."""


class PushAllReduce:
    """One rank's side of the group: every rank's buffer mapped into this process (its own among
    them), and its programs' call counters. `max_bytes`: the largest tensor it takes (a slot holds
    twice that: one 64-bit word per 32-bit lane). A buffer has two regions of two slots: one for
    this module's kernel, one for the GEMVs that all-reduce their own output (`projection_reduce`),
    since each counts its calls, and so tags its words, on its own. `in_gemv` False: no GEMV does
    (ParallelConfig.push_all_reduce_in_gemv). `peer_timeout_s`: how long a program waits for a
    peer's words before it traps (a compile-time constant of the kernels; None: PEER_TIMEOUT_S).
    `timeout_record`: whether a program that times out first writes its row into `self.timeout_record`
    (read by `timeouts`; a compile-time constant of the kernels)."""

    def __init__(self, buffers: list[torch.Tensor], rank: int, max_bytes: int, in_gemv: bool = True,
                 peer_timeout_s: float | None = None, timeout_record: bool = False) -> None:
        need = self.buffer_bytes(max_bytes, len(buffers))
        for b in buffers:
            if b.numel() * b.element_size() < need:
                raise ValueError(f"a buffer of {b.numel() * b.element_size()} bytes is too small for "
                                 f"{len(buffers)} ranks of {max_bytes} bytes")
        self.buffers = buffers   # keeps the peers' mappings open
        self.buffer = buffers[rank]
        self.world = len(buffers)
        self.rank = rank
        self.max_bytes = max_bytes
        self.in_gemv = in_gemv
        self.timeout_ns = int((PEER_TIMEOUT_S if peer_timeout_s is None else peer_timeout_s) * 10**9)
        self.record = timeout_record
        device = self.buffer.device
        self.timeout_record = torch.zeros(TIMEOUT_RECORDS, TIMEOUT_FIELDS, dtype=torch.int64,
                                          pin_memory=device.type == "cuda")
        """Pinned host memory, which a kernel reaches at its host address (unified addressing) and
        which the host can still read after a trap has destroyed the CUDA context (`timeouts`)."""
        record = self.timeout_record.data_ptr()
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers] + [record], dtype=torch.int64, device=device)
        self.counters = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        region = self.region_bytes(max_bytes, self.world)
        self.projection_buffer_ptrs = torch.tensor([b.data_ptr() + region for b in buffers] + [record],
                                                   dtype=torch.int64, device=device)
        self.tickets = torch.zeros(TICKET_GRIDS, dtype=torch.int64, device=device)
        self._projection_reduces: dict[int, ProjectionReduce] = {}
        """Per grid size, in first-call order (the same on every rank): its call counter and the rest."""

    @staticmethod
    def region_bytes(max_bytes: int, world: int) -> int:
        """Bytes of one region: 2 slots x `world` ranks x a word per 4 bytes of tensor."""
        return 2 * world * 2 * max_bytes

    @staticmethod
    def buffer_bytes(max_bytes: int, world: int) -> int:
        """Bytes of each rank's buffer: its 2 regions, then MARK_BYTES for the set-up's check that a
        peer's mapping is the peer's buffer (runner/distributed/comm._exchange_buffers)."""
        return 2 * PushAllReduce.region_bytes(max_bytes, world) + MARK_BYTES

    def usable(self, x: torch.Tensor) -> bool:
        """Whether `x` takes this kernel: contiguous, a float dtype it is built for, whole 32-bit
        lanes at a 4-byte offset, at most `max_bytes`. Decided from the tensor's shape, dtype and
        layout alone, so every rank decides the same for the same call."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in DTYPES and x.is_contiguous() and x.device == self.buffer.device
                and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0
                and x.storage_offset() * x.element_size() % 4 == 0)

    def projection_reduce(self, out_bytes: int, dtype: torch.dtype, device: torch.device,
                          grid: int) -> ProjectionReduce | None:
        """The fused region for a GEMV of `grid` programs whose fresh contiguous output of `out_bytes`
        bytes it all-reduces itself, or None (a dtype or size this protocol does not take, or more
        grid sizes than TICKET_GRIDS, or `in_gemv` off): the caller then all-reduces the output
        afterwards. Decided from sizes alone, in the same order on every rank, so the ranks agree on
        the counters too."""
        if (not self.in_gemv or dtype not in DTYPES or device != self.buffer.device
                or not 0 < out_bytes <= self.max_bytes or out_bytes % 4):
            return None
        reduce = self._projection_reduces.get(grid)
        if reduce is None and len(self._projection_reduces) < TICKET_GRIDS:
            index = len(self._projection_reduces)
            reduce = self._projection_reduces[grid] = ProjectionReduce(
                self.projection_buffer_ptrs, self.tickets[index:index + 1], self.max_bytes // 4, self.rank, self.world,
                device.type == "cuda", self.timeout_ns, self.record)
        return reduce

    def timeouts(self) -> list[str]:
        """What each program that timed out waiting for a peer wrote before it trapped (one line per
        record row; empty: none did). Reads host memory only, so it works after the trap. The
        peer's slot of the call's parity holding the call two before (and the other slot the call
        before) means the peer never made the call; other counts mean the ranks' calls diverged."""
        lines = []
        for written, site, rank, peer, call, lowest, highest, other in self.timeout_record.tolist():
            if not written:
                continue
            where = "the push all-reduce kernel" if site == 0 else "a GEMV that all-reduces its output"
            lines.append(f"push all-reduce timeout: rank {rank} waited {self.timeout_ns / 1e9:.0f} s in {where} for "
                         f"rank {peer}'s words of call {call}; that slot held calls {lowest}..{highest}, the other "
                         f"slot call {other}")
        return lines

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (a program reads its lanes of x before it writes them)."""
        strong = x.device.type == "cuda"
        launch(_push_all_reduce_kernel, (PROGRAMS,), x, x.numel() * x.element_size() // 4, self.buffer_ptrs,
               self.counters, self.max_bytes // 4, RANK=self.rank, WORLD=self.world,
               ELEM_BITS=8 * x.element_size(), BLOCK=BLOCK, STRONG=strong, TIMEOUT_NS=self.timeout_ns,
               RECORD=self.record, num_warps=4, **pdl_options(x.device))
        return x
