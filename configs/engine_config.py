"""Engine configuration: the one home of every default.

`EngineConfig.from_kwargs(model=..., **kwargs)` takes the flat keyword arguments a user
passes to `LLM(...)` and routes each to the sub-config that owns it, so a misspelt
option fails loudly with the list of known ones. A whole sub-config may be passed as one
argument too (`kernel_config={"pdl": False}`, `compilation_config=CompilationConfig(...)`).

Fields whose default an environment variable may set read it here, when the config is built
(configs/env.py is the only reader; the table is configs.env.ENV_FIELDS).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from configs.env import env_default
from configs.graph_mode import CUDAGraphMode
from configs.kernel_config import KernelConfig


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True,
                              protected_namespaces=())


class ModelConfig(_Config):
    model: str = Field(..., description="HF checkpoint folder, or 'default' for the embedded SmolLM2")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, ge=1)
    load_format: Literal["auto", "dummy"] = "auto"
    check_finite_weights: bool = True
    """Fail at load when a checkpoint tensor holds NaN or Inf, naming it (a damaged file would
    otherwise produce garbage text). Costs one sum per tensor; False skips it."""
    tokenizer: str | None = None
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """auto: triton on CUDA, torch on a CPU."""
    download_dir: str = Field(
        default_factory=env_default("GRAPHRUNNER_HOME", "ModelConfig.download_dir",
                                    lambda: str(Path.home() / ".cache" / "graphrunner"), str),
        description="where model='default' builds the embedded SmolLM2 checkpoint [GRAPHRUNNER_HOME]")

    @field_validator("model", "tokenizer", mode="before")
    @classmethod
    def _path_to_str(cls, value: Any) -> Any:
        """A pathlib.Path (any os.PathLike) names a folder as well as a string does."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value


KV_CACHE_MEMORY_CAP = 4 << 30
"""The most bytes the CPU KV-cache default takes (4 GiB): max_num_seqs sequences of max_model_len tokens
can ask for far more (256 x 8192 tokens of SmolLM2 in fp32: 90 GiB). Less where the machine has less:
the default is also at most a quarter of the memory available when the engine starts."""


