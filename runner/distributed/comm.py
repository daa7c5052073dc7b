"""torch.distributed plumbing of a multi-process engine: process groups, the step broadcast,
the pipeline's tensor p2p, the reply path to rank 0, and the start-up agreements.

Groups (docs/PARALLEL.md, "Process groups"):
- `tensor_group` (the default group, every rank): NCCL on a GPU, gloo on a CPU; hidden states and
  residuals go (stage s, tp rank t) -> (stage s+1, tp rank t) over it. Its timeout is
  `distributed_init_timeout_s`, which therefore also bounds how long a stage waits for its
  neighbour inside one step.
- `tp_group`: the ranks of this rank's pipeline stage (Topology.tp_group_ranks), NCCL on a GPU,
  gloo on a CPU; the model's all-reduces and all-gathers run on it (models/parallel_state.py).
  None when tensor_parallel_size is 1.
- `control_group`: gloo with the same bounded timeout, for start-up collectives (the KV block
  count, the graph plan). On a CPU it is the default group itself.
- `object_group`: gloo with no practical timeout, for pickled messages (scheduler outputs, the
  stop message; under torchrun also the replies). Workers sit in its broadcast between
  generate() calls, so a bounded timeout would kill an idle engine. A dead peer still
  surfaces at once: gloo fails an operation whose peer connection closes.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from runner.distributed.topology import Topology

if TYPE_CHECKING:   # the kernel's module imports Triton: only a GPU engine with the push all-reduce loads it
    from models.push_all_reduce import PushAllReduce

logger = logging.getLogger(__name__)

NO_TIMEOUT = datetime.timedelta(days=365)

PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""In a rank's error: *another* process went away (a consequence of a failure, not its cause)."""

# The GPU hosts this runs on need NVLink multicast (NVLS / symmetric-memory multicast) off.
DISTRIBUTED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def set_distributed_env() -> None:
    """Set in this process before any group exists; spawned workers inherit os.environ."""
    os.environ.update(DISTRIBUTED_ENV)


@dataclass
class DistributedGroups:
    rank: int
    topology: Topology
    backend: str
    tensor_group: object
    control_group: object
    object_group: object
    tp_group: object
    owns_default_group: bool
    tp_groups: tuple = ()
    """Every stage's TP group (new_group is collective: each rank made all of them)."""

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def stage(self) -> int:
        return self.topology.stage(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank(self.rank)

    @property
    def prev_rank(self) -> int | None:
        return self.topology.prev_rank(self.rank)

    @property
    def next_rank(self) -> int | None:
        return self.topology.next_rank(self.rank)

    @property
    def is_sampler(self) -> bool:
        """This rank samples and sends the step's tokens to rank 0."""
        return self.rank == self.topology.sampler_rank


def init_groups(backend: str, rank: int, topology: Topology, timeout_s: float,
                store: dist.Store | None = None) -> DistributedGroups:
    """Join (or, under torchrun, reuse) the default group and create the other groups.
    `store=None` means env:// (torchrun's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    world_size = topology.world_size
    owns = not dist.is_initialized()
    if owns:
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, but the engine needs rank {rank} of {world_size}")
    backend = dist.get_backend()
    # new_group is collective: every rank creates the same groups in the same order.
    control = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    objects = dist.new_group(backend="gloo", timeout=NO_TIMEOUT)
    tp_groups, mine = (), None
    if topology.tp_size > 1:
        tp_groups = tuple(dist.new_group(topology.tp_group_ranks(stage), backend=backend, timeout=timeout)
                          for stage in range(topology.pp_size))
        mine = tp_groups[topology.stage(rank)]
    return DistributedGroups(rank, topology, backend, None, control, objects, mine, owns, tp_groups)


ABORT_WAIT_S = 10.0
"""How long a failure's teardown waits for the NCCL communicators' abort (`destroy_groups`)."""


def destroy_groups(groups: DistributedGroups | None, abort: bool = False) -> None:
    """Destroy what `init_groups` created (the default group only if it made it).
    `abort`: a step or start-up failed (a peer died, a kernel trapped), so NCCL communicators may
    hold operations that never complete; abort them rather than wait (gloo needs nothing special).
    The abort itself can block on those operations (`ProcessGroupNCCL::abort` waited over 120 s
    after a push all-reduce kernel trapped in start-up: docs/PARALLEL.md, "Push all-reduce"), so it
    runs on a daemon thread and the teardown goes on after ABORT_WAIT_S, leaving the groups to it:
    the failure's error then reaches the caller instead of waiting behind them."""
    if groups is None or not dist.is_initialized():
        return
    abort = abort and groups.backend == "nccl"
    targets = [None] if groups.owns_default_group else [   # the default group takes every other with it
        group for group in (*groups.tp_groups, groups.object_group, groups.control_group)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER]

    def destroy_all() -> None:
        for group in targets:
            _destroy(group, abort)
    if not abort:
        destroy_all()
        return
    aborting = threading.Thread(target=destroy_all, name="graphrunner-nccl-abort", daemon=True)
    aborting.start()
    aborting.join(ABORT_WAIT_S)
    if aborting.is_alive():
        logger.warning("aborting the NCCL communicators has not ended after %.0f s (an operation of the failed "
                       "step holds them); going on without them: this process's torch.distributed stays "
                       "initialised, so a new multi-process engine needs a new process", ABORT_WAIT_S)


def _destroy(group, abort: bool) -> None:
    try:
        aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort and aborter is not None:
            aborter(group)
        else:
            dist.destroy_process_group(group)
    except Exception as error:  # noqa: BLE001 - tearing down, possibly after a failure: best effort
        logger.debug("%s process group %s failed: %s", "aborting" if abort else "destroying", group, error)


# ---- messages ------------------------------------------------------------------------------
def broadcast_message(message, groups: DistributedGroups):
    """Rank 0 passes the message and gets it back; the others pass None and get rank 0's."""
    box = [message if groups.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.object_group)
    return box[0]


def send_message(message, dst: int, groups: DistributedGroups) -> None:
    dist.send_object_list([message], dst=dst, group=groups.object_group)


def recv_message(src: int, groups: DistributedGroups):
    box = [None]
    dist.recv_object_list(box, src=src, group=groups.object_group)
    return box[0]


# ---- start-up agreements ---------------------------------------------------------------------
def all_reduce_min(value: int, groups: DistributedGroups) -> int:
    """The smallest `value` over all ranks (the KV block count every rank then allocates)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=groups.control_group)
    return int(tensor.item())


def all_gather_objects(value, groups: DistributedGroups) -> list:
    """Every rank's `value`, in rank order (the graph plan each rank would use on its own)."""
    values = [None] * groups.world_size
    dist.all_gather_object(values, value, group=groups.control_group)
    return values


def _allocate_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)   # zeroed before any peer can map it and push
    return buffer


