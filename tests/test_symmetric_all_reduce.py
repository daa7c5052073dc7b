"""The symmetric-memory all-reduce of tensor parallelism on GPUs (models/symmetric_all_reduce.py),
its logic on a CPU: which tensors take the one-kernel path (the same decision on every rank, from
size, dtype and alignment alone), that the rest stay on NCCL, and the start-up agreement that
falls back to NCCL on every rank when one rank cannot allocate. The kernel itself runs in the
`multigpu` tests (tests/test_tensor_parallel.py), whose TP=2 parity uses it by default."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from models import parallel_state
from models.symmetric_all_reduce import SymmetricAllReduce
from runner.distributed import comm


def test_only_small_aligned_bf16_and_fp32_tensors_take_the_kernel():
    symmetric = SymmetricAllReduce(torch.empty(4096, dtype=torch.uint8), "tp")
    assert symmetric.usable(torch.zeros(1, 4096 // 2, dtype=torch.bfloat16))      # exactly max_bytes
    assert symmetric.usable(torch.zeros(4, 64, dtype=torch.float32))
    assert not symmetric.usable(torch.zeros(1, 4096, dtype=torch.bfloat16))      # larger than the buffer
    assert not symmetric.usable(torch.zeros(8, 64, dtype=torch.float16))         # no fp16 kernel
    assert not symmetric.usable(torch.zeros(3, dtype=torch.float32))             # 12 bytes: not 16-aligned
    assert not symmetric.usable(torch.zeros(0, dtype=torch.float32))
    assert not symmetric.usable(torch.zeros(64, 8, dtype=torch.float32).t())     # not contiguous
    assert not symmetric.usable(torch.zeros(68, dtype=torch.float32)[1:65])      # offset of 4 bytes


def test_all_reduce_takes_the_kernel_for_usable_tensors_and_nccl_for_the_rest(monkeypatch):
    calls = []

    class Recording(SymmetricAllReduce):
        def all_reduce_(self, x):
            calls.append(("symmetric", tuple(x.shape)))
            return x

    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(
        0, 2, object(), Recording(torch.empty(1024, dtype=torch.uint8), "tp")))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group: calls.append(("nccl", tuple(x.shape))))
    small, large = torch.zeros(2, 64), torch.zeros(16, 64)
    assert parallel_state.tensor_parallel_all_reduce(small) is small
    assert parallel_state.tensor_parallel_all_reduce(large) is large
    assert calls == [("symmetric", (2, 64)), ("nccl", (16, 64))]


def _groups(tp_group=True):
    return SimpleNamespace(rank=0, tp_group=SimpleNamespace(group_name="tp-0") if tp_group else None)


def test_setup_only_for_cuda_tensor_parallelism_with_a_budget():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert comm.symmetric_all_reduce(4096, cpu, _groups()) is None
    assert comm.symmetric_all_reduce(4096, cuda, _groups(tp_group=False)) is None
    assert comm.symmetric_all_reduce(0, cuda, _groups()) is None


@pytest.mark.parametrize("allocated_everywhere", [True, False])
def test_setup_agrees_across_ranks_before_the_rendezvous(monkeypatch, allocated_everywhere):
    """Each rank allocates alone; the rendezvous (collective) happens only if every rank could,
    so one rank without symmetric memory leaves every rank on NCCL instead of hanging the others."""
    buffer = torch.empty(64, dtype=torch.uint8)
    rendezvous = []
    monkeypatch.setattr(SymmetricAllReduce, "allocate", classmethod(lambda cls, max_bytes, device: buffer))
    monkeypatch.setattr(SymmetricAllReduce, "rendezvous",
                        classmethod(lambda cls, b, name: rendezvous.append(name) or cls(b, name)))
    monkeypatch.setattr(comm, "all_reduce_min", lambda value, groups: value if allocated_everywhere else 0)
    result = comm.symmetric_all_reduce(64, torch.device("cuda", 0), _groups())
    if allocated_everywhere:
        assert result.buffer is buffer and result.group_name == "tp-0" and rendezvous == ["tp-0"]
    else:
        assert result is None and rendezvous == []


def test_a_rank_that_cannot_allocate_says_why_and_keeps_nccl(monkeypatch, caplog):
    def fail(cls, max_bytes, device):
        raise RuntimeError("CUDA driver API unsupported")
    monkeypatch.setattr(SymmetricAllReduce, "allocate", classmethod(fail))
    monkeypatch.setattr(comm, "all_reduce_min", lambda value, groups: value)
    with caplog.at_level(logging.WARNING, logger="runner.distributed.comm"):
        assert comm.symmetric_all_reduce(64, torch.device("cuda", 0), _groups()) is None
    assert "symmetric-memory all-reduce unavailable on rank 0 (CUDA driver API unsupported)" in caplog.text