class CacheConfig(_Config):
    block_size: int = Field(16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory: ByteSize | None = Field(
        None, ge=1, description="KV cache bytes on a CPU, a number or with a unit (2GiB, 512MB); None: what "
                                "max_num_seqs sequences of max_model_len tokens can use, at most 4 GiB and a "
                                "quarter of available memory (CacheConfig.default_kv_cache_blocks)")
    num_kv_blocks: int | None = Field(None, ge=1, description="override the computed block count")
    enable_prefix_caching: bool = True

    def default_kv_cache_blocks(self, bytes_per_block: int, max_model_len: int, max_num_seqs: int,
                                available_bytes: int) -> int:
        """The CPU KV cache's block count when `kv_cache_memory` is not given: enough for `max_num_seqs`
        sequences of `max_model_len` tokens each (what the scheduler can ever hold at once), capped at
        KV_CACHE_MEMORY_CAP and at a quarter of `available_bytes`; at least one sequence's worth
        when the caps leave less (the engine could not run a full-length request otherwise).
        Why not a share of RAM: a laptop running one prompt would reserve gigabytes it never uses."""
        per_seq = -(-max_model_len // self.block_size)
        cap = min(KV_CACHE_MEMORY_CAP, available_bytes // 4) // bytes_per_block
        return max(1, min(per_seq * max_num_seqs, max(cap, per_seq)))

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two, got {value}")
        return value


class SchedulerConfig(_Config):
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = Field(None, ge=1)
    """While other requests run, a prompt's chunk takes at most this many tokens of a step, and
    leaves one token of the budget to each running request scheduled after it, so a long prompt
    neither starves the decodes nor stretches their step (a 2048-token chunk of a 1B model at 32k
    context is a ~30 ms step, a full 8192-token one four times that). Alone, a prompt takes the
    whole budget. None: a quarter of max_num_batched_tokens (2048 by default), at least 512."""
    async_scheduling: bool | None = None
    """Launch step n+1 before waiting for step n's sampled tokens, so the engine's host work
    (scheduling, input preparation, the scheduler update, detokenization) overlaps the GPU.
    None (auto): on for a CUDA device without pipeline parallelism (one process, or a tensor-parallel
    group whose rank 0 samples and broadcasts its tokens to the other ranks' devices), off on a CPU
    and under pipeline parallelism. True forces it on any device (CPU tests use it); it cannot be
    combined with pipeline_parallel_size > 1."""

    @property
    def long_prefill_tokens(self) -> int:
        """`long_prefill_token_threshold`, or its default for this budget."""
        budget = self.max_num_batched_tokens
        return self.long_prefill_token_threshold or min(budget, max(budget // 4, 512))


class CompilationConfig(_Config):
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int = Field(512, ge=1)
    check_cudagraph_addresses: bool = True
    """Compare each captured graph's input addresses with its capture's on its FIRST replay
    (once per graph: serving pays nothing afterwards) and raise AddressMismatchError, naming
    the tensors that moved, instead of letting the graph read stale memory."""
    debug_cudagraph_addresses: bool = Field(
        default_factory=env_default("GRAPHRUNNER_DEBUG_CUDAGRAPH", "CompilationConfig.debug_cudagraph_addresses",
                                    False),
        description="check at every graph replay that each captured tensor is still at its address "
                    "[GRAPHRUNNER_DEBUG_CUDAGRAPH]")
    step_graph: bool = Field(
        default_factory=env_default("GRAPHRUNNER_STEP_GRAPH", "CompilationConfig.step_graph", True),
        description="replay a PIECEWISE graph as one CUDA graph with the attention as kernel nodes; off: "
                    "segment by segment from Python [GRAPHRUNNER_STEP_GRAPH]")
    warm_up_every_capture: bool | None = Field(
        default_factory=env_default("GRAPHRUNNER_WARM_UP_EVERY_CAPTURE", "CompilationConfig.warm_up_every_capture",
                                    None, bool),
        description="run each graph's forward eagerly before capturing it; off: only the largest graph of each "
                    "kind of batch does, and later captures run in CUDA's relaxed capture mode, where a kernel "
                    "variant loads inside the capture (runner/cudagraph/wrapper.py); None (auto): off on one "
                    "device, on under tensor or pipeline parallelism, where captures without a warm-up have not "
                    "been checked on GPUs [GRAPHRUNNER_WARM_UP_EVERY_CAPTURE]")
    compile_threads: int | None = Field(
        default_factory=env_default("GRAPHRUNNER_COMPILE_THREADS", "CompilationConfig.compile_threads", None, int),
        ge=0, description="threads that compile the start-up's Triton kernels ahead of their first launch; "
                          "None: one per CPU up to 16; 0: each compiles at its first launch "
                          "[GRAPHRUNNER_COMPILE_THREADS]")
    gemm_warm_up: bool = Field(
        default_factory=env_default("GRAPHRUNNER_GEMM_WARM_UP", "CompilationConfig.gemm_warm_up", True),
        description="make cuBLAS's first call of each GEMM shape the graph captures will run on a helper thread "
                    "while the profile run holds the main one (runner/gemm_warm_up.py); off: each capture pays "
                    "its shapes' first calls [GRAPHRUNNER_GEMM_WARM_UP]")

    def warms_up_every_capture(self, world_size: int) -> bool:
        """`warm_up_every_capture`, its auto value resolved for this many ranks."""
        return self.warm_up_every_capture if self.warm_up_every_capture is not None else world_size > 1

    @field_validator("cudagraph_mode", mode="before")
    @classmethod
    def _mode_by_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return CUDAGraphMode[value.upper()]
            except KeyError:
                raise ValueError(
                    f"unknown cudagraph_mode {value!r}; allowed: {[m.name for m in CUDAGraphMode]}") from None
        return value

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value or any(s < 1 for s in value):
                raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {value}")
            value = sorted(set(value))
        return value


class ParallelConfig(_Config):
    """World = tensor_parallel_size x pipeline_parallel_size processes (docs/PARALLEL.md)."""
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="processes that each hold a 1/N slice of every layer (heads, MLP columns, "
                                    "vocabulary)")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="processes that each hold a slice of the layers")
    pipeline_layer_split: list[int] | None = Field(
        None, description="layers per pipeline rank; default an even split")
    distributed_init_timeout_s: float = Field(120.0, gt=0)
    pp_step_timeout_s: float = Field(
        default_factory=env_default("GRAPHRUNNER_PP_STEP_TIMEOUT_S", "ParallelConfig.pp_step_timeout_s", 300.0),
        ge=0, description="seconds rank 0 waits for one step's reply from the live sampler rank; 0: no limit "
                          "[GRAPHRUNNER_PP_STEP_TIMEOUT_S]")
    push_all_reduce_max_bytes: int = Field(
        default_factory=env_default("GRAPHRUNNER_PUSH_ALL_REDUCE_MAX_BYTES",
                                    "ParallelConfig.push_all_reduce_max_bytes", 128 << 10),
        ge=0, description="tensor parallelism on GPUs: all-reduces of at most this many bytes run as one kernel "
                          "that pushes each rank's values into its peers' buffers over NVLink "
                          "(models/push_all_reduce.py) instead of NCCL, from a buffer of 8 x tensor_parallel_size x "
                          "this bytes on each GPU; the default 131072 takes decode batches up to 16 rows of 4096 "
                          "bf16 (docs/PARALLEL.md). 0: NCCL for all [GRAPHRUNNER_PUSH_ALL_REDUCE_MAX_BYTES]")
    push_all_reduce_in_gemv: bool = Field(
        default_factory=env_default("GRAPHRUNNER_PUSH_ALL_REDUCE_IN_GEMV", "ParallelConfig.push_all_reduce_in_gemv",
                                    True),
        description="with the push all-reduce on: a decode row's o_proj and down_proj GEMVs sum their own output "
                    "over the ranks in their epilogue (models/small_batch_kernels.linear_all_reduce) instead of "
                    "launching the all-reduce kernel after them; off: that kernel after them "
                    "[GRAPHRUNNER_PUSH_ALL_REDUCE_IN_GEMV]")
    push_all_reduce_timeout_record: bool = Field(
        default_factory=env_default("GRAPHRUNNER_PUSH_ALL_REDUCE_TIMEOUT_RECORD",
                                    "ParallelConfig.push_all_reduce_timeout_record", False),
        description="with the push all-reduce on: a kernel that times out waiting for a peer first writes "
                    "what it waited for (the call, the peer, the calls found in the peer's slots) into pinned "
                    "host memory, and the step's error and log say it (models/push_all_reduce.py); off by "
                    "default, as that code path slows the one-row GEMVs' schedule (docs/PARALLEL.md) "
                    "[GRAPHRUNNER_PUSH_ALL_REDUCE_TIMEOUT_RECORD]")
    threads: int | None = Field(
        None, ge=1, description="CPU threads of torch's operators (torch.set_num_threads, set when the engine "
                                "starts, for the whole process); None: torch's default, one per core")

    @property
    def world_size(self) -> int:
        """Processes the engine runs in: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class EngineConfig(_Config):
    model_config_: ModelConfig = Field(..., alias="model_config")
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    compilation: CompilationConfig = Field(default_factory=CompilationConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    kernel: KernelConfig = Field(default_factory=KernelConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = Field(0, ge=0)

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              protected_namespaces=())

    @property
    def model(self) -> ModelConfig:
        return self.model_config_

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        split = self.parallel.pipeline_layer_split
        if split is not None and len(split) != self.parallel.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_layer_split has {len(split)} entries but pipeline_parallel_size is "
                f"{self.parallel.pipeline_parallel_size}")
        if self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"async_scheduling=True is not supported with pipeline_parallel_size="
                f"{self.parallel.pipeline_parallel_size}: the pipeline passes each step's tokens back to rank 0 "
                "synchronously; leave async_scheduling unset (auto) or False")
        return self

    def resolve_async_scheduling(self, device_type: str) -> bool:
        """The effective async_scheduling for an engine on `device_type` ("cuda" or "cpu")."""
        value = self.scheduler.async_scheduling
        if value is None:
            return device_type == "cuda" and self.parallel.pipeline_parallel_size == 1
        return value

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Route flat `LLM(...)` keyword arguments to the sub-config that owns each; `<name>_config`
        (`kernel_config`, `compilation_config`, `cache_config`, `scheduler_config`, `parallel_config`)
        passes a whole sub-config, as a dict of its fields or the config itself."""
        owners = {"model_config": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                  "compilation": CompilationConfig, "parallel": ParallelConfig, "kernel": KernelConfig}
        parts: dict[str, dict[str, Any]] = {name: {} for name in owners}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in ("device", "seed"):
                top[key] = value
                continue
            whole = key[: -len("_config")] if key.endswith("_config") else None
            if whole in owners and whole != "model_config":
                if isinstance(value, owners[whole]):
                    value = value.model_dump(exclude_unset=True)
                if not isinstance(value, dict):
                    raise TypeError(f"{key} must be a dict of {owners[whole].__name__} fields or a "
                                    f"{owners[whole].__name__}, got {type(value).__name__}")
                parts[whole].update(value)
                continue
            owner = next((name for name, sub in owners.items() if key in sub.model_fields), None)
            if owner is None:
                known = sorted({f for sub in owners.values() for f in sub.model_fields} | {"device", "seed"}
                               | {f"{name}_config" for name in owners if name != "model_config"})
                raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
            parts[owner][key] = value
        return cls(**{name: sub(**parts[name]) for name, sub in owners.items()}, **top)
