"""The push all-reduce of tensor parallelism on GPUs (models/push_all_reduce.py), its logic on a CPU.

In Triton's interpreter, as rank 0 of two, with the peer's side played by the test: the words the
kernel pushes into the peer's buffer (tag, slot, lanes), the sum it makes of what the peer pushed
(rank order, rounding), the slot parity from call to call, and every dtype's lanes. Also which
tensors take the kernel (the same decision on every rank, from the tensor alone), that the rest
stay on NCCL, and the start-up agreement that leaves every rank on NCCL when one cannot set it up.
The cross-GPU run against NCCL is the `multigpu` test at the end (two GPUs, spawned ranks)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from models import parallel_state  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from models.push_all_reduce import (DTYPES, TIMEOUT_FIELDS, TIMEOUT_RECORDS, PushAllReduce,  # noqa: E402
                                    record_timeout)
from runner.distributed import comm  # noqa: E402
from runner.distributed.topology import Topology  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BYTES = 4096


def _pair():
    """Rank 0's PushAllReduce over CPU buffers, and the peer's (rank 1's) buffer as int64 words."""
    words = PushAllReduce.buffer_bytes(MAX_BYTES, 2) // 8
    own, peer = torch.zeros(words, dtype=torch.int64), torch.zeros(words, dtype=torch.int64)
    return PushAllReduce([own.view(torch.uint8), peer.view(torch.uint8)], 0, MAX_BYTES), own, peer


def _lanes(x: torch.Tensor) -> torch.Tensor:
    """x's 32-bit lanes as int64 values in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _slot(words: torch.Tensor, parity: int, source: int, lanes: int) -> torch.Tensor:
    slot_words = MAX_BYTES // 4
    start = (parity * 2 + source) * slot_words
    return words[start:start + lanes]


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rank0_pushes_tagged_words_and_sums_the_peers_in_rank_order(dtype):
    pytest.importorskip("triton")
    reducer, own, peer = _pair()
    gen = torch.Generator().manual_seed(0)
    for call in (1, 2, 3):                  # tags 1, 2, 3: slots 1, 0, 1
        # eighths up to 8: every sum is exact in each dtype (the interpreter rounds to bf16 by
        # truncation, a GPU to nearest; the multigpu test checks the GPU's rounding against NCCL)
        mine = (torch.randint(-64, 64, (3, 40), generator=gen) / 8).to(dtype)
        theirs = (torch.randint(-64, 64, (3, 40), generator=gen) / 8).to(dtype)
        lanes = mine.numel() * mine.element_size() // 4
        _slot(own, call % 2, 1, lanes).copy_((call << 32) | _lanes(theirs).view(-1))   # the peer's push
        x = mine.clone()
        assert reducer.all_reduce_(x) is x
        assert torch.equal(x, (mine.float() + theirs.float()).to(dtype))
        assert torch.equal(_slot(peer, call % 2, 0, lanes), (call << 32) | _lanes(mine).view(-1))
        assert reducer.counters.tolist() == [call] * len(reducer.counters)
    assert not own[(MAX_BYTES // 4) * 2 * 2:].any()    # nothing written past the two slots
    assert not reducer.timeout_record.any() and reducer.timeouts() == []


def _exact_product(dtype, n, k, gen):
    """x [1, k] in eighths below 1 and a weight [n, k] of -1 / 0 / 1: with k = 16 every product
    and every sum below is exact in each dtype (the interpreter rounds bf16 by truncation)."""
    x = (torch.randint(-8, 8, (1, k), generator=gen) / 8).to(dtype)
    return x, torch.randint(-1, 2, (n, k), generator=gen).to(dtype)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rank0_projection_all_reduces_its_own_output_in_its_epilogue(dtype):
    """`linear_all_reduce` as rank 0 of two: its GEMV pushes its rounded columns as tagged words into
    the peer's buffer (the projection region, slot by the call's parity) and adds the peer's words;
    the sum is `linear`'s product plus the peer's in fp32, rounded once, as `linear` then the
    push kernel; its tickets count its programs per call; the push kernel's region is untouched."""
    from models import small_batch_kernels as sbk
    reducer, own, peer = _pair()
    region, slot_words, n = PushAllReduce.region_bytes(MAX_BYTES, 2) // 8, MAX_BYTES // 4, 96
    gen = torch.Generator().manual_seed(1)
    for call in (1, 2, 3):
        x, w = _exact_product(dtype, n, 16, gen)
        theirs = (torch.randint(-64, 64, (1, n), generator=gen) / 8).to(dtype)
        lanes = theirs.numel() * theirs.element_size() // 4
        start = region + (call % 2 * 2 + 1) * slot_words        # slot [parity][rank 1] of rank 0's region
        own[start:start + lanes] = (call << 32) | _lanes(theirs).view(-1)
        mine = sbk.linear(x, w)
        summed = sbk.linear_all_reduce(x, w, reducer)
        assert torch.equal(summed, (mine.float() + theirs.float()).to(dtype))
        start = region + (call % 2 * 2) * slot_words               # slot [parity][rank 0] of rank 1's region
        assert torch.equal(peer[start:start + lanes], (call << 32) | _lanes(mine).view(-1))
        grid = reducer.tickets[0].item() // call
        assert grid * call == reducer.tickets[0].item() and grid > 1 and not reducer.tickets[1:].any()
    assert not peer[:region].any() and not reducer.counters.any()


