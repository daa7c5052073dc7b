"""Engine, scheduler, KV-cache manager, model runner, sampler, CUDA graphs, pipeline parallel, CLI.

`LLM`, `LLMEngine` and the output types are imported lazily: attention layers import
`runner.cudagraph`, and an eager import here would make that a cycle. `SamplingParams` and
`RequestOutputKind` live in configs and are re-exported here, as vLLM exports them beside `LLM`.
"""

from configs import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Logprob"]


def __getattr__(name: str):
    if name == "LLM":
        from runner.llm import LLM
        return LLM
    if name == "LLMEngine":
        from runner.engine import LLMEngine
        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from runner import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
