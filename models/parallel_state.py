"""The tensor-parallel group this process belongs to, and the two collectives the model needs.

A model built with tensor_parallel_size N on rank r holds 1/N of every attention head set, MLP and
vocabulary row block; after its row-parallel projections (attention output, MLP down) the partial
sums are added across the group (`tensor_parallel_all_reduce`), and the vocabulary-parallel LM head's
logits are gathered back to the whole vocabulary (`tensor_parallel_all_gather`).

The runner (which creates the process groups) calls `set_tensor_parallel_group` before it builds the
model; everything under models/ reads the group from here, so a single-process engine never sees
torch.distributed at all (size 1: every collective is the identity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    """This process's rank inside its tensor-parallel group (0..size-1)."""
    size: int = 1
    group: object | None = None
    """The torch.distributed ProcessGroup of the tensor-parallel ranks; None when size == 1."""


_GROUP = TensorParallelGroup()


def set_tensor_parallel_group(rank: int, size: int, group) -> None:
    """Declare this process's tensor-parallel group (rank, size, torch.distributed group)."""
    global _GROUP
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
    if size > 1 and group is None:
        raise ValueError("a tensor-parallel group of more than one rank needs its process group")
    _GROUP = TensorParallelGroup(rank, size, group if size > 1 else None)


def reset_tensor_parallel_group() -> None:
    """Back to a single-rank group (a process that served a tensor-parallel engine and ended it)."""
    global _GROUP
    _GROUP = TensorParallelGroup()


def tensor_parallel_group() -> TensorParallelGroup:
    return _GROUP


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place; the identity for a single rank."""
    if _GROUP.size == 1:
        return x
    import torch.distributed as dist
    dist.all_reduce(x, group=_GROUP.group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order; `x` itself for a single rank."""
    if _GROUP.size == 1:
        return x
    import torch.distributed as dist
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x, group=_GROUP.group)
    return torch.cat(parts, dim=dim)


def local_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one tensor-parallel rank holds, vLLM's rule: the query heads split
    evenly; the KV heads split evenly when there are at least as many as ranks, otherwise each KV
    head is replicated on tp_size / num_kv_heads ranks (every rank holds one). The KV cache of a
    rank is sized by the second number. A shape that cannot be split is a ValueError naming the
    checkpoint field."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({tp_size})")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size "
                         f"({tp_size})")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) is not a multiple of num_key_value_heads "
                         f"({num_kv_heads}), so the KV heads cannot be replicated evenly")
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)
