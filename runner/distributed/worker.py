"""Ranks 1..world-1: start this rank's model runner and serve steps until rank 0 says stop.

The same loop runs in a worker process that DistributedExecutor spawned (`worker_main`) and in a
torchrun rank whose `LLM(...)` constructor turned into a worker (DistributedExecutor, external
launcher). Only the reply channel differs: a multiprocessing pipe to the parent, or gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs import EngineConfig
from models.hf_config import ModelSpec
from models.parallel_state import push_all_reduce_timeouts, reset_tensor_parallel_group, set_tensor_parallel_group
from runner.collector import frozen_heap
from runner.distributed.comm import (PEER_LOSS_MARKERS, Agreement, DistributedGroups, broadcast_message, destroy_groups,
                                     init_groups, push_all_reduce, recv_tensors_into, send_message, send_tensors,
                                     set_distributed_env, warm_up_communicators)
from runner.distributed.topology import Topology
from runner.executor import start_model_runner
from runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Messages (see docs/PARALLEL.md). Rank 0 -> all, broadcast on the object group:
STEP = "step"        # ("step", SchedulerOutput, (runtime mode, BatchDescriptor | None))
STOP = "stop"        # ("stop",)
# Worker -> rank 0 (pipe, or gloo under torchrun):
HELLO = "hello"      # ("hello",)                 spawned worker reached the rendezvous
OUTPUT = "output"    # ("output", ModelRunnerOutput)   the sampler rank, once per non-empty step
ERROR = "error"      # ("error", traceback text)   any worker, then it exits


def start_rank(config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device, dtype: torch.dtype,
               max_model_len: int, layer_range: range, groups: DistributedGroups) -> tuple[ModelRunner, int]:
    """The warm-up contract on this rank, in lock-step with the others: declare the TP group
    (before the model is built: models/ read it), agree on the graph plan, load, profile without
    a KV cache, agree on the smallest block count, allocate exactly that, capture, agree that
    every rank's graphs are ready. Returns (runner, agreed block count). The TP group's push
    all-reduce is set up first (collective), so the KV budget counts its buffer."""
    parallel = config.parallel
    push = push_all_reduce(parallel.push_all_reduce_max_bytes, device, groups, in_gemv=parallel.push_all_reduce_in_gemv,
                           peer_timeout_s=parallel.distributed_init_timeout_s,
                           timeout_record=parallel.push_all_reduce_timeout_record)
    set_tensor_parallel_group(groups.tp_rank, groups.topology.tp_size, groups.tp_group, push)
    with frozen_heap():   # its collections walk only what it allocates (runner/collector.py)
        runner = ModelRunner(config, spec, model_path, device, dtype, max_model_len, layer_range=layer_range)
        blocks = start_model_runner(runner, config, Agreement(groups))
    return runner, blocks


def serve_steps(runner: ModelRunner, groups: DistributedGroups, reply) -> None:
    """Until STOP: take rank 0's broadcast step and its graph decision, receive this step's input
    from the previous stage into the persistent receive buffers, run it, pass the result on (the
    next stage's same TP rank; the sampler rank's tokens go to `reply`, the others' are dropped).

    Rank 0 decides the step's (runtime mode, descriptor) once and every rank replays exactly that
    graph, so no rank waits in a collective another skipped; the padded row count follows from
    it, so sender and receiver agree without sending it. Empty steps (only finished/preempted
    ids) run the runner to drop per-request state and move no tensors."""
    while True:
        message = broadcast_message(None, groups)
        if message[0] == STOP:
            return
        sched, decision = message[1], message[2]
        if runner.async_scheduling:  # tensor parallel, one stage: rank 0 samples; its tokens come by broadcast
            runner.execute_async(sched, decision)
            continue
        if not sched.scheduled:
            runner.execute(sched)
            continue
        try:
            padded = runner.padded_num_tokens(sched, decision)
            if groups.prev_rank is not None:
                recv_tensors_into(runner.intermediate_view(padded), groups.prev_rank, groups)
            output = runner.execute(sched, decision)
        except Exception:
            if groups.is_sampler:  # rank 0 is waiting for exactly this rank's reply: tell it why
                with contextlib.suppress(Exception):   # rank 0 is gone; the original error matters
                    reply((ERROR, traceback.format_exc()))
            raise
        if groups.next_rank is not None:
            send_tensors(output, padded, groups.next_rank, groups)
        elif groups.is_sampler:
            reply((OUTPUT, output))


@dataclass
class WorkerJob:
    """Everything a spawned worker needs (pickled to it)."""
    config: EngineConfig
    spec: ModelSpec
    model_path: str
    dtype: torch.dtype
    max_model_len: int
    layer_ranges: list[range]
    """One per pipeline stage."""
    topology: Topology
    device_type: str
    store_port: int
    parent_pid: int
    log_level: int


def worker_main(rank: int, job: WorkerJob, conn) -> None:
    """Entry point of a spawned worker process (rank >= 1). Reports failures to rank 0 through
    `conn` with the traceback text, then exits with status 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    topology = job.topology
    logging.basicConfig(level=job.log_level,
                        format=f"%(asctime)s [{topology.describe(rank)}] %(levelname)s %(name)s: %(message)s")
    _exit_when_orphaned(job.parent_pid)
    try:
        set_distributed_env()
        device = torch.device(job.device_type, rank) if job.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout_s = job.config.parallel.distributed_init_timeout_s
        store = dist.TCPStore("127.0.0.1", job.store_port, topology.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        conn.send((HELLO,))
        groups = init_groups("nccl" if device.type == "cuda" else "gloo", rank, topology, timeout_s, store)
        warm_up_communicators(device, job.dtype, groups)
        runner, _ = start_rank(job.config, job.spec, job.model_path, device, job.dtype, job.max_model_len,
                               job.layer_ranges[topology.stage(rank)], groups)
        serve_steps(runner, groups, conn.send)
        runner.release_cuda_graphs()  # before the groups: NCCL waits for graphs holding its collectives
        reset_tensor_parallel_group()
        destroy_groups(groups)
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit from below
        trace = traceback.format_exc().rstrip()
        text = "\n".join([trace, *push_all_reduce_timeouts()])   # what a trapped push kernel waited for
        if any(marker in text for marker in PEER_LOSS_MARKERS):  # a consequence: one line is enough
            logger.error("worker %s lost a peer; exiting: %s", topology.describe(rank), trace.splitlines()[-1])
        else:
            logger.error("worker %s failed:\n%s", topology.describe(rank), text)
        with contextlib.suppress(OSError):   # rank 0 is gone
            conn.send((ERROR, text))
            conn.close()
        os._exit(1)  # skip atexit/destructors that could wait on a broken communicator
    conn.close()


def _exit_when_orphaned(parent_pid: int) -> None:
    """If rank 0 dies without a word (SIGKILL), gloo fails our next receive anyway; this also
    catches a worker stuck elsewhere (e.g. waiting on a GPU stream)."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)
    threading.Thread(target=watch, name="worker-orphan-watch", daemon=True).start()


def run_external_worker(config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device,
                        dtype: torch.dtype, max_model_len: int, layer_range: range, groups: DistributedGroups) -> None:
    """A torchrun rank >= 1: start the rank, serve until rank 0 stops, tear down. Failures
    propagate: the process exits non-zero and torchrun stops the job (a failing step on the
    sampler rank first sends rank 0 its traceback, since rank 0 is waiting for that rank's reply)."""
    warm_up_communicators(device, dtype, groups)
    runner, _ = start_rank(config, spec, model_path, device, dtype, max_model_len, layer_range, groups)
    serve_steps(runner, groups, lambda message: send_message(message, 0, groups))
    runner.release_cuda_graphs()  # before the groups: NCCL waits for graphs holding its collectives
    reset_tensor_parallel_group()
    destroy_groups(groups)
