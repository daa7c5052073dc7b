"""A one-kernel all-reduce of small tensors between the GPUs of a tensor-parallel group, through
PyTorch symmetric memory (NVLink peer loads; no multicast).

A decode step of a tensor-parallel model all-reduces a few KiB twice per layer (bs 1 on a
Llama-3-8B: 8 KiB, 64 times a step). NCCL's ring spends ~10 us of latency on each; the one-shot
kernel (torch.ops.symm_mem.one_shot_all_reduce_copy_out) copies the local tensor into this rank's
symmetric buffer, waits at a barrier on every peer, sums the peers' buffers straight into the
tensor, and waits again so the buffer can be reused by the next call. It is one kernel, so it is
captured in CUDA graphs like any other.

The runner allocates and rendezvouses the buffer on every rank of the group at start-up
(runner/distributed/comm.py); `tensor_parallel_all_reduce` takes this path for the tensors that
`usable` accepts and NCCL for the rest (larger prefill tensors, other dtypes). Every rank decides
from the tensor's size and dtype alone, so all ranks take the same path for the same call.
"""

from __future__ import annotations

import torch

ALIGNMENT = 16
"""Bytes: the kernel's vector width; the tensor's size and offset keep to it (its alignment must
equal the buffer's)."""
DTYPES = (torch.bfloat16, torch.float32)
"""What the kernel is built for."""


class SymmetricAllReduce:
    """The group's symmetric buffer (`max_bytes`, rendezvoused) and the one-shot all-reduce into it."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer
        self.group_name = group_name
        self.max_bytes = buffer.numel()

    @classmethod
    def allocate(cls, max_bytes: int, device: torch.device) -> torch.Tensor:
        """This rank's buffer (a local allocation: no peer is involved yet)."""
        import torch.distributed._symmetric_memory as symm_mem
        return symm_mem.empty(max_bytes - max_bytes % ALIGNMENT, dtype=torch.uint8, device=device)

    @classmethod
    def rendezvous(cls, buffer: torch.Tensor, group_name: str) -> "SymmetricAllReduce":
        """Exchange the buffers' handles with the group's other ranks (collective: every rank of
        the group calls it with its own buffer)."""
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.rendezvous(buffer, group_name)
        return cls(buffer, group_name)

    def usable(self, x: torch.Tensor) -> bool:
        """Whether `x` takes this path: a contiguous bf16/fp32 tensor of at most `max_bytes`, its
        size and offset 16-byte multiples."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % ALIGNMENT == 0 and x.storage_offset() * x.element_size() % ALIGNMENT == 0)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (each thread reads its elements of `x` before the
        first barrier and writes them after it, so `x` can be both input and output)."""
        flat = x.view(-1)
        staged = self.buffer.view(x.dtype)[:flat.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
        return x
