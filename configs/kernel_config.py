"""Which kernels run: the switches of the fast paths, each a field whose default an environment variable
may set (configs/env.py). The defaults are the fast paths; switching one off runs the plain path it
replaces (for benchmarks that measure before/after, or to rule a kernel out when hunting a bug).

How the kernels get the engine's choice: `active_kernel_config()`, one process-wide KernelConfig that
the model runner sets from its EngineConfig (`set_active_kernel_config`) before it builds the model.
Why process-wide and not passed down: the switches are read where a kernel is launched or an op is
dispatched, deep below anything that holds the config: module-level launchers shared by every layer
(launch/fast_launch.FastLaunch, the PDL options of every Triton kernel, the attention's split plan),
per-op dispatch helpers called inside every layer's forward, and compiled C libraries loaded once per
process. Threading a config through every kernel call would put it in every op's signature (and the
per-launch host cost is what these paths exist to cut); one process runs one model's kernels at a time,
and what is compiled or loaded is per process anyway. Code that is handed the EngineConfig (the
attention backend, the step graph, compile-ahead, the pipeline executor) gets its fields passed instead.
Without an engine (tests, kernel benchmarks) the active config is a default one, built (env read) on
first use; tests change it with `using_kernel_config(...)`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from configs.env import default_home, env_default


def _field(env: str, name: str, default: Any, description: str, kind: type | None = None, **constraints: Any) -> Any:
    return Field(default_factory=env_default(env, f"KernelConfig.{name}", default, kind), description=description,
                 **constraints)


class KernelConfig(BaseModel):
    """The kernels' switches (see the module docstring); environment variable in brackets."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    fused_ops: bool = _field("GRAPHRUNNER_FUSED_OPS", "fused_ops", True,
                             "CUDA: the fused Triton kernels of the layers (norm, RoPE + KV write, SiLU*mul, "
                             "the decode head); off: torch's ops [GRAPHRUNNER_FUSED_OPS]")
    small_batch_kernels: bool = _field("GRAPHRUNNER_SMALL_BATCH_KERNELS", "small_batch_kernels", True,
                                       "CUDA: one-row decode layers through the norm-fused GEMV kernels "
                                       "(needs fused_ops) [GRAPHRUNNER_SMALL_BATCH_KERNELS]")
    fast_launch: bool = _field("GRAPHRUNNER_FAST_LAUNCH", "fast_launch", True,
                               "CUDA: relaunch compiled Triton kernels without JITFunction.run's per-call work "
                               "[GRAPHRUNNER_FAST_LAUNCH]")
    pdl: bool = _field("GRAPHRUNNER_PDL", "pdl", True,
                       "CUDA (sm_90+): programmatic dependent launch of the decode kernels [GRAPHRUNNER_PDL]")
    fused_merge: bool | None = _field("GRAPHRUNNER_FUSED_MERGE", "fused_merge", None,
                                      "CUDA: split-KV attention merges its splits in the same launch (the last "
                                      "split to finish); off: a separate merge kernel; None (auto): the merge "
                                      "kernel inside CUDA graphs, where it is the faster (`graphrunner bench "
                                      "attention --heads 32 8 64 --context-len 1024 32768` with "
                                      "GRAPHRUNNER_FUSED_MERGE=0/1 on an H100: bs1 32k 64 splits 43 / 57 us, 1k "
                                      "16 splits 12 / 21 us), the in-kernel merge in eager launches, where a "
                                      "second launch costs host time [GRAPHRUNNER_FUSED_MERGE]", bool)
    one_row_block_n: Literal[2, 4, 8] | None = _field(
        "GRAPHRUNNER_ONE_ROW_BLOCK_N", "one_row_block_n", None,
        "CUDA: output columns a program of the one-row GEMV kernels owns (gate/up and RoPE column pairs at "
        "half of it); None: the measured rule of models/small_batch_kernels.one_row_block_n "
        "[GRAPHRUNNER_ONE_ROW_BLOCK_N]", int)
    one_row_block_k: Literal[1024, 2048, 4096, 8192] | None = _field(
        "GRAPHRUNNER_ONE_ROW_BLOCK_K", "one_row_block_k", None,
        "CUDA: input columns a program of the one-row GEMV kernels loads per step of its K loop (down to K's "
        "power of two; the first is requested before the kernel waits for its input); None: the measured "
        "ONE_ROW_TILES of models/small_batch_kernels [GRAPHRUNNER_ONE_ROW_BLOCK_K]", int)
    min_split_tiles: int = _field("GRAPHRUNNER_MIN_SPLIT_TILES", "min_split_tiles", 1,
                                  "CUDA: the fewest KV tiles one split-KV attention program takes "
                                  "[GRAPHRUNNER_MIN_SPLIT_TILES]", ge=1)
    cpu_kernels: bool = _field("GRAPHRUNNER_CPU_KERNELS", "cpu_kernels", True,
                               "CPU: the C kernels of decode steps (norm, RoPE, SiLU*mul, LM-head screen, decode "
                               "attention), built with the system C compiler [GRAPHRUNNER_CPU_KERNELS]")
    cpu_isa: Literal["auto", "avx512", "avx2", "neon", "generic"] = _field(
        "GRAPHRUNNER_CPU_ISA", "cpu_isa", "auto",
        "CPU: the best instruction set the C kernels are built for; they take the best this CPU runs at or below "
        "it (auto: no cap; generic: portable C for the architecture's baseline, always there) "
        "[GRAPHRUNNER_CPU_ISA]", str)
    cpu_packed_linear: bool = _field("GRAPHRUNNER_CPU_PACKED_LINEAR", "cpu_packed_linear", True,
                                     "CPU: fp32 linears of decode steps of 3-64 rows multiply a packed weight "
                                     "[GRAPHRUNNER_CPU_PACKED_LINEAR]")
    cpu_linear_pack: Literal["auto", "mkl", "onednn"] = _field(
        "GRAPHRUNNER_CPU_LINEAR_PACK", "cpu_linear_pack", "auto",
        "CPU: the packed-weight format of cpu_packed_linear: MKL's packed sgemm or oneDNN's; auto: MKL on Intel "
        "CPUs, oneDNN on others, where each is the faster (models/layers.pack_format) [GRAPHRUNNER_CPU_LINEAR_PACK]",
        str)
    cpu_screened_argmax: bool = _field("GRAPHRUNNER_CPU_SCREENED_ARGMAX", "cpu_screened_argmax", True,
                                       "CPU: greedy rows screen the vocabulary with a bf16 LM head first "
                                       "[GRAPHRUNNER_CPU_SCREENED_ARGMAX]")
    torch_dense_kv: bool = _field("GRAPHRUNNER_TORCH_DENSE_KV", "torch_dense_kv", True,
                                  "torch attention backend: keep a dense per-layer K/V copy instead of gathering "
                                  "the paged cache every layer [GRAPHRUNNER_TORCH_DENSE_KV]")
    triton_sampling: bool = _field("GRAPHRUNNER_TRITON_SAMPLING", "triton_sampling", True,
                                   "GPU: the penalties, the float32 copy and the top-k candidates in one Triton pass, "
                                   "the min-p/top-k/top-p thresholds in one launch, the random draw in one pass "
                                   "(runner/sampling/logits_pass.py, threshold_kernel.py, race_kernel.py); off: "
                                   "the torch ops, their reference "
                                   "[GRAPHRUNNER_TRITON_SAMPLING]")
    cache_dir: str = _field("GRAPHRUNNER_CACHE_DIR", "cache_dir", default_home,
                            "the one folder of every compiled-kernel cache: C libraries in <cache_dir>/native, "
                            "Triton's kernels in <cache_dir>/triton; default $GRAPHRUNNER_HOME, else "
                            "~/.cache/graphrunner [GRAPHRUNNER_CACHE_DIR]", str)


_active: KernelConfig | None = None


def active_kernel_config() -> KernelConfig:
    """The kernel switches in force in this process (see the module docstring for why process-wide)."""
    global _active
    if _active is None:
        _active = KernelConfig()
    return _active


def set_active_kernel_config(config: KernelConfig) -> None:
    """Put `config` in force for this process (the model runner does, from its EngineConfig)."""
    global _active
    if not isinstance(config, KernelConfig):
        raise TypeError(f"expected a KernelConfig, got {type(config).__name__}")
    _active = config


@contextmanager
def using_kernel_config(config: KernelConfig | None = None, **changes: Any) -> Iterator[KernelConfig]:
    """`config` (default: the active one) with `changes`, in force inside the block; the previous one after."""
    global _active
    previous = active_kernel_config()
    current = KernelConfig(**{**(config or previous).model_dump(), **changes})
    _active = current
    try:
        yield current
    finally:
        _active = previous
