"""Executors run the model runner(s) for the engine: one process, or a pipeline of them."""

from __future__ import annotations

import logging

import torch

from configs import EngineConfig
from models.hf_config import ModelSpec
from runner.model_runner import ModelRunner
from runner.outputs import ModelRunnerOutput, PendingOutput
from runner.platform import num_kv_blocks
from runner.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def start_model_runner(runner: ModelRunner, config: EngineConfig, agree=min) -> int:
    """The warm-up contract, steps 1-4: load, profile without a KV cache, measure the graph
    reserve, size and allocate the cache, capture; all but the load with their Triton kernels
    compiled ahead, in parallel (`kernels_compiled_ahead`). `agree` reduces the block count
    across pipeline ranks (every rank must allocate the same number). Returns the block count."""
    times = runner.start_up_times
    with times.phase("load"):
        runner.load_model()
    with runner.kernels_compiled_ahead():
        with times.phase("profile"):
            peak = runner.profile_run()
            reserve = runner.measure_graph_reserve()
        with times.phase("kv_cache"):
            blocks = num_kv_blocks(config, runner.kv_cache_bytes_per_block(), runner.device, peak, reserve,
                                   runner.max_model_len)
            blocks = agree(blocks)
            runner.initialize_kv_cache(blocks)
        with times.phase("capture"):
            runner.capture_cudagraphs()
    times.add("compile", runner.precompile_seconds + runner.compile_wait_seconds)
    return blocks


class UniProcExecutor:
    """The whole model in this process."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model_path: str, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        self.model_runner = ModelRunner(config, spec, model_path, device, dtype, max_model_len)
        self.num_blocks = start_model_runner(self.model_runner, config, agree=lambda n: n)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute(sched)

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """Launch the step and return at once (async scheduling); `.resolve()` gives its tokens."""
        return self.model_runner.execute_async(sched)

    def shutdown(self) -> None:
        """Nothing to release: the model lives in this process and goes with it."""
