"""DistributedExecutor: rank 0 (the driver) of an engine of tensor_parallel_size x
pipeline_parallel_size > 1 processes (docs/PARALLEL.md).

Two ways to get the other ranks:
- spawned (default): this process is rank 0 and starts ranks 1..N-1 itself with
  torch.multiprocessing (spawn), rendezvous on 127.0.0.1 at a free port;
- external launcher: under `torchrun --nproc-per-node N` (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
  set) nothing is spawned; rank 0's LLM(...) drives, and on every other rank the constructor
  serves steps until rank 0 shuts down, then calls sys.exit(0).

Rank 0 schedules (the engine's one Scheduler), decides each step's graph (mode, descriptor) and
broadcasts both; every rank runs the step; the sampler rank (the last stage's TP rank 0, rank 0
itself with one stage) samples once and its tokens come back to rank 0.

Failure handling (spawned): rank 0 waits for the sampler rank's reply with
`multiprocessing.connection.wait` over every worker's pipe and process sentinel, so a worker that
raises (its traceback comes through the pipe) or dies (killed, crashed) ends the wait at once
with a WorkerError naming the rank; the surviving workers are then stopped. With one stage rank 0
samples itself: a TP peer's death fails rank 0's next collective (gloo: at once), and each step
first polls the workers' pipes and sentinels, so it is reported the same way.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from configs import EngineConfig
from models.hf_config import ModelSpec
from models.hf_config import check_tensor_parallel_size
from models.parallel_state import push_all_reduce_timeouts, reset_tensor_parallel_group
from runner.distributed.comm import (PEER_LOSS_MARKERS, DistributedGroups, broadcast_message, destroy_groups, init_groups,
                                     recv_message, send_tensors, set_distributed_env, warm_up_communicators)
from runner.distributed.layers import split_layers
from runner.distributed.topology import Topology
from runner.distributed.worker import (ERROR, HELLO, OUTPUT, STEP, STOP, WorkerJob, run_external_worker, start_rank,
                                       worker_main)
from runner.executor import require_no_tensor_parallel_engine
from runner.outputs import ModelRunnerOutput, PendingOutput
from runner.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
"""How long shutdown waits for workers to exit after "stop" before it terminates them (generous: a
loaded machine can take seconds to tear down a process group and exit an interpreter)."""
FAILURE_GRACE_S = 5.0
"""After a communication error, how long rank 0 waits for a worker's report or death to explain it."""


