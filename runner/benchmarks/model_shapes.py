"""HF config.json contents of the model shapes the benchmarks use (no weights: load_format="dummy").

    from runner.benchmarks.model_shapes import SHAPES, write_config
    path = write_config("llama-3-8b", "/tmp/llama-3-8b")   # -> /tmp/llama-3-8b (folder with config.json)

RoPE is written in the legacy form (`rope_theta` + `rope_scaling`), as the checkpoints on the
hub still ship it: transformers 5.x converts it into `rope_parameters` on load, and 4.56 reads it
as is. The 5.x-only `rope_parameters` key would be ignored by 4.56 (rope_theta would silently fall
back to 10000), so it is not written. tests/test_benchmarks.py checks the round trip.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "use_cache": True,
}

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        **_LLAMA_COMMON,
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama-3.2-1b": {
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3-8b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_cache": True,
    },
}


def shape_config(name: str, **overrides: Any) -> dict[str, Any]:
    """A copy of one shape's config dict, with `overrides` applied (e.g. num_hidden_layers=4)."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    config = copy.deepcopy(SHAPES[name])
    config.update(overrides)
    return config


def write_config(name: str, folder: str | Path, dtype: str = "bfloat16", **overrides: Any) -> Path:
    """Write `folder/config.json` for shape `name` and return the folder, ready for
    `LLM(model=folder, load_format="dummy")`. The dtype goes under `dtype` (read by 4.56+ and 5.x;
    the older `torch_dtype` key makes 4.56 print a deprecation warning)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = shape_config(name, **overrides)
    config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def parameter_bytes(name: str, bytes_per_element: int = 2, **overrides: Any) -> int:
    """Bytes of the weights a decode step reads (embedding rows are gathered, not streamed, but the
    LM head reads the whole [vocab, hidden] matrix, tied or not; norms are negligible)."""
    c = shape_config(name, **overrides)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return (layers * per_layer + c["vocab_size"] * hidden) * bytes_per_element


def kv_bytes_per_token(name: str, bytes_per_element: int = 2, **overrides: Any) -> int:
    """K + V bytes one token occupies across all layers."""
    c = shape_config(name, **overrides)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * bytes_per_element
