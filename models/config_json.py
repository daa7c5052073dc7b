"""config.json -> `HFConfig`: the checkpoint's fields as attributes, with its family's defaults and
RoPE in one normalized form, read without transformers' config classes.

Why not `AutoConfig`: importing a family's configuration module (transformers 5.x) imports
transformers' image and video utilities (torchvision, and through it torch._dynamo, sympy,
pandas, scikit-learn where installed) and, through its docstring decorator, the auto model
classes and generation utilities (scikit-learn, scipy): seconds of a GPU start-up
(docs/PERFORMANCE.md, "GPU: LLM to ready"). The engine reads a few dozen fields; this module
gives each the value transformers' config class would (`FAMILY_DEFAULTS` holds the class
defaults of the fields the engine reads, `_derived` what the classes compute from others), and
tests/test_hf_config.py checks every engine-visible value against transformers' own config for
every family, minimal and full config.json files and every RoPE type.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rope_theta": 10000.0, "sliding_window": None, "eos_token_id": None,
}

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "eos_token_id": 2, "bos_token_id": 1},
    "mistral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096, "eos_token_id": 2, "bos_token_id": 1},
    "qwen2": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768,
              "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768,
              "head_dim": 128, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28},
    "phi3": {**_COMMON, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "eos_token_id": 32000,
             "bos_token_id": 1},
    "gemma2": {**_COMMON, "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "tie_word_embeddings": True, "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh",
               "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "eos_token_id": 1, "bos_token_id": 2},
    "gemma3_text": {**_COMMON, "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "tie_word_embeddings": True, "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh",
                    "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                    "sliding_window": 4096, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None, "eos_token_id": 1,
                    "bos_token_id": 2},
}
"""transformers' config-class defaults (model_type -> field -> value) of the fields the engine reads."""

_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")


class HFConfig:
    """A checkpoint's config.json fields as attributes (a field it lacks and the family does not
    default raises AttributeError, as on transformers' configs, so `getattr(config, name, None)`
    reads an optional field). RoPE is in `rope_parameters`: one dict with rope_type and
    rope_theta, or one such dict per layer type (Gemma 3)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"


class ConfigFileError(ValueError):
    """config.json cannot be read as a model configuration."""


def read_config_json(path: str | Path) -> HFConfig:
    """The HFConfig of a checkpoint's config.json (`path`: the file)."""
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigFileError(f"{path}: not a readable JSON file ({error})") from error
    if not isinstance(fields, dict):
        raise ConfigFileError(f"{path}: expected a JSON object, got {type(fields).__name__}")
    return hf_config_from_dict(fields)


def hf_config_from_dict(raw: dict[str, Any]) -> HFConfig:
    """config.json's fields over the family's defaults (chosen by `model_type`), with the fields
    transformers' config classes derive (RoPE, layer types, KV heads, dtype) derived the same way."""
    model_type = raw.get("model_type")
    fields = {**FAMILY_DEFAULTS.get(model_type, _COMMON), **copy.deepcopy(raw)}
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if "dtype" not in fields and "torch_dtype" in fields:
        fields["dtype"] = fields["torch_dtype"]
    _derive_sliding_window(fields, model_type)
    fields["rope_parameters"] = (_gemma3_rope(fields) if model_type == "gemma3_text" else _rope(fields))
    return HFConfig(fields)


def _derive_sliding_window(fields: dict[str, Any], model_type: str | None) -> None:
    """`sliding_window` and `layer_types` as the family's config class sets them."""
    layers = fields["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        if not fields.get("use_sliding_window"):
            fields["sliding_window"] = None
        if fields.get("layer_types") is None:
            fields["layer_types"] = ["sliding_attention" if fields["sliding_window"] is not None
                                     and i >= fields["max_window_layers"] else "full_attention" for i in range(layers)]
    elif model_type == "gemma2" and fields.get("layer_types") is None:
        fields["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif model_type == "gemma3_text" and fields.get("layer_types") is None:
        pattern = fields["sliding_window_pattern"]
        fields["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                 for i in range(layers)]


def _rope(fields: dict[str, Any]) -> dict[str, Any]:
    """One RoPE dict: `rope_scaling` (the legacy name) or `rope_parameters`, with rope_type,
    rope_theta, partial_rotary_factor and original_max_position_embeddings filled in the way
    transformers' `standardize_rope_params` does (a top-level original_max_position_embeddings,
    Phi-3's, wins for the scaled types)."""
    params = dict(fields.get("rope_scaling") or fields.get("rope_parameters") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", fields.get("rope_theta"))
    if fields.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", fields["partial_rotary_factor"])
    if params["rope_type"] in _SCALED_ROPE_TYPES:
        if "original_max_position_embeddings" in fields:
            params["original_max_position_embeddings"] = fields["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    return params


def _gemma3_rope(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3: local (sliding) layers rotate with rope_local_base_freq and no scaling, global
    ones with rope_theta and `rope_scaling`."""
    saved = fields.get("rope_parameters")
    nested = saved if isinstance(saved, dict) and {"sliding_attention", "full_attention"} & set(saved) else {}
    full = dict(nested.get("full_attention") or {"rope_type": "default"})
    if fields.get("rope_scaling"):
        full.update(fields["rope_scaling"])
    full.setdefault("rope_theta", fields["rope_theta"])
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", fields["rope_local_base_freq"])
    out = {}
    for kind, params in (("sliding_attention", local), ("full_attention", full)):
        params.setdefault("rope_type", params.get("type", "default"))
        if params["rope_type"] in _SCALED_ROPE_TYPES:
            params.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
        out[kind] = params
    return out
