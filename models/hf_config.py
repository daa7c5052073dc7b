"""HF config.json -> ModelSpec: the numbers every family module needs (the rest it reads from
hf_config, an `HFConfig`: config.json read by models/config_json.py, not by transformers)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from models.config_json import HFConfig, read_config_json
from models.parallel_state import shard_heads, shard_size
from models.registry import family_flags

logger = logging.getLogger(__name__)


class CheckpointError(FileNotFoundError):
    """The checkpoint folder is missing or lacks a required file."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hf_config: HFConfig
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window_in_attention: bool
    max_position_embeddings: int
    checkpoint_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]


def load_hf_config(path: str | Path) -> HFConfig:
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} has no config.json")
    return read_config_json(folder / "config.json")


def _checkpoint_dtype(config: HFConfig) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _eos_ids(config: HFConfig) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def model_spec(config: HFConfig) -> ModelSpec:
    arch, flags = family_flags(getattr(config, "architectures", None))
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    qkv_bias = flags.qkv_bias if flags.qkv_bias is not None else bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        architecture=arch,
        hf_config=config,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        # Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2 biases only q/k/v.
        o_proj_bias=qkv_bias if flags.qkv_bias is None else False,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=flags.qk_norm,
        sliding_window_in_attention=flags.sliding_window_in_attention,
        max_position_embeddings=config.max_position_embeddings,
        checkpoint_dtype=_checkpoint_dtype(config),
        eos_token_ids=_eos_ids(config),
    )


def check_tensor_parallel_size(spec: ModelSpec, tensor_parallel_size: int) -> None:
    """Raise a ValueError naming the config field (num_attention_heads, num_key_value_heads,
    intermediate_size) that `tensor_parallel_size` does not divide: the check the model's layers
    make when they are built, early (at engine configuration, before any process starts)."""
    shard_heads(spec.num_heads, spec.num_kv_heads, tensor_parallel_size, 0)
    shard_size(spec.intermediate_size, tensor_parallel_size, "intermediate_size")


def resolve_max_model_len(spec: ModelSpec, requested: int | None) -> int:
    """The longest sequence the engine accepts: the request, capped by the model's limits."""
    limit = spec.max_position_embeddings
    window = getattr(spec.hf_config, "sliding_window", None)
    if (window and not spec.sliding_window_in_attention and getattr(spec.hf_config, "use_sliding_window", True)
            and window < limit):
        logger.info("sliding_window=%d: max_model_len capped to the window (full attention inside it)", window)
        limit = window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} positions")
    return requested
