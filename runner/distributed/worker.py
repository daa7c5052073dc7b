"""Pipeline ranks 1..N-1: start a stage, then serve steps until rank 0 says stop.

The same loop runs in a worker process that PipelineExecutor spawned (`worker_main`) and in a
torchrun rank whose `LLM(...)` constructor turned into a worker (PipelineExecutor, external
launcher). Only the reply channel differs: a multiprocessing pipe to the parent, or gloo.
"""

from __future__ import annotations

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
from runner.executor import start_model_runner
from runner.model_runner import ModelRunner
from runner.pipeline.comm import (PEER_LOSS_MARKERS, PipelineGroups, all_reduce_min, broadcast_message, destroy_pipeline_groups,
                                  init_pipeline_groups, recv_tensors_into, send_message, send_tensors,
                                  set_pipeline_env, warm_up_p2p)

logger = logging.getLogger(__name__)

# Messages (see docs/PIPELINE.md). Rank 0 -> all, broadcast on the object group:
STEP = "step"        # ("step", SchedulerOutput)
STOP = "stop"        # ("stop",)
# Worker -> rank 0 (pipe, or gloo under torchrun):
HELLO = "hello"      # ("hello",)                 spawned worker reached the rendezvous
OUTPUT = "output"    # ("output", ModelRunnerOutput)   last rank, once per non-empty step
ERROR = "error"      # ("error", traceback text)   any worker, then it exits


def start_stage(config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device, dtype: torch.dtype,
                max_model_len: int, layer_range: range, groups: PipelineGroups) -> tuple[ModelRunner, int]:
    """The warm-up contract on this rank, in lock-step with the others: every rank loads,
    profiles without a KV cache, then all agree on the smallest block count, allocate exactly
    that and capture their graphs. Returns (runner, agreed block count)."""
    runner = ModelRunner(config, spec, model_path, device, dtype, max_model_len, layer_range=layer_range)
    blocks = start_model_runner(runner, config, agree=lambda n: all_reduce_min(n, groups))
    return runner, blocks


def serve_steps(runner: ModelRunner, groups: PipelineGroups, reply) -> None:
    """Until STOP: take rank 0's broadcast step, receive this step's input from rank-1 into the
    persistent receive buffers, run it, pass the result on (rank+1, or `reply` on the last rank).

    Every rank computes `padded_num_tokens` from the same SchedulerOutput with the same graph
    state, so sender and receiver agree on the row count without sending it. Empty steps (only
    finished/preempted ids) run the runner to drop per-request state and move no tensors."""
    while True:
        message = broadcast_message(None, groups)
        if message[0] == STOP:
            return
        sched = message[1]
        if not sched.scheduled:
            runner.execute(sched)
            continue
        try:
            padded = runner.padded_num_tokens(sched)
            recv_tensors_into(runner.intermediate_view(padded), groups.rank - 1, groups)
            output = runner.execute(sched)
        except Exception:
            if groups.is_last:  # rank 0 is waiting for exactly this rank's reply: tell it why
                try:
                    reply((ERROR, traceback.format_exc()))
                except Exception:  # noqa: BLE001 - rank 0 is gone; the original error matters
                    pass
            raise
        if groups.is_last:
            reply((OUTPUT, output))
        else:
            send_tensors(output, padded, groups.rank + 1, groups)


@dataclass
class WorkerJob:
    """Everything a spawned worker needs (pickled to it)."""
    config: EngineConfig
    spec: ModelSpec
    model_path: str
    dtype: torch.dtype
    max_model_len: int
    layer_ranges: list[range]
    device_type: str
    store_port: int
    parent_pid: int
    log_level: int


def worker_main(rank: int, job: WorkerJob, conn) -> None:
    """Entry point of a spawned worker process (rank >= 1). Reports failures to rank 0 through
    `conn` with the traceback text, then exits with status 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    logging.basicConfig(level=job.log_level, format=f"%(asctime)s [pp rank {rank}] %(levelname)s %(name)s: %(message)s")
    _exit_when_orphaned(job.parent_pid)
    try:
        set_pipeline_env()
        world_size = len(job.layer_ranges)
        device = torch.device(job.device_type, rank) if job.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout_s = job.config.parallel.distributed_init_timeout_s
        store = dist.TCPStore("127.0.0.1", job.store_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        conn.send((HELLO,))
        groups = init_pipeline_groups("nccl" if device.type == "cuda" else "gloo", rank, world_size, timeout_s, store)
        warm_up_p2p(device, job.dtype, groups)
        runner, _ = start_stage(job.config, job.spec, job.model_path, device, job.dtype, job.max_model_len,
                                job.layer_ranges[rank], groups)
        serve_steps(runner, groups, conn.send)
        destroy_pipeline_groups(groups)
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit from below
        text = traceback.format_exc()
        if any(marker in text for marker in PEER_LOSS_MARKERS):  # a consequence: one line is enough
            logger.error("pipeline worker rank %d lost a peer; exiting: %s", rank, text.strip().splitlines()[-1])
        else:
            logger.error("pipeline worker rank %d failed:\n%s", rank, text)
        try:
            conn.send((ERROR, text))
            conn.close()
        except OSError:
            pass  # rank 0 is gone
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
    threading.Thread(target=watch, name="pp-orphan-watch", daemon=True).start()


def run_external_worker(config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device,
                        dtype: torch.dtype, max_model_len: int, layer_range: range, groups: PipelineGroups) -> None:
    """A torchrun rank >= 1: start the stage, serve until rank 0 stops, tear down. Failures
    propagate: the process exits non-zero and torchrun stops the job (a failing step on the last
    rank first sends rank 0 its traceback, since rank 0 is waiting for that rank's reply)."""
    warm_up_p2p(device, dtype, groups)
    runner, _ = start_stage(config, spec, model_path, device, dtype, max_model_len, layer_range, groups)
    serve_steps(runner, groups, lambda message: send_message(message, 0, groups))
    destroy_pipeline_groups(groups)
