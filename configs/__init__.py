"""Pydantic configuration models and enums; the only place defaults live."""

from configs.engine_config import (CacheConfig, CompilationConfig, EngineConfig, ModelConfig,
                                   ParallelConfig, SchedulerConfig)
from configs.graph_mode import CUDAGraphMode
from configs.sampling_params import RequestOutputKind, SamplingParams
from configs.structured_outputs import StructuredOutputsParams

__all__ = ["CUDAGraphMode", "CacheConfig", "CompilationConfig", "EngineConfig", "ModelConfig",
           "ParallelConfig", "RequestOutputKind", "SamplingParams", "SchedulerConfig",
           "StructuredOutputsParams"]
