"""Pydantic configuration models and enums; the only place defaults and switches live, and the only
place environment variables are read (configs/env.py, when a config is built)."""

from configs.engine_config import (CacheConfig, CompilationConfig, EngineConfig, ModelConfig,
                                   ParallelConfig, SchedulerConfig)
from configs.graph_mode import CUDAGraphMode
from configs.kernel_config import KernelConfig, active_kernel_config, set_active_kernel_config, using_kernel_config
from configs.sampling_params import RequestOutputKind, SamplingParams
from configs.server_config import ServerConfig
from configs.structured_outputs import StructuredOutputsParams

__all__ = ["CUDAGraphMode", "CacheConfig", "CompilationConfig", "EngineConfig", "KernelConfig", "ModelConfig",
           "ParallelConfig", "RequestOutputKind", "SamplingParams", "SchedulerConfig", "ServerConfig",
           "StructuredOutputsParams", "active_kernel_config", "set_active_kernel_config", "using_kernel_config"]
