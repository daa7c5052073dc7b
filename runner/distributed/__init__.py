"""Pipeline parallel: each rank holds a contiguous slice of layers (docs/PIPELINE.md).

layers.py   split_layers: which layers each rank holds (even split or pipeline_layer_split)
comm.py     process groups, the step broadcast, tensor send/recv, the block-count agreement
worker.py   ranks 1..N-1: start a stage and serve steps (spawned process or torchrun rank)
executor.py PipelineExecutor: rank 0, what LLMEngine uses when pipeline_parallel_size > 1

Nothing is imported eagerly: a spawned worker imports only what it runs.
"""

__all__ = ["PipelineExecutor", "PipelineWorkerError", "split_layers"]


def __getattr__(name: str):
    if name in ("PipelineExecutor", "PipelineWorkerError"):
        from runner.pipeline import executor
        return getattr(executor, name)
    if name == "split_layers":
        from runner.pipeline.layers import split_layers
        return split_layers
    raise AttributeError(f"module 'runner.pipeline' has no attribute {name!r}")