_IPC_DEVICE_ARG = 6
"""Where torch.multiprocessing.reductions.rebuild_cuda_tensor takes the device to open a CUDA IPC
handle on (after tensor_cls, size, stride, offset, storage_cls, dtype). The owner's device would
make each rank create a CUDA context on its peers' GPUs (memory they count on) and fail where a rank
sees only its own GPU; opened on this rank's GPU, the peer's memory is reached over NVLink."""


def _exchange_buffers(buffer: torch.Tensor, groups: DistributedGroups) -> list[torch.Tensor]:
    """Every rank of this rank's TP group's buffer, in TP rank order, mapped into this process: its
    own, and the others' opened through CUDA IPC (collective over the world: each rank's handle
    goes to every rank through the control group). Not torch's symmetric memory: that keeps each
    group's store in a process-wide table by group name, and group names repeat when a process
    builds a second engine, so its rendezvous would wait on the first engine's store.
    Each rank writes a random mark at the end of its buffer and sends it with its handle; a peer's
    mapping that does not read back the peer's mark is refused (`_check_mark`): torch opens IPC
    handles through a per-process cache keyed by the handle's bytes, and pushes into a mapping of
    other memory would leave the peer waiting for ever."""
    from torch.multiprocessing.reductions import reduce_tensor
    from models.push_all_reduce import MARK_BYTES
    mark = secrets.randbits(62) + 1
    buffer[-MARK_BYTES:].view(torch.int64).fill_(mark)
    torch.cuda.synchronize(buffer.device)
    shared = all_gather_objects((reduce_tensor(buffer), mark), groups)
    mapped = []
    for rank in groups.topology.tp_group_ranks(groups.stage):
        if rank == groups.rank:
            mapped.append(buffer)
        else:
            (rebuild, args), peer_mark = shared[rank]   # torch.multiprocessing's rebuild_cuda_tensor and its arguments
            args = list(args)
            args[_IPC_DEVICE_ARG] = buffer.device.index   # open it in this GPU's context: peer access
            peer = rebuild(*args)
            _check_mark(peer, peer_mark, rank)
            mapped.append(peer)
    return mapped


def _check_mark(peer: torch.Tensor, mark: int, rank: int) -> None:
    """Raise unless the mapped buffer `peer` ends with `mark`, the number rank `rank` wrote there."""
    from models.push_all_reduce import MARK_BYTES
    found = int(peer[-MARK_BYTES:].view(torch.int64).item())
    if found != mark:
        raise RuntimeError(f"rank {rank}'s push buffer, mapped here, ends with {found}, not the mark {mark} that "
                           f"rank wrote: the CUDA IPC mapping is of other memory")


