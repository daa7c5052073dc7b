"""Engine, scheduler, KV-cache manager, model runner, sampler, CUDA graphs, tensor and pipeline parallel, CLI.

`SamplingParams` and `RequestOutputKind` live in configs and are re-exported here, as vLLM exports
them beside `LLM`.
"""

from configs import RequestOutputKind, SamplingParams
from runner.engine import LLMEngine
from runner.llm import LLM
from runner.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Logprob"]
