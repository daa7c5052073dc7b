"""Engine, scheduler, KV-cache manager, model runner, sampler, CUDA graphs, pipeline parallel, CLI.

`LLM` and `LLMEngine` are imported lazily: attention layers import `runner.cudagraph`,
and an eager import here would make that a cycle.
"""

__all__ = ["LLM", "LLMEngine"]


def __getattr__(name: str):
    if name == "LLM":
        from runner.llm import LLM
        return LLM
    if name == "LLMEngine":
        from runner.engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
