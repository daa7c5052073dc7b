"""The tensor-parallel group this process belongs to, and the collectives the model needs.

A model built with tensor_parallel_size N on rank r holds 1/N of every attention head set, MLP and
vocabulary row block; after its row-parallel projections (attention output, MLP down) the partial
sums are added across the group (`tensor_parallel_all_reduce`), and the vocabulary-parallel LM head's
logits are gathered back to the whole vocabulary (`tensor_parallel_all_gather`). With async
scheduling TP rank 0's sampled tokens reach the other ranks' devices by `tensor_parallel_broadcast`.

The runner (which creates the process groups) calls `set_tensor_parallel_group` before it builds the
model; everything under models/ reads the group from here, so a single-process engine never sees
torch.distributed at all (size 1: every collective is the identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:   # the kernel's module imports Triton, which a CPU engine never loads
    from models.push_all_reduce import PushAllReduce


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    """This process's rank inside its tensor-parallel group (0..size-1)."""
    size: int = 1
    group: object | None = None
    """The torch.distributed ProcessGroup of the tensor-parallel ranks; None when size == 1."""
    push: PushAllReduce | None = None
    """The one-kernel all-reduce of small tensors over NVLink (GPUs); None: NCCL does every all-reduce."""


_GROUP = TensorParallelGroup()


def set_tensor_parallel_group(rank: int, size: int, group, push: PushAllReduce | None = None) -> None:
    """Declare this process's tensor-parallel group (rank, size, torch.distributed group, and the
    push all-reduce when the runner set one up)."""
    global _GROUP
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
    if size > 1 and group is None:
        raise ValueError("a tensor-parallel group of more than one rank needs its process group")
    _GROUP = TensorParallelGroup(rank, size, group if size > 1 else None, push if size > 1 else None)


def reset_tensor_parallel_group() -> None:
    """Back to a single-rank group (a process that served a tensor-parallel engine and ended it)."""
    global _GROUP
    _GROUP = TensorParallelGroup()


def tensor_parallel_group() -> TensorParallelGroup:
    return _GROUP


def push_all_reduce_timeouts() -> list[str]:
    """What this rank's push all-reduce kernels recorded before they trapped on a peer that did not
    come (models/push_all_reduce.PushAllReduce.timeouts); empty when none did or there is none. It
    reads host memory only, so it works after the trap has destroyed the CUDA context."""
    return [] if _GROUP.push is None else _GROUP.push.timeouts()


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place; the identity for a single rank. Small
    tensors take the push all-reduce where there is one (models/push_all_reduce.py)."""
    if _GROUP.size == 1:
        return x
    if _GROUP.push is not None and _GROUP.push.usable(x):
        return _GROUP.push.all_reduce_(x)
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


def tensor_parallel_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Overwrite `x` on every rank with TP rank 0's `x`, in place; the identity for a single rank."""
    if _GROUP.size == 1:
        return x
    import torch.distributed as dist
    dist.broadcast(x, group=_GROUP.group, group_src=0)
    return x


# ---- how one rank's share of a layer is cut (pure arithmetic: no processes needed) -------------

@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: q heads [q_head_start, q_head_start + num_heads) and KV heads
    [kv_head_start, kv_head_start + num_kv_heads) of the checkpoint's."""
    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Split q heads evenly across the ranks (contiguous blocks) and KV heads with them; with fewer KV
    heads than ranks each rank holds ONE KV head, the one its q heads attend to (rank r: KV head
    r * num_kv_heads // tp_size, as vLLM replicates them). Raises a ValueError naming the config
    field when the counts do not divide."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is outside 0..{tp_size - 1}")
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by num_key_value_heads={num_kv_heads}")
    local_heads = num_heads // tp_size
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by "
                             f"tensor_parallel_size={tp_size}")
        local_kv = num_kv_heads // tp_size
        return HeadShard(local_heads, local_kv, tp_rank * local_heads, tp_rank * local_kv)
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} is not a multiple of num_key_value_heads={num_kv_heads} "
                         f"(with fewer KV heads than ranks each KV head is replicated on an equal number of ranks)")
    return HeadShard(local_heads, 1, tp_rank * local_heads, tp_rank * num_kv_heads // tp_size)


def shard_size(total: int, tp_size: int, field: str) -> int:
    """`total // tp_size`, each rank's part of a dimension split evenly (MLP columns); a ValueError
    naming `field` when it does not divide."""
    if total % tp_size:
        raise ValueError(f"{field}={total} is not divisible by tensor_parallel_size={tp_size}")
    return total // tp_size


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of tp_size: every rank owns an equal row block, the
    rows past `vocab_size` being zero padding (their logits are cut off after the gather)."""
    return -(-vocab_size // tp_size) * tp_size


@dataclass(frozen=True)
class VocabShard:
    """One rank's block of the padded vocabulary: ids [start, start + num_rows); of those, the first
    `num_real_rows` exist in the checkpoint (the rest are padding, zero)."""
    start: int
    num_rows: int
    num_real_rows: int


def shard_vocab(vocab_size: int, tp_size: int, tp_rank: int) -> VocabShard:
    rows = padded_vocab_size(vocab_size, tp_size) // tp_size
    start = tp_rank * rows
    return VocabShard(start, rows, max(0, min(rows, vocab_size - start)))