class WorkerError(RuntimeError):
    """A worker process raised or died; the message names its rank, pipeline stage and TP rank
    (and has its traceback)."""


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when an external launcher such as torchrun started this
    process as part of a job of more than one process, else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world_size = int(env["WORLD_SIZE"])
    if world_size <= 1:
        return None
    rank = int(env["RANK"])
    return rank, world_size, int(env.get("LOCAL_RANK", rank))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class _SpawnedWorkers:
    """The worker processes rank 0 started: their pipes (worker -> rank 0) and sentinels."""

    def __init__(self, processes: dict, conns: dict, topology: Topology) -> None:
        self.processes, self.conns, self.topology = processes, conns, topology
        self.gone: list[int] = []
        """Ranks whose exit rank 0 has seen, in order (their pipes and sentinels stay ready)."""
        self.reports: dict[int, str] = {}

    def next_event(self, timeout: float | None) -> tuple[int, str, object] | None:
        """(rank, kind, payload) for the next message or exit; None after `timeout` seconds.
        kind: HELLO, OUTPUT (payload: ModelRunnerOutput), ERROR (payload: traceback text), "died"."""
        by_conn = {conn: rank for rank, conn in self.conns.items() if rank not in self.gone}
        by_sentinel = {proc.sentinel: rank for rank, proc in self.processes.items() if rank not in self.gone}
        ready = mp_connection.wait(list(by_conn) + list(by_sentinel), timeout)
        for obj in ready:  # messages first: a worker that reported an error has also exited
            if obj in by_conn:
                rank = by_conn[obj]
                try:
                    message = obj.recv()
                except (EOFError, OSError):
                    self.gone.append(rank)
                    return rank, "died", None
                if message[0] == ERROR:
                    self.reports[rank] = message[1]
                return rank, message[0], message[1] if len(message) > 1 else None
        for obj in ready:
            rank = by_sentinel[obj]
            self.gone.append(rank)
            return rank, "died", None
        return None

    def diagnose(self, settle_s: float = 0.5) -> WorkerError:
        """The clearest account of a failure seen so far. One death makes its neighbours fail
        too ("connection closed by peer"), so gather what arrives within `settle_s`, then prefer
        a rank that died without a word (killed, crashed), then a rank's own error, then a
        neighbour's connection error."""
        deadline = time.monotonic() + settle_s
        while len(self.gone) < len(self.processes):
            if self.next_event(max(0.0, deadline - time.monotonic())) is None:
                break
        silent = [rank for rank in self.gone if rank not in self.reports]
        if silent:
            proc = self.processes[silent[0]]
            proc.join(2.0)
            return WorkerError(f"worker {self.topology.describe(silent[0])} died: pid {proc.pid}, "
                               f"{_describe_exit(proc.exitcode)}")
        own = [rank for rank, text in self.reports.items() if not any(s in text for s in PEER_LOSS_MARKERS)]
        for rank in own or list(self.reports):
            return WorkerError(f"worker {self.topology.describe(rank)} failed:\n{self.reports[rank]}")
        raise AssertionError("diagnose() called with no failure seen")

    def failed(self) -> bool:
        return bool(self.gone or self.reports)

    def wait_for_hellos(self, timeout: float) -> None:
        waiting, deadline = set(self.processes), time.monotonic() + timeout
        while waiting:
            event = self.next_event(max(0.0, deadline - time.monotonic()))
            if event is None:
                raise WorkerError(f"worker rank(s) {sorted(waiting)} did not start within {timeout:.0f} s")
            if event[1] != HELLO:
                raise self.diagnose()
            waiting.discard(event[0])

    def explain(self, timeout: float) -> WorkerError | None:
        """A worker's error report or death within `timeout`, if any (why a collective failed)."""
        deadline = time.monotonic() + timeout
        while not self.failed():
            if self.next_event(max(0.0, deadline - time.monotonic())) is None:
                return None
        return self.diagnose()

    def stop(self, join_timeout: float) -> None:
        """Join, then terminate, then kill: no process is left behind."""
        deadline = time.monotonic() + join_timeout
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for rank, proc in self.processes.items():
            if proc.is_alive():
                if join_timeout:
                    logger.warning("worker rank %d did not exit in %.0f s; terminating it", rank, join_timeout)
                proc.terminate()
        for proc in self.processes.values():
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns.values():
            conn.close()

    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.processes.items()}


@dataclass
class _State:
    """What teardown needs; kept apart from the executor so a weakref finalizer can hold it."""
    groups: DistributedGroups | None = None
    workers: _SpawnedWorkers | None = None
    store: object = None
    failure: str | None = None
    release_graphs: Callable[[], None] | None = None
    """Rank 0's ModelRunner.release_cuda_graphs, run before its groups are destroyed."""
    closed: bool = False
    reply_pending: bool = False


def _teardown(state: _State) -> None:
    """Stop the workers ("stop" broadcast when healthy), destroy the groups, reap the processes.
    Idempotent; runs from shutdown(), a failure, garbage collection, or interpreter exit."""
    if state.closed:
        return
    state.closed = True
    for line in push_all_reduce_timeouts():   # a step that trapped: what rank 0's kernels waited for
        logger.error(line)
    graceful = state.failure is None and state.groups is not None
    if graceful:
        try:
            broadcast_message((STOP,), state.groups)
        except Exception as error:  # noqa: BLE001
            logger.warning("could not send 'stop' to the workers: %s", error)
            graceful = False
    if not graceful and state.workers is not None:
        state.workers.stop(0.0)  # before our sockets close, so survivors do not log a lost peer
    if graceful and state.release_graphs is not None:
        # Graphs holding NCCL collectives keep their communicators from being destroyed; the
        # workers release theirs on "stop" too. (After a failure a graph's collective may never
        # finish, so no synchronising then: the groups are aborted instead.)
        state.release_graphs()
        reset_tensor_parallel_group()  # drops the push all-reduce's buffers (and peers' mappings) before the groups
    state.release_graphs = None
    # On "stop" every rank destroys its groups at about the same time (NCCL teardown may be collective).
    destroy_groups(state.groups, abort=not graceful)
    state.groups = None
    reset_tensor_parallel_group()
    if graceful and state.workers is not None:
        state.workers.stop(JOIN_TIMEOUT_S)
    state.store = None


