"""torch.distributed plumbing for the pipeline: process groups, the step broadcast, tensor p2p,
and the reply path from the last rank back to rank 0.

Three groups (docs/PIPELINE.md, "One step (the message protocol)"):
- `tensor_group` (the default group): NCCL on a GPU, gloo on a CPU; hidden states and residuals
  go rank r -> r+1 over it. Its timeout is `distributed_init_timeout_s`, which therefore also
  bounds how long a stage waits for its neighbour inside one step.
- `control_group`: gloo with the same bounded timeout, for start-up collectives (the KV block
  count agreement). On a CPU it is the default group itself.
- `object_group`: gloo with no practical timeout, for pickled messages (scheduler outputs, the
  stop message; under torchrun also the replies). Workers sit in its broadcast between
  generate() calls, so a bounded timeout would kill an idle pipeline. A dead peer still
  surfaces at once: gloo fails an operation whose peer connection closes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

NO_TIMEOUT = datetime.timedelta(days=365)

PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""In a rank's error: *another* process went away (a consequence of a failure, not its cause)."""

# The GPU hosts this runs on need NVLink multicast (NVLS / symmetric-memory multicast) off.
PIPELINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def set_pipeline_env() -> None:
    """Set in this process before any group exists; spawned workers inherit os.environ."""
    os.environ.update(PIPELINE_ENV)


@dataclass
class PipelineGroups:
    rank: int
    world_size: int
    backend: str
    tensor_group: object
    control_group: object
    object_group: object
    owns_default_group: bool

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def init_pipeline_groups(backend: str, rank: int, world_size: int, timeout_s: float,
                         store: dist.Store | None = None) -> PipelineGroups:
    """Join (or, under torchrun, reuse) the default group and create the two gloo groups.
    `store=None` means env:// (torchrun's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    owns = not dist.is_initialized()
    if owns:
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, but the pipeline needs rank {rank} of {world_size}")
    backend = dist.get_backend()
    # new_group is collective: every rank creates the same groups in the same order.
    control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    objects = dist.new_group(backend="gloo", timeout=NO_TIMEOUT)
    return PipelineGroups(rank, world_size, backend, None, control, objects, owns)


def destroy_pipeline_groups(groups: PipelineGroups | None, abort: bool = False) -> None:
    """Destroy what `init_pipeline_groups` created (the default group only if it made it).
    `abort`: a peer died, so NCCL communicators may hold operations that never complete;
    abort them rather than wait (gloo needs nothing special)."""
    if groups is None or not dist.is_initialized():
        return
    abort = abort and groups.backend == "nccl"
    if groups.owns_default_group:
        _destroy(None, abort)  # the default group takes every other group with it
        return
    for group in (groups.object_group, groups.control_group):
        if group is not None:
            _destroy(group, abort)


def _destroy(group, abort: bool) -> None:
    try:
        aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort and aborter is not None:
            aborter(group)
        else:
            dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - tearing down, possibly after a failure: best effort
        pass


# ---- messages ------------------------------------------------------------------------------
def broadcast_message(message, groups: PipelineGroups):
    """Rank 0 passes the message and gets it back; the others pass None and get rank 0's."""
    box = [message if groups.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.object_group)
    return box[0]


def send_message(message, dst: int, groups: PipelineGroups) -> None:
    dist.send_object_list([message], dst=dst, group=groups.object_group)


def recv_message(src: int, groups: PipelineGroups):
    box = [None]
    dist.recv_object_list(box, src=src, group=groups.object_group)
    return box[0]


def all_reduce_min(value: int, groups: PipelineGroups) -> int:
    """The smallest `value` over all ranks (the KV block count every rank then allocates)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=groups.control_group)
    return int(tensor.item())


# ---- tensors -------------------------------------------------------------------------------
def send_tensors(tensors, num_tokens: int, dst: int, groups: PipelineGroups) -> None:
    """Send the first `num_tokens` rows of hidden_states, then of residual, to rank `dst`.
    Blocking sends: on NCCL `wait()` makes the current stream wait for the send, so the next
    step's graph replay cannot overwrite a persistent output buffer still being sent."""
    for tensor in (tensors.hidden_states, tensors.residual):
        rows = tensor[:num_tokens]
        dist.send(rows if rows.is_contiguous() else rows.contiguous(), dst=dst, group=groups.tensor_group)


def recv_tensors_into(view, src: int, groups: PipelineGroups) -> None:
    """Receive hidden_states then residual from `src` straight into `view` (views of the
    persistent receive buffers), so the graphs of this stage see the same addresses every step."""
    for tensor in (view.hidden_states, view.residual):
        dist.recv(tensor, src=src, group=groups.tensor_group)


def warm_up_p2p(device: torch.device, dtype: torch.dtype, groups: PipelineGroups) -> None:
    """One tiny message down the chain 0 -> 1 -> ... -> N-1. On NCCL this creates the p2p
    communicators now, before the KV cache is sized, so their memory is counted."""
    probe = torch.zeros(1, dtype=dtype, device=device)
    if groups.rank > 0:
        dist.recv(probe, src=groups.rank - 1, group=groups.tensor_group)
    if not groups.is_last:
        dist.send(probe, dst=groups.rank + 1, group=groups.tensor_group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