def push_all_reduce(max_bytes: int, device: torch.device, groups: DistributedGroups, in_gemv: bool = True,
                    peer_timeout_s: float | None = None, timeout_record: bool = False) -> PushAllReduce | None:
    """This rank's push all-reduce for its TP group's small all-reduces (models/push_all_reduce.py),
    or None: NCCL does them all. Only for CUDA tensor parallelism with `max_bytes` > 0. Collective
    over the world: every rank allocates its zeroed buffer, all agree that every allocation
    succeeded (else every rank keeps NCCL, with a warning naming the error, instead of one rank
    waiting in an exchange the others skip), the buffers are mapped into every rank of their TP
    group, and no rank returns before every buffer is zeroed and mapped (no word from before may
    carry a tag the first calls expect). `in_gemv`: one-row projections may all-reduce in their GEMV
    (ParallelConfig.push_all_reduce_in_gemv). `peer_timeout_s`: how long its kernels wait for a
    peer's words before they trap; an engine gives its TP group's timeout, so a peer that never
    comes fails a step after the same time with the push kernel as with NCCL (None: the kernels'
    default, models/push_all_reduce.PEER_TIMEOUT_S). `timeout_record`: a kernel that times out first
    records what it waited for (ParallelConfig.push_all_reduce_timeout_record)."""
    if device.type != "cuda" or groups.tp_group is None or max_bytes <= 0:
        return None
    from models.push_all_reduce import PushAllReduce
    try:
        nbytes = PushAllReduce.buffer_bytes(max_bytes, groups.topology.tp_size)
        buffer, error = _allocate_buffer(nbytes, device), None
    except Exception as caught:  # noqa: BLE001 - out of memory: NCCL does every all-reduce
        buffer, error = None, caught
    if not _every_rank_could(buffer is not None, error, groups):
        return None
    try:
        buffers, error = _exchange_buffers(buffer, groups), None
    except Exception as caught:  # noqa: BLE001 - no CUDA IPC between these GPUs
        buffers, error = None, caught
    if not _every_rank_could(buffers is not None, error, groups):   # also the barrier
        return None
    return PushAllReduce(buffers, groups.tp_rank, max_bytes, in_gemv=in_gemv, peer_timeout_s=peer_timeout_s,
                         timeout_record=timeout_record)


def _every_rank_could(done: bool, error: Exception | None, groups: DistributedGroups) -> bool:
    """Whether every rank did a step of `push_all_reduce` (collective); a rank that could not
    says why."""
    if all_reduce_min(int(done), groups) == 1:
        return True
    if error is not None:
        logger.warning("push all-reduce unavailable on rank %d (%s); NCCL does every all-reduce", groups.rank, error)
    return False


class Agreement:
    """The start-up agreements `start_model_runner` makes across every rank of the world (a
    single process agrees with itself: `Agreement()`)."""

    def __init__(self, groups: DistributedGroups | None = None) -> None:
        self.groups = groups

    def min(self, value: int) -> int:
        return value if self.groups is None else all_reduce_min(value, self.groups)

    def gather(self, value) -> list:
        return [value] if self.groups is None else all_gather_objects(value, self.groups)


# ---- tensors -------------------------------------------------------------------------------
def send_tensors(tensors, num_tokens: int, dst: int, groups: DistributedGroups) -> None:
    """Send the first `num_tokens` rows of hidden_states, then of residual, to rank `dst`.
    Blocking sends: on NCCL `wait()` makes the current stream wait for the send, so the next
    step's graph replay cannot overwrite a persistent output buffer still being sent."""
    for tensor in (tensors.hidden_states, tensors.residual):
        rows = tensor[:num_tokens]
        dist.send(rows if rows.is_contiguous() else rows.contiguous(), dst=dst, group=groups.tensor_group)


def recv_tensors_into(view, src: int, groups: DistributedGroups) -> None:
    """Receive hidden_states then residual from `src` straight into `view` (views of the
    persistent receive buffers), so the graphs of this stage see the same addresses every step."""
    for tensor in (view.hidden_states, view.residual):
        dist.recv(tensor, src=src, group=groups.tensor_group)


def warm_up_communicators(device: torch.device, dtype: torch.dtype, groups: DistributedGroups) -> None:
    """One tiny message down each pipeline chain (stage 0 -> 1 -> ... for every TP rank) and one
    all-reduce in each TP group. On NCCL this creates the communicators now, before the KV cache
    is sized, so their memory is counted."""
    probe = torch.zeros(1, dtype=dtype, device=device)
    if groups.prev_rank is not None:
        dist.recv(probe, src=groups.prev_rank, group=groups.tensor_group)
    if groups.next_rank is not None:
        dist.send(probe, dst=groups.next_rank, group=groups.tensor_group)
    if groups.tp_group is not None:
        dist.all_reduce(probe, group=groups.tp_group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
