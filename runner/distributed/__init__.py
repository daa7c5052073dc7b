"""Multi-process engines: tensor parallel x pipeline parallel over torch.distributed (docs/PARALLEL.md).

topology.py Topology: the rank layout (global rank = pp_stage * tp_size + tp_rank)
layers.py   split_layers: which layers each pipeline stage holds (even split or pipeline_layer_split)
comm.py     process groups (world, TP per stage, control, objects), the step broadcast, tensor
            send/recv, the start-up agreements (block count, graph plan)
worker.py   ranks 1..N-1: start a rank and serve steps (spawned process or torchrun rank)
executor.py DistributedExecutor: rank 0, what LLMEngine uses when tensor_parallel_size x
            pipeline_parallel_size > 1

Nothing is imported eagerly: a spawned worker imports only what it runs.
"""

__all__ = ["DistributedExecutor", "Topology", "WorkerError", "split_layers"]


def __getattr__(name: str):
    if name in ("DistributedExecutor", "WorkerError"):
        from runner.distributed import executor
        return getattr(executor, name)
    if name == "split_layers":
        from runner.distributed.layers import split_layers
        return split_layers
    if name == "Topology":
        from runner.distributed.topology import Topology
        return Topology
    raise AttributeError(f"module 'runner.distributed' has no attribute {name!r}")