class DistributedExecutor:
    """Rank 0 of the world: holds stage 0's TP-rank-0 shard, broadcasts each step and its graph
    decision, returns the sampler rank's tokens. `model_runner` is rank 0's runner; `num_blocks`
    the agreed block count."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        parallel = config.parallel
        self.topology = Topology(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.world_size = self.topology.world_size
        self.layer_ranges = split_layers(spec.num_layers, self.topology.pp_size, parallel.pipeline_layer_split)
        check_tensor_parallel_size(spec, self.topology.tp_size)  # a shape error, before any process
        require_no_tensor_parallel_engine()
        launcher = torchrun_env()
        self.external_launcher = launcher is not None
        if launcher is not None and launcher[1] != self.world_size:
            raise ValueError(f"launched as {launcher[1]} processes (WORLD_SIZE) but tensor_parallel_size x "
                             f"pipeline_parallel_size is {self.topology.tp_size} x {self.topology.pp_size} = "
                             f"{self.world_size}; they must match")
        self.rank, local_rank = (launcher[0], launcher[2]) if launcher is not None else (0, 0)
        if device.type == "cuda":
            count = torch.cuda.device_count()
            needed = local_rank + 1 if launcher is not None else self.world_size
            if count < needed:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.topology.tp_size} x "
                                 f"{self.topology.pp_size} needs {needed} GPUs on this host (one per process); "
                                 f"torch sees {count}")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = config.parallel.pp_step_timeout_s   # seconds rank 0 waits for one step's reply; 0: no limit
        self.device, self.step_timeout_s = device, (timeout if timeout > 0 else None)
        self.model_runner = None
        self.num_blocks = 0
        self._state = _State()
        self._finalizer = weakref.finalize(self, _teardown, self._state)
        set_distributed_env()
        timeout_s = parallel.distributed_init_timeout_s
        backend = "nccl" if device.type == "cuda" else "gloo"
        args = (config, spec, model_path, device, dtype, max_model_len)
        stage = self.topology.stage(self.rank)
        try:
            if launcher is None:
                self._spawn_workers(config, spec, model_path, dtype, max_model_len, backend, timeout_s)
            else:
                self._state.groups = init_groups(backend, self.rank, self.topology, timeout_s)
            if self.rank > 0:
                run_external_worker(*args, self.layer_ranges[stage], self._state.groups)
            else:
                warm_up_communicators(device, dtype, self._state.groups)
                self.model_runner, self.num_blocks = start_rank(*args, self.layer_ranges[0], self._state.groups)
                self._state.release_graphs = self.model_runner.release_cuda_graphs
        except BaseException as error:
            self._fail(error, "start-up")
        if self.rank > 0:
            self._finalizer.detach()
            logger.info("%s: the driver shut down; exiting", self.topology.describe(self.rank))
            sys.exit(0)
        logger.info("distributed executor: %d ranks = tensor_parallel_size %d x pipeline_parallel_size %d (%s), "
                    "layers per stage %s, %d KV blocks", self.world_size, self.topology.tp_size,
                    self.topology.pp_size, "torchrun" if self.external_launcher else "spawned",
                    [len(r) for r in self.layer_ranges], self.num_blocks)

    def _spawn_workers(self, config, spec, model_path, dtype, max_model_len, backend, timeout_s) -> None:
        state = self._state
        timeout = datetime.timedelta(seconds=timeout_s)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process; spawned workers "
                               "need their own default group (use torchrun without init_process_group instead)")
        # Port 0: the store binds a free port itself (no window for another process to take it).
        state.store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, timeout=timeout,
                                    wait_for_workers=False)
        job = WorkerJob(config, spec, model_path, dtype, max_model_len, self.layer_ranges, self.topology,
                        self.device.type, state.store.port, os.getpid(), logging.getLogger().getEffectiveLevel())
        context = torch_mp.get_context("spawn")
        processes, conns = {}, {}
        state.workers = _SpawnedWorkers(processes, conns, self.topology)
        for rank in range(1, self.world_size):
            receive_end, send_end = context.Pipe(duplex=False)
            proc = context.Process(target=worker_main, args=(rank, job, send_end), name=f"graphrunner-rank-{rank}",
                                   daemon=True)
            proc.start()
            send_end.close()  # the worker holds the only write end: its death is EOF here
            processes[rank], conns[rank] = proc, receive_end
        state.workers.wait_for_hellos(timeout_s)
        state.groups = init_groups(backend, 0, self.topology, timeout_s, state.store)

    @property
    def failure(self) -> str | None:
        """Why the executor is down (a worker died or raised: every later step fails), else None."""
        return self._state.failure

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the spawned workers ({} under an external launcher)."""
        return self._state.workers.pids() if self._state.workers is not None else {}

    # ---- steps -------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        state = self._state
        if state.failure is not None:
            raise WorkerError(f"the distributed executor is down: {state.failure}")
        if state.closed:
            raise RuntimeError("the distributed executor was shut down")

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """Async scheduling (tensor parallelism, one pipeline stage): broadcast the step and its
        graph decision, launch rank 0's share and return without waiting. The workers launch
        theirs; rank 0 samples and its tokens reach their devices in the step's own broadcast
        (ModelRunner._launch_tensor_parallel_sampling), so no reply comes back to wait for."""
        self._check_usable()
        state = self._state
        try:
            if state.workers is not None:
                self._check_workers()  # no reply to wait on: a worker's death shows up here
            decision = self.model_runner.dispatch(sched) if sched.scheduled else None
            broadcast_message((STEP, sched, decision), state.groups)
            return self.model_runner.execute_async(sched, decision)
        except BaseException as error:
            self._fail(error, "step")

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._check_usable()
        state = self._state
        samples_here = self.topology.sampler_rank == 0
        try:
            if state.reply_pending:  # the last execute was interrupted while waiting: claim its reply
                self._wait_reply()
                state.reply_pending = False
            if samples_here and state.workers is not None:
                self._check_workers()  # no reply to wait on: a worker's death shows up here
            if not sched.scheduled:
                broadcast_message((STEP, sched, None), state.groups)
                return self.model_runner.execute(sched)  # drops per-request state; no tensors move
            decision = self.model_runner.dispatch(sched)  # decided once, replayed by every rank
            broadcast_message((STEP, sched, decision), state.groups)
            padded = self.model_runner.padded_num_tokens(sched, decision)
            output = self.model_runner.execute(sched, decision)
            if samples_here:
                return output
            send_tensors(output, padded, self.topology.next_rank(0), state.groups)
        except BaseException as error:
            self._fail(error, "step")
        try:
            return self._wait_reply()
        except KeyboardInterrupt:
            state.reply_pending = True  # the workers finish the step; the next execute takes its reply
            raise
        except BaseException as error:
            self._fail(error, "step")

    def _check_workers(self) -> None:
        """Raise the clearest WorkerError if a worker has reported an error or exited (no wait)."""
        error = self._state.workers.explain(0.0)
        if error is not None:
            raise error

    def _wait_reply(self) -> ModelRunnerOutput:
        sampler = self.topology.sampler_rank
        state = self._state
        if state.workers is None:  # external launcher: gloo, no timeout (torchrun watches the ranks)
            kind, payload = recv_message(sampler, state.groups)
            if kind == ERROR:
                raise WorkerError(f"worker {self.topology.describe(sampler)} failed:\n{payload}")
            return payload
        deadline = None if self.step_timeout_s is None else time.monotonic() + self.step_timeout_s
        event = state.workers.next_event(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if event is None:
            raise WorkerError(f"step timed out: no reply from {self.topology.describe(sampler)} within "
                              f"{self.step_timeout_s:.0f} s (ParallelConfig.pp_step_timeout_s)")
        if event[1] == OUTPUT and event[0] == sampler:
            return event[2]
        raise state.workers.diagnose()

    # ---- failure and shutdown ----------------------------------------------------------------
    def _fail(self, error: BaseException, during: str):
        """Record the failure, tear the workers down, raise the clearest error: a worker's own
        report or death if there is one (a gloo error on rank 0 usually means a peer died)."""
        state = self._state
        for line in push_all_reduce_timeouts():
            error.add_note(line)
        report = error if isinstance(error, WorkerError) else None
        if report is None and state.workers is not None and not isinstance(error, KeyboardInterrupt):
            report = state.workers.explain(FAILURE_GRACE_S if isinstance(error, RuntimeError) else 0.0)
        state.failure = str(report if report is not None else f"{during} failed on rank {self.rank}: {error!r}")
        self._finalizer()
        if report is None or report is error:
            raise error
        raise report from error

    def shutdown(self) -> None:
        """Stop and reap the workers, destroy the process groups and forget the TP group; safe to
        call twice."""
        self._finalizer()
