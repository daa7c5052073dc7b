"""Executors run the model runner(s) for the engine: one process here, several in runner/distributed/."""

from __future__ import annotations

import logging

import torch

from configs import EngineConfig
from models.hf_config import ModelSpec
from models.parallel_state import tensor_parallel_group
from runner.cudagraph.consensus import agree_graph_plan, agree_ready
from runner.model_runner import ModelRunner
from runner.outputs import ModelRunnerOutput, PendingOutput
from runner.platform import num_kv_blocks
from runner.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def start_model_runner(runner: ModelRunner, config: EngineConfig, agreement=None) -> int:
    """The warm-up contract, steps 1-4: load, profile without a KV cache, measure the graph
    reserve, size and allocate the cache, capture; all but the load with their Triton kernels
    compiled ahead, in parallel (`kernels_compiled_ahead`), unless every rank's kernel cache holds
    them from an earlier start-up of the same configuration (runner/start_up_record.py), which
    also recorded the graph reserve then measured. cuBLAS's first call of each GEMM shape the
    captures will run is made on a helper thread from the load to the end of the profile run
    (runner/gemm_warm_up.py).
    `agreement` (runner/distributed/comm.py Agreement: `min(int)` and `gather(obj)` over every rank;
    None for one process) makes the ranks of a multi-process engine agree on the graph plan before
    the load, on skipping the compile-ahead pass and the reserve's measurement, on the block count
    (every rank allocates the smallest) and on graph readiness (runner/cudagraph/consensus.py).
    Returns the block count."""
    if agreement is not None:
        mode, sizes = agree_graph_plan(agreement.gather(runner.graph_plan()))
        runner.adopt_graph_plan(mode, sizes)
    times = runner.start_up_times
    with times.phase("load"):
        runner.load_model()
    gemms = runner.start_gemm_warm_up()   # cuBLAS's first calls on a helper thread until the first capture
    earlier = runner.earlier_start_up()
    cached = earlier is not None
    if agreement is not None:   # the queue pass and the reserve's captures run collectives: all ranks or none
        cached = agreement.min(int(cached)) == 1
    with runner.kernels_compiled_ahead(queue=not cached):
        with times.phase("profile"):
            try:
                peak = runner.profile_run()
            finally:
                gemms.wait()
            reserve = runner.measure_graph_reserve(earlier.graph_reserve_bytes if cached else None)
        with times.phase("kv_cache"):
            blocks = num_kv_blocks(config, runner.kv_cache_bytes_per_block(), runner.device, peak, reserve,
                                   runner.max_model_len)
            if agreement is not None:
                blocks = agreement.min(blocks)
            runner.initialize_kv_cache(blocks)
        with times.phase("capture"):
            runner.capture_cudagraphs()
    times.add("compile", runner.precompile_seconds + runner.compile_wait_seconds)
    if agreement is not None and not agree_ready(runner.cuda_graph_ready, agreement.min):
        runner.disable_cudagraphs()
    runner.record_start_up()
    return blocks


def require_no_tensor_parallel_engine() -> None:
    """The tensor-parallel group is process-wide (models/parallel_state.py): while a tensor-parallel
    engine is alive in this process, another engine built here would read its group."""
    group = tensor_parallel_group()
    if group.size > 1:
        raise RuntimeError(f"a tensor-parallel engine (tensor_parallel_size={group.size}) is alive in this process; "
                           "shut it down (LLM.shutdown()) before starting another engine here")


class UniProcExecutor:
    """The whole model in this process."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        require_no_tensor_parallel_engine()
        self.model_runner = ModelRunner(config, spec, model_path, device, dtype, max_model_len)
        self.num_blocks = start_model_runner(self.model_runner, config)

        self.shut_down = False

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute(sched)

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """Launch the step and return at once (async scheduling); `.resolve()` gives its tokens."""
        return self.model_runner.execute_async(sched)

    def shutdown(self) -> None:
        """Give back the device memory the engine holds for its steps (graphs, KV cache), so that a
        later engine in this process, or another process on the GPU, can have it: without this a
        finished `with LLM(...)` block kept its KV cache (most of `gpu_memory_utilization`) until
        the process ended. The weights go with the LLM object."""
        if not self.shut_down:
            self.shut_down = True
            self.model_runner.release_step_memory()