def test_a_projection_all_reduces_itself_only_where_rows_tiles_and_size_allow(monkeypatch):
    """Each declined product (None: the caller all-reduces after `linear`) is decided from shapes
    alone, the same on every rank; each grid size keeps one call counter, TICKET_GRIDS at most."""
    from models import small_batch_kernels as sbk
    from models.push_all_reduce import TICKET_GRIDS
    reducer, _, _ = _pair()
    launched = []
    monkeypatch.setattr(sbk, "_launch", lambda *args, reduce, **kwargs: launched.append(reduce) or (args[0], None))
    fits = lambda rows, n, dtype=torch.float32: sbk.linear_all_reduce(
        torch.zeros(rows, 16, dtype=dtype), torch.zeros(n, 16, dtype=dtype), reducer) is not None
    assert fits(1, 64) and fits(1, MAX_BYTES // 2, torch.bfloat16)
    assert not fits(2, 64)                                  # one row only
    assert not fits(1, 60)                                  # columns not whole tiles (8 a program here)
    assert not fits(1, MAX_BYTES, torch.bfloat16)           # larger than max_bytes
    assert not fits(1, 64, torch.int32)                     # not a float type
    assert len(launched) == 2 and launched[0].slot_words == MAX_BYTES // 4
    tickets = {}
    for n in (64, 128, 256, 512, 1024):
        reduce = reducer.projection_reduce(4 * n, torch.float32, torch.device("cpu"), n // 8)
        tickets[n] = None if reduce is None else reduce.tickets.data_ptr()
    # grids 8 (n 64) and 32 (2048 bf16 columns, 64 a program; n 256) were counted above; 16 and 64
    # take the last two counters; 128 finds none
    assert tickets[64] == launched[0].tickets.data_ptr() and tickets[256] == launched[1].tickets.data_ptr()
    assert len(set(tickets.values()) - {None}) == TICKET_GRIDS and tickets[1024] is None


def test_row_parallel_layers_all_reduce_in_the_gemv_where_it_can_and_after_it_otherwise(monkeypatch):
    """`linear_by`: a row-parallel layer under the push all-reduce takes `linear_all_reduce`, then its
    bias; where that declines, `linear` then the layer's all-reduce and bias; a plain layer, `linear`."""
    from models import layers
    calls = []
    reducer, _, _ = _pair()
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(0, 2, object(), reducer))
    row = layers.RowParallelLinear(8, 4, bias=True)
    row.bias.data.fill_(1.0)
    plain = layers.Linear(4, 4, bias=False)
    declines = []
    kernels = SimpleNamespace(
        linear=lambda x, w, b: calls.append(("linear", b is not None)) or torch.zeros(1, w.shape[0]),
        linear_all_reduce=lambda x, w, push: calls.append(("fused", push is reducer)) or (
            None if declines else torch.full((1, w.shape[0]), 2.0)))
    monkeypatch.setattr(parallel_state, "tensor_parallel_all_reduce", lambda x: calls.append(("after",)) or x)
    monkeypatch.setattr(layers, "tensor_parallel_all_reduce", parallel_state.tensor_parallel_all_reduce)
    assert torch.equal(layers.linear_by(kernels, torch.zeros(1, 4), row), torch.full((1, 4), 3.0))
    assert calls == [("fused", True)]
    declines.append(True)
    calls.clear()
    assert torch.equal(layers.linear_by(kernels, torch.zeros(1, 4), row), torch.ones(1, 4))
    assert calls == [("fused", True), ("linear", False), ("after",)]
    calls.clear()
    layers.linear_by(kernels, torch.zeros(1, 4), plain)
    assert calls == [("linear", False)]


def test_only_small_whole_lane_float_tensors_take_the_kernel():
    reducer, _, _ = _pair()
    assert reducer.usable(torch.zeros(1, MAX_BYTES // 2, dtype=torch.bfloat16))      # exactly max_bytes
    assert reducer.usable(torch.zeros(4, 64, dtype=torch.float32))
    assert reducer.usable(torch.zeros(2, dtype=torch.float16))
    assert not reducer.usable(torch.zeros(1, MAX_BYTES, dtype=torch.bfloat16))      # larger
    assert not reducer.usable(torch.zeros(3, dtype=torch.float16))                  # 6 bytes: half a lane
    assert not reducer.usable(torch.zeros(4, dtype=torch.int32))                    # not a float type
    assert not reducer.usable(torch.zeros(0, dtype=torch.float32))
    assert not reducer.usable(torch.zeros(64, 8).t())                               # not contiguous
    assert not reducer.usable(torch.zeros(9, dtype=torch.float16)[1:9])             # a 2-byte offset


def test_a_buffer_too_small_for_the_ranks_is_refused():
    with pytest.raises(ValueError, match="too small for 2 ranks of 4096 bytes"):
        PushAllReduce([torch.zeros(100, dtype=torch.uint8)] * 2, 0, MAX_BYTES)


def test_all_reduce_takes_the_kernel_for_usable_tensors_and_nccl_for_the_rest(monkeypatch):
    calls = []

    class Recording(PushAllReduce):
        def all_reduce_(self, x):
            calls.append(("push", tuple(x.shape)))
            return x

    reducer, _, _ = _pair()
    recording = Recording(reducer.buffers, 0, MAX_BYTES)
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(0, 2, object(), recording))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group: calls.append(("nccl", tuple(x.shape))))
    small, large = torch.zeros(2, 64), torch.zeros(16, 128)
    assert parallel_state.tensor_parallel_all_reduce(small) is small
    assert parallel_state.tensor_parallel_all_reduce(large) is large
    assert calls == [("push", (2, 64)), ("nccl", (16, 128))]


def _groups(tp_group=True):
    return SimpleNamespace(rank=0, tp_rank=0, topology=SimpleNamespace(tp_size=2),
                           tp_group=SimpleNamespace(group_name="tp-0") if tp_group else None)


def test_setup_only_for_cuda_tensor_parallelism_with_a_budget():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert comm.push_all_reduce(4096, cpu, _groups()) is None
    assert comm.push_all_reduce(4096, cuda, _groups(tp_group=False)) is None
    assert comm.push_all_reduce(0, cuda, _groups()) is None


def _setup_with(monkeypatch, allocate, exchange, agreed: bool):
    monkeypatch.setattr(comm, "_allocate_buffer", allocate)
    monkeypatch.setattr(comm, "_exchange_buffers", exchange)
    monkeypatch.setattr(comm, "all_reduce_min", lambda value, groups: value if agreed else 0)
    return comm.push_all_reduce(64, torch.device("cuda", 0), _groups())


@pytest.mark.parametrize("ready_everywhere", [True, False])
def test_setup_agrees_across_ranks_before_and_after_the_exchange(monkeypatch, ready_everywhere):
    """Each rank allocates alone; the exchange (collective) happens only if every rank could, so
    one rank without the memory leaves every rank on NCCL instead of hanging the others; and the
    result is used only if every rank could map its peers' buffers."""
    buffer = torch.zeros(PushAllReduce.buffer_bytes(64, 2), dtype=torch.uint8)
    exchanged = []
    result = _setup_with(monkeypatch, lambda nbytes, device: buffer,
                         lambda b, groups: exchanged.append(b) or [b, b.clone()], ready_everywhere)
    if ready_everywhere:
        assert result.buffer is buffer and result.max_bytes == 64 and result.world == 2 and exchanged == [buffer]
    else:
        assert result is None and exchanged == []


def test_a_rank_that_cannot_allocate_says_why_and_keeps_nccl(monkeypatch, caplog):
    def fail(nbytes, device):
        raise RuntimeError("CUDA out of memory")
    with caplog.at_level(logging.WARNING, logger="runner.distributed.comm"):
        assert _setup_with(monkeypatch, fail, None, True) is None
    assert "push all-reduce unavailable on rank 0 (CUDA out of memory)" in caplog.text


def test_the_engine_gives_its_tp_timeout_to_both_kernels(monkeypatch):
    """A peer that never pushes fails the step after the TP group's timeout, as NCCL would: the set-up
    hands `peer_timeout_s` to the all-reduce kernel and to every GEMV that all-reduces itself."""
    from models.small_batch_kernels import _reduce_constants
    buffer = torch.zeros(PushAllReduce.buffer_bytes(64, 2), dtype=torch.uint8)
    monkeypatch.setattr(comm, "_allocate_buffer", lambda nbytes, device: buffer)
    monkeypatch.setattr(comm, "_exchange_buffers", lambda b, groups: [b, b.clone()])
    monkeypatch.setattr(comm, "all_reduce_min", lambda value, groups: value)
    reducer = comm.push_all_reduce(64, torch.device("cuda", 0), _groups(), peer_timeout_s=7.5)
    assert reducer.timeout_ns == 7_500_000_000
    reduce = reducer.projection_reduce(64, torch.bfloat16, buffer.device, grid=16)
    assert reduce.timeout_ns == 7_500_000_000
    assert _reduce_constants(reduce, torch.bfloat16, 2)[-2:] == (7_500_000_000, False)
    default = comm.push_all_reduce(64, torch.device("cuda", 0), _groups())
    assert default.timeout_ns == 600 * 10**9


def test_the_timeout_record_is_off_by_default_and_reaches_both_kernels_when_on(monkeypatch):
    """ParallelConfig.push_all_reduce_timeout_record (its variable: tests/test_config_env.py): off, the
    kernels compile without the record's code; on, the all-reduce kernel and every GEMV that
    all-reduces itself get it as a constexpr."""
    from configs import EngineConfig
    from models.small_batch_kernels import _reduce_constants
    assert EngineConfig.from_kwargs(model="m").parallel.push_all_reduce_timeout_record is False
    assert EngineConfig.from_kwargs(model="m", push_all_reduce_timeout_record=True).parallel.push_all_reduce_timeout_record
    buffer = torch.zeros(PushAllReduce.buffer_bytes(64, 2), dtype=torch.uint8)
    monkeypatch.setattr(comm, "_allocate_buffer", lambda nbytes, device: buffer)
    monkeypatch.setattr(comm, "_exchange_buffers", lambda b, groups: [b, b.clone()])
    monkeypatch.setattr(comm, "all_reduce_min", lambda value, groups: value)
    for record in (False, True):
        reducer = comm.push_all_reduce(64, torch.device("cuda", 0), _groups(), timeout_record=record)
        assert reducer.record is record
        assert _reduce_constants(reducer.projection_reduce(64, torch.bfloat16, buffer.device, grid=16),
                                 torch.bfloat16, 2)[-1] is record


@triton.jit
def _timeout_probe(buffer_ptrs, words_ptr, other_ptr, program, tag32, LANES: tl.constexpr):
    """`record_timeout` of a program of a GEMV on rank 0 of 2 that polled `words_ptr`'s words from
    rank 1's slot (and `other_ptr`'s from the other slot), its last lane masked out."""
    offs = tl.arange(0, LANES)
    mask = offs < LANES - 1
    record_timeout(buffer_ptrs, program, tag32, 1, tl.load(words_ptr + offs), tl.load(other_ptr + offs), mask,
                   SITE=1, RANK=0, WORLD=2, STRONG=False)


@pytest.mark.skipif(not INTERPRET, reason="Triton on a CPU needs TRITON_INTERPRET=1")
def test_a_program_that_times_out_records_what_it_waited_for():
    """Before it traps, a program writes its row of the timeout record (pinned host memory on a GPU,
    which the host reads after the trap): the call it waited for, the peer, the lowest and highest
    call among the lanes still waiting, the other slot's call; masked lanes count for nothing. The
    host turns each written row into one line, and so does the TP group's accessor."""
    reducer, _, _ = _pair()
    calls = torch.tensor([5, 3, 4, 5, 3, 3, 5, 9])   # 5: arrived; the masked last lane's 9 is ignored
    others = torch.tensor([4, 4, 4, 4, 4, 4, 4, 7])
    _timeout_probe[(1,)](reducer.buffer_ptrs, (calls << 32) | 77, (others << 32) | 77, 11, 5, LANES=8)
    row = 11 % TIMEOUT_RECORDS
    assert reducer.timeout_record.shape == (TIMEOUT_RECORDS, TIMEOUT_FIELDS)
    assert reducer.timeout_record[row].tolist() == [1, 1, 0, 1, 5, 3, 4, 4]
    assert not reducer.timeout_record[torch.arange(TIMEOUT_RECORDS) != row].any()
    expected = ["push all-reduce timeout: rank 0 waited 600 s in a GEMV that all-reduces its output for rank 1's "
                "words of call 5; that slot held calls 3..4, the other slot call 4"]
    assert reducer.timeouts() == expected
    parallel_state.set_tensor_parallel_group(0, 2, object(), reducer)
    try:
        assert parallel_state.push_all_reduce_timeouts() == expected
    finally:
        parallel_state.reset_tensor_parallel_group()
    assert parallel_state.push_all_reduce_timeouts() == []


def test_a_peer_mapping_without_the_peers_mark_is_refused():
    """The set-up's check that a mapped buffer is the peer's: its last word is the mark the peer
    wrote and sent with its handle; anything else (another buffer's memory) is refused by name."""
    buffer = torch.zeros(PushAllReduce.buffer_bytes(64, 2), dtype=torch.uint8)
    buffer[-8:].view(torch.int64).fill_(12345)
    comm._check_mark(buffer, 12345, 1)
    with pytest.raises(RuntimeError, match="rank 1's push buffer, mapped here, ends with 12345, not the mark 999"):
        comm._check_mark(buffer, 999, 1)


def test_a_rank_that_cannot_map_its_peers_says_why_and_keeps_nccl(monkeypatch, caplog):
    def fail(buffer, groups):
        raise RuntimeError("peer access is not supported between these devices")
    buffer = torch.zeros(PushAllReduce.buffer_bytes(64, 2), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="runner.distributed.comm"):
        assert _setup_with(monkeypatch, lambda nbytes, device: buffer, fail, True) is None
    assert "push all-reduce unavailable on rank 0 (peer access is not supported" in caplog.text


_SM90_PTX = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from importlib import import_module
module, kernel, signature, constants, options = json.loads(sys.argv[1])
signature.update(dict.fromkeys(constants, "constexpr"))
compiled = triton.compile(ASTSource(getattr(import_module(module), kernel), signature, constants),
                          target=GPUTarget("cuda", 90, 32), options=options)
print(compiled.asm["ptx"])
"""

_SHARED_COUNT_KERNELS = {
    "the all-reduce kernel": ("models.push_all_reduce", "_push_all_reduce_kernel",
                              {"x_ptr": "*bf16", "lanes": "i32", "buffer_ptrs": "*i64", "counter_ptr": "*i64",
                               "slot_words": "i32"},
                              dict(RANK=0, WORLD=2, ELEM_BITS=16, BLOCK=1024, STRONG=True, TIMEOUT_NS=10**9,
                                   RECORD=False, PDL=True),
                              {"num_warps": 4, "launch_pdl": True}),
    "the GEMV that all-reduces its output": (   # a one-row o_proj of a Llama-3-8B TP=2 shard
        "models.small_batch_kernels", "_small_rows_kernel",
        {**dict.fromkeys(("x_ptr", "res_ptr", "norm_w_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr"), "*bf16"),
         **dict.fromkeys(("M", "N", "K"), "i32"), "eps": "fp32",
         **dict.fromkeys(("stride_xm", "stride_xk", "stride_rm", "stride_rk"), "i32"),
         "ar_buffer_ptrs": "*i64", "ar_tickets_ptr": "*i64", "ar_slot_words": "i32"},
        dict(HAS_NORM=False, HAS_RESIDUAL=False, HAS_BIAS=False, GATED=False, IEEE=False, ONE_TILE=False, BLOCK_M=1,
             BLOCK_N=2, BLOCK_K=1024, RMS_BLOCK=2048, PDL=True, ALL_REDUCE=True, AR_RANK=0, AR_WORLD=2,
             AR_ELEM_BITS=16, AR_LANES=1, AR_STRONG=True, AR_TIMEOUT_NS=10**9, AR_RECORD=False),
        {"num_warps": 4, "num_stages": 1, "launch_pdl": True}),
}


@pytest.mark.parametrize("kernel", sorted(_SHARED_COUNT_KERNELS))
def test_a_programs_threads_share_one_read_of_the_call_count(kernel):
    """Each kernel as an H100 / H200 runs it (PTX for sm_90, compiled here without a GPU): its call
    count (the all-reduce kernel's per program, the GEMV's ticket) is advanced by one atomic whose
    result goes to every thread through shared memory before any word is pushed. Read by every
    thread and stored by one, a warp that read after the store counted the call one ahead and
    pushed and waited with the next call's tag in the next call's slot: both ranks stalled
    (scripts/push_protocol_model.py, `split_lanes_ends`)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo))
    done = subprocess.run([sys.executable, "-c", _SM90_PTX, json.dumps(_SHARED_COUNT_KERNELS[kernel])],
                          capture_output=True, text=True, timeout=240, env=env, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    atomics = [line for line in ptx.splitlines() if "atom." in line]
    assert len(atomics) == 1 and "atom.global.gpu.relaxed.add.u64" in atomics[0], atomics
    after = ptx.split(atomics[0], 1)[1]
    assert after.index("st.shared") < after.index("bar.sync") < after.index("st.relaxed.sys.global.b64")
    assert "st.global.b64" not in ptx   # no 64-bit word is stored to global memory but the pushes


def _against_nccl(rank: int, port: int, failures) -> None:
    """Rank `rank` of two: eager calls of several sizes and dtypes equal NCCL's, so do GEMVs that
    all-reduce their own output (against `linear` then NCCL), and captured calls of both replay
    correctly (their counters advance in replays as in eager calls)."""
    import datetime
    import torch.distributed as dist
    comm.set_distributed_env()
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    groups = comm.init_groups("nccl", rank, Topology(tp_size=2, pp_size=1), 120.0, store)
    try:
        reducer = comm.push_all_reduce(1 << 20, torch.device("cuda", rank), groups)
        assert reducer is not None
        gen = torch.Generator(device="cuda").manual_seed(rank)
        shapes = [((1, 4096), torch.bfloat16), ((32, 4096), torch.bfloat16), ((7, 1000), torch.float32),
                  ((1, 4096), torch.float16), ((2,), torch.float16)]
        for _ in range(50):
            for shape, dtype in shapes:
                x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
                expected = x.clone()
                dist.all_reduce(expected, group=groups.tp_group)
                reducer.all_reduce_(x)
                if not torch.equal(x, expected):
                    failures.put(f"rank {rank}: {shape} {dtype} differs from NCCL")
                    return
        from models import small_batch_kernels as sbk
        for _ in range(20):    # the GEMVs that all-reduce their own output: linear, then NCCL
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(1, 2048, generator=gen, device="cuda").to(dtype)
                w = (torch.randn(4096, 2048, generator=gen, device="cuda") / 45).to(dtype)
                expected = sbk.linear(x, w)
                dist.all_reduce(expected, group=groups.tp_group)
                if not torch.equal(sbk.linear_all_reduce(x, w, reducer), expected):
                    failures.put(f"rank {rank}: linear_all_reduce {dtype} differs from linear + NCCL")
                    return
        graph = torch.cuda.CUDAGraph()
        x = torch.ones(1, 4096, dtype=torch.bfloat16, device="cuda")
        row = torch.ones(1, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.ones(4096, 64, dtype=torch.bfloat16, device="cuda")
        sbk.linear_all_reduce(row, w, reducer)   # compiled before the capture
        with torch.cuda.graph(graph):
            reducer.all_reduce_(x)
            projected = sbk.linear_all_reduce(row, w, reducer)
        for _ in range(5):
            x.fill_(rank + 1)
            row.fill_((rank + 1) / 64)
            graph.replay()
            torch.cuda.synchronize()
            if not (torch.all(x == 3) and torch.all(projected == 3)):
                failures.put(f"rank {rank}: replay sums {x[0, 0].item()}, {projected[0, 0].item()}")
                return
    finally:
        comm.destroy_groups(groups)


def _on_two_gpus(rank_fn) -> None:
    """`rank_fn(rank, port, failures)` in two spawned processes, one per GPU; a failure either puts
    into the queue is the test's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failures = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_fn, args=(port, failures), nprocs=2, start_method="spawn", join=True)
    assert failures.empty(), failures.get()


@pytest.mark.multigpu
def test_multigpu_push_all_reduce_equals_nccl():
    _on_two_gpus(_against_nccl)


def rank0_with_a_silent_peer(rank: int, port: int, **push_options):
    """Rank `rank` of two sets up its push all-reduce (NCCL groups, `push_options` for
    `comm.push_all_reduce`). Rank 1 hosts the store, then waits without pushing until rank 0 sets
    "rank 0 done", and exits; rank 0 gets (store, reducer) and must set that key and leave with
    os._exit when done. Neither tears its groups down: a push kernel that traps loses rank 0's CUDA
    context."""
    import datetime
    import torch.distributed as dist
    comm.set_distributed_env()
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 1, timeout=datetime.timedelta(seconds=120))
    groups = comm.init_groups("nccl", rank, Topology(tp_size=2, pp_size=1), 120.0, store)
    reducer = comm.push_all_reduce(1 << 16, torch.device("cuda", rank), groups, **push_options)
    if rank == 1:
        store.wait(["rank 0 done"], datetime.timedelta(seconds=120))   # pushes nothing meanwhile
        os._exit(0)
    return store, reducer


def _peer_never_pushes(rank: int, port: int, failures) -> None:
    """Rank 0 all-reduces while rank 1 never does: the kernel must end in a CUDA error after the
    3 s peer timeout, not wait for ever, and its timeout record, read after the trap, must say what
    it waited for. (The GEMVs that all-reduce themselves poll through the same
    `summed_lanes` with the same timeout: test_the_engine_gives_its_tp_timeout_to_both_kernels.)"""
    import time
    store, reducer = rank0_with_a_silent_peer(rank, port, peer_timeout_s=3.0, timeout_record=True)
    x = torch.ones(1, 4096, dtype=torch.bfloat16, device="cuda")
    started = time.monotonic()
    try:
        reducer.all_reduce_(x)
        torch.cuda.synchronize()
        failures.put("the all-reduce returned without the peer's words")
    except RuntimeError as error:   # the trap
        waited = time.monotonic() - started
        if "CUDA" not in str(error) or not 3.0 <= waited < 60.0:
            failures.put(f"after {waited:.1f} s: {error}")
        # rank 1 never pushed: both of its slots still hold the zeroed words ("call 0")
        record = ("rank 0 waited 3 s in the push all-reduce kernel for rank 1's words of call 1; that slot held "
                  "calls 0..0, the other slot call 0")
        if not any(record in line for line in reducer.timeouts()):
            failures.put(f"the timeout record says {reducer.timeouts()}, not '{record}'")
    finally:
        store.set("rank 0 done", "1")
        os._exit(0)


@pytest.mark.multigpu
def test_multigpu_a_peer_that_never_pushes_fails_the_step_after_the_timeout():
    _on_two_gpus(_peer_never_pushes)
