"""Device, dtype and KV-cache budget decisions (the few facts that depend on the machine)."""

from __future__ import annotations

import logging
import math
import mmap

import torch

from configs import EngineConfig
from models.hf_config import ModelSpec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but torch sees no CUDA GPU")
    return torch.device(name)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's dtype; if it has none, bfloat16 on a GPU and float32 on a CPU."""
    if name != "auto":
        return _DTYPES[name]
    if spec.checkpoint_dtype is not None:
        return spec.checkpoint_dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device, peak_bytes: int,
                  graph_reserve_bytes: int, max_model_len: int) -> int:
    """How many KV blocks fit. GPU: utilization * total - profile peak - measured graph reserve -
    memory outside torch's allocator; CPU: `kv_cache_memory` bytes, or by default what max_num_seqs
    sequences of `max_model_len` tokens can use, capped (CacheConfig.default_kv_cache_blocks)."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        non_torch = (total - free) - torch.cuda.memory_reserved(device)
        budget = int(cache.gpu_memory_utilization * total) - peak_bytes - graph_reserve_bytes - non_torch
        logger.info("KV budget: %.2f GiB = %.2f * %.2f GiB - peak %.2f - graphs %.2f - non-torch %.2f GiB",
                    budget / 2**30, cache.gpu_memory_utilization, total / 2**30, peak_bytes / 2**30,
                    graph_reserve_bytes / 2**30, non_torch / 2**30)
    elif cache.kv_cache_memory is not None:
        budget = int(cache.kv_cache_memory)
    else:
        return cache.default_kv_cache_blocks(bytes_per_block, max_model_len, config.scheduler.max_num_seqs,
                                             _available_host_bytes())
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes, {bytes_per_block} per block); "
                           "raise gpu_memory_utilization or lower max_num_batched_tokens")
    return int(blocks)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages the process only holds once they are written: an anonymous
    memory map (the kernel hands out zero pages on first touch), where `torch.zeros` would write,
    and so make resident, every byte up front. Why: a CPU KV cache is sized for the most sequences
    the engine may hold, and a short run writes a few of its blocks; resident memory then grows
    with the tokens actually cached (`graphrunner bench startup` reports the peak)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
