"""A trace of what each process of a tensor-parallel engine does around the push all-reduce, for
scripts/tp_soak.sh (TP_SOAK_TRACE=1): with this folder first on PYTHONPATH and PUSH_TRACE_PREFIX set,
every Python process writes PREFIX-PID.txt, one line per event, flushed as it happens:
- the start-up phases (load, the compile-ahead queue pass, profile run, graph reserve, captures)
  and each engine step;
- every push all-reduce call (`AR shape`), every GEMV that all-reduces its own output (`GAR`) and
  every other collective of the TP group, each with whether the stream is capturing (`cap`) and
  whether launches only queue compiles (`q`): a call with cap 0 and q 0 runs a kernel that counts;
- each CUDA graph the wrappers capture or replay;
- a push kernel's timeout record as soon as it is written (read from pinned host memory, so it
  survives the trap);
- at set-up, the caching allocator's blocks under the push kernels' buffer, counters and tickets
  (each must be one block of its own);
- a snapshot when the main thread has waited in `torch.cuda.synchronize` for STALL_S seconds
  (PUSH_TRACE_STALL_S, default 8): those blocks again, the push kernels' call counters, the GEMVs'
  tickets, and the tags of the words in every slot of this rank's buffer and in this rank's slots
  of each peer's, copied on a stream of their own, so the copies do not wait for the stalled
  kernels.
Comparing the ranks' files shows whether their calls diverged on the host (the sequences differ)
or on the GPU (same sequences, different counts or tags). PUSH_TRACE_TIMEOUT_S shortens the push
kernels' peer timeout (a caller's shorter one stays), so a stall ends in seconds.

Python runs sitecustomize at start-up; the modules are patched as they are imported (a meta-path
finder wraps their loaders), so a name another module imports from them is the traced one."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time

PREFIX = os.environ.get("PUSH_TRACE_PREFIX")
STALL_S = float(os.environ.get("PUSH_TRACE_STALL_S", "8"))
SNAPSHOT_LANES = ((0, 1024), (1024, 2048), (2048, 4096))
"""Lane ranges whose tags a snapshot reports per slot (a push kernel's program 0, 1, 2-3)."""

_lock = threading.Lock()
_file = None
_seq = 0
_start = time.monotonic()
_pushes: list = []
_sync = {"since": None, "snapped": None}
"""When the main thread's current torch.cuda.synchronize began (None: not in one), and the start of
the last one snapshotted."""


def log(*parts) -> None:
    """One line: sequence number, seconds since start-up, thread, the parts."""
    global _file, _seq
    if PREFIX is None:
        return
    with _lock:
        if _file is None:
            _file = open(f"{PREFIX}-{os.getpid()}.txt", "a", buffering=1)
            _file.write(f"# pid {os.getpid()}\n")
        _seq += 1
        _file.write(f"{_seq} {time.monotonic() - _start:.3f} {threading.current_thread().name[:16]} "
                    + " ".join(str(p) for p in parts) + "\n")


def _capturing() -> int:
    import torch
    try:
        return int(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return -1


def _queuing() -> int:
    from launch.compile_ahead import compiling_ahead
    return int(compiling_ahead())


def _where() -> str:
    return f"cap {_capturing()} q {_queuing()}"


def _phase(name: str, fn):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        log("enter", name)
        try:
            return fn(*args, **kwargs)
        except BaseException as error:
            log("raise", name, type(error).__name__, str(error)[:200].replace("\n", " | "))
            raise
        finally:
            log("leave", name)
    return traced


# ---- the stall snapshot -------------------------------------------------------------------------
def prepare_snapshot(push) -> None:
    """Pinned host buffers and a stream for `snapshot`, made now: allocating pinned memory while a
    kernel stalls could wait for it."""
    import torch
    words = push.buffer.numel() * push.buffer.element_size() // 8
    cuda = push.buffer.device.type == "cuda"
    push.trace_snapshot = dict(
        stream=torch.cuda.Stream(push.buffer.device) if cuda else None,
        buffers=[torch.empty(words, dtype=torch.int64, pin_memory=cuda) for _ in push.buffers],
        counters=torch.empty(push.counters.numel(), dtype=torch.int64, pin_memory=cuda),
        tickets=torch.empty(push.tickets.numel(), dtype=torch.int64, pin_memory=cuda))


def slot_tags(words, world: int, max_bytes: int, sources) -> list[str]:
    """For each region (0: the all-reduce kernel's, 1: the GEMVs'), parity and source rank in
    `sources`: the lowest and highest tag in each of SNAPSHOT_LANES within the slot
    (models/push_all_reduce.py's layout: int64 words [region][parity][rank][max_bytes // 4])."""
    slot = max_bytes // 4
    lines = []
    for region in (0, 1):
        for parity in (0, 1):
            for source in sources:
                base = (region * 2 + parity) * world * slot + source * slot
                for lo, hi in SNAPSHOT_LANES:
                    hi = min(hi, slot)
                    if lo >= hi:
                        continue
                    tags = (words[base + lo: base + hi] >> 32) & 0xFFFFFFFF
                    lines.append(f"region {region} parity {parity} from rank {source} lanes {lo}:{hi} tags "
                                 f"{int(tags.min())}..{int(tags.max())}")
    return lines


def blocks_at(segments: list[dict], start: int, end: int) -> list[str]:
    """The caching allocator's blocks (torch.cuda.memory_snapshot()'s segments) that overlap
    [start, end), each with its segment: whether memory the push kernels use is also handed out
    for something else (it must not be: their buffers and counters are one block each)."""
    found = []
    for segment in segments:
        address = segment["address"]
        if address >= end or address + segment["total_size"] <= start:
            continue
        offset = address
        for block in segment.get("blocks", []):
            block_start = block.get("address", offset)
            offset = block_start + block["size"]
            if block_start < end and offset > start:
                found.append(f"block {block_start:#x}+{block['size']} {block['state']} in {segment.get('segment_type')} "
                             f"segment {address:#x}+{segment['total_size']}"
                             f"{' (expandable)' if segment.get('is_expandable') else ''}")
    return found


def log_blocks(push, when: str) -> None:
    """Log the allocator's blocks under the push kernels' own buffer, counters and tickets."""
    import torch
    if push.buffer.device.type != "cuda":
        return
    segments = torch.cuda.memory_snapshot()
    for name, tensor in (("own buffer", push.buffer), ("counters", push.counters), ("tickets", push.tickets)):
        start = tensor.data_ptr()
        for line in blocks_at(segments, start, start + tensor.numel() * tensor.element_size()):
            log(when, "rank", push.rank, name, f"{start:#x}:", line)


def snapshot(push) -> None:
    """Log `push`'s counters, tickets and slot tags (`slot_tags`): of its own buffer, the slots its
    peers write; of each peer's buffer, the slots this rank writes."""
    import torch
    taken = push.trace_snapshot
    stream = taken["stream"]
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        taken["counters"].copy_(push.counters, non_blocking=True)
        taken["tickets"].copy_(push.tickets, non_blocking=True)
        for buffer, host in zip(push.buffers, taken["buffers"]):
            host.copy_(buffer.view(torch.int64), non_blocking=True)
    if stream is not None:
        stream.synchronize()
    log("SNAPSHOT rank", push.rank, "counters", taken["counters"].tolist())
    log("SNAPSHOT rank", push.rank, "tickets", taken["tickets"].tolist())
    for rank, words in enumerate(taken["buffers"]):
        mine = rank == push.rank
        sources = [r for r in range(push.world) if r != push.rank] if mine else [push.rank]
        for line in slot_tags(words, push.world, push.max_bytes, sources):
            log("SNAPSHOT rank", push.rank, "own buffer" if mine else f"rank {rank}'s buffer", line)
    log_blocks(push, "SNAPSHOT")


def _watch() -> None:
    """Every second: log new timeout-record lines; snapshot once in each synchronize that has lasted
    STALL_S."""
    seen = set()
    while True:
        time.sleep(1.0)
        since = _sync["since"]
        if since is not None and _sync["snapped"] != since and time.monotonic() - since > STALL_S:
            _sync["snapped"] = since   # once per stalled synchronize
            log("STALL: in torch.cuda.synchronize for", round(time.monotonic() - since, 1), "s")
            for push in [p for p in _pushes if p.trace_snapshot is not None]:
                try:
                    snapshot(push)
                except Exception as error:  # noqa: BLE001 - a diagnostic: say so and go on
                    log("snapshot failed:", repr(error))
        for push in list(_pushes):
            for line in push.timeouts():
                if line not in seen:
                    seen.add(line)
                    log("TIMEOUT RECORD", line)


# ---- the patches, one per module ----------------------------------------------------------------
def _patch_push_all_reduce(module) -> None:
    cls = module.PushAllReduce
    init, all_reduce_ = cls.__init__, cls.all_reduce_

    @functools.wraps(init)
    def __init__(self, buffers, rank, max_bytes, *args, **kwargs):
        timeout = os.environ.get("PUSH_TRACE_TIMEOUT_S")
        given = kwargs.get("peer_timeout_s")
        if timeout and (given is None or given > float(timeout)):
            kwargs["peer_timeout_s"] = float(timeout)
        init(self, buffers, rank, max_bytes, *args, **kwargs)
        log("push all-reduce set up: rank", rank, "of", len(buffers), "peer timeout", self.timeout_ns / 1e9, "s")
        try:
            log("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
            log_blocks(self, "SET UP")
            prepare_snapshot(self)
        except Exception as error:  # noqa: BLE001 - a diagnostic must not stop the engine
            self.trace_snapshot = None
            log("no stall snapshot:", repr(error))
        _pushes.append(self)
        if len(_pushes) == 1:
            threading.Thread(target=_watch, name="push-trace", daemon=True).start()

    @functools.wraps(all_reduce_)
    def traced_all_reduce_(self, x):
        log("AR", tuple(x.shape), _where())
        return all_reduce_(self, x)

    cls.__init__, cls.all_reduce_ = __init__, traced_all_reduce_


def _patch_small_batch_kernels(module) -> None:
    linear_all_reduce = module.linear_all_reduce

    @functools.wraps(linear_all_reduce)
    def traced(x, weight, push):
        out = linear_all_reduce(x, weight, push)
        if out is not None:
            log("GAR", tuple(x.shape), tuple(weight.shape), _where())
        return out
    module.linear_all_reduce = traced


def _patch_parallel_state(module) -> None:
    for name in ("tensor_parallel_all_gather", "tensor_parallel_broadcast", "tensor_parallel_all_reduce"):
        def traced_collective(fn, name=name):
            @functools.wraps(fn)
            def traced(x, *args, **kwargs):
                group = module.tensor_parallel_group()
                pushed = name == "tensor_parallel_all_reduce" and group.push is not None and group.push.usable(x)
                if group.size > 1 and not pushed:   # a pushed all-reduce logs itself (AR)
                    log("collective", name, tuple(x.shape), _where())
                return fn(x, *args, **kwargs)
            return traced
        setattr(module, name, traced_collective(getattr(module, name)))


def _patch_wrapper(module) -> None:
    cls = module.CUDAGraphWrapper
    call, capture = cls.__call__, cls._capture

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        context = module.get_forward_context()
        desc = context.batch_descriptor
        if context.runtime_mode == self.runtime_mode and desc is not None:
            log("graph", self.runtime_mode.name, desc, "replay" if desc in self._entries else "capture")
        return call(self, *args, **kwargs)

    @functools.wraps(capture)
    def _capture(self, context, args, kwargs):
        warm_ups = self.warm_ups
        graph = capture(self, context, args, kwargs)
        log("captured", self.runtime_mode.name, context.batch_descriptor, "warm-ups", self.warm_ups - warm_ups)
        return graph

    cls.__call__, cls._capture = __call__, _capture


def _patch_graph_start_up(module) -> None:
    for name in ("_run_start_up_batches", "measure_graph_reserve", "capture_cudagraphs"):
        setattr(module.GraphStartUp, name, _phase(name, getattr(module.GraphStartUp, name)))


def _patch_model_runner(module) -> None:
    cls = module.ModelRunner
    for name in ("load_model", "profile_run", "initialize_kv_cache", "disable_cudagraphs"):
        setattr(cls, name, _phase(name, getattr(cls, name)))
    execute = cls.execute

    @functools.wraps(execute)
    def traced_execute(self, sched, *args, **kwargs):
        log("step", sched.num_scheduled_tokens, "tokens,", len(sched.scheduled), "requests")
        return execute(self, sched, *args, **kwargs)
    cls.execute = traced_execute


def _patch_executor(module) -> None:
    start = _phase("start_model_runner", module.start_model_runner)

    @functools.wraps(start)
    def traced(runner, *args, **kwargs):
        log("runner: tp rank", runner.tp_rank, "graph mode", runner.cudagraph_mode.name)
        return start(runner, *args, **kwargs)
    module.start_model_runner = traced


def _patch_comm(module) -> None:
    for name in ("init_groups", "push_all_reduce", "destroy_groups"):
        setattr(module, name, _phase(name, getattr(module, name)))


def _patch_torch_cuda(module) -> None:
    synchronize = module.synchronize

    @functools.wraps(synchronize)
    def traced(*args, **kwargs):
        _sync["since"] = time.monotonic()
        try:
            return synchronize(*args, **kwargs)
        finally:
            _sync["since"] = None
    module.synchronize = traced


PATCHES = {"torch.cuda": _patch_torch_cuda, "models.push_all_reduce": _patch_push_all_reduce,
           "models.small_batch_kernels": _patch_small_batch_kernels, "models.parallel_state": _patch_parallel_state,
           "runner.cudagraph.wrapper": _patch_wrapper, "runner.graph_start_up": _patch_graph_start_up,
           "runner.model_runner": _patch_model_runner, "runner.executor": _patch_executor,
           "runner.distributed.comm": _patch_comm}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        try:
            PATCHES[self.name](module)
            log("traced", self.name)
        except Exception as error:  # noqa: BLE001 - a diagnostic must not stop the program
            log("could not trace", self.name, repr(error))


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, name)
        return spec


if PREFIX is not None:
    sys.meta_path.insert(0, _PatchingFinder())
