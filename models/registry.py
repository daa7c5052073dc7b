"""Supported architectures: config.json's `architectures` name -> the family module that builds it.

A new family is one file under models/ (a `CausalLM` subclass, models/causal_lm.py), one line
here, and its config class's defaults in models/config_json.py (`FAMILY_DEFAULTS`). The Llama-family flags switch what differs inside models/llama.py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FamilyFlags:
    qkv_bias: bool | None = None
    """True/False forces q/k/v biases; None reads `attention_bias` from the HF config."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)."""
    sliding_window_in_attention: bool = False
    """The attention applies the config's `sliding_window` (per `layer_types` where given). False:
    the window is not implemented for the family, and max_model_len is capped to it instead."""


@dataclass(frozen=True)
class Family:
    module: str
    """The module under models/ that defines `class_name`."""
    class_name: str
    flags: FamilyFlags = field(default_factory=FamilyFlags)


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Family("models.llama", "LlamaForCausalLM",
                                 FamilyFlags(qkv_bias=False, sliding_window_in_attention=True)),
    "Qwen2ForCausalLM": Family("models.llama", "LlamaForCausalLM", FamilyFlags(qkv_bias=True)),
    "Qwen3ForCausalLM": Family("models.llama", "LlamaForCausalLM", FamilyFlags(qk_norm=True)),
    "Phi3ForCausalLM": Family("models.phi3", "Phi3ForCausalLM", FamilyFlags(sliding_window_in_attention=True)),
    "Gemma2ForCausalLM": Family("models.gemma2", "Gemma2ForCausalLM", FamilyFlags(sliding_window_in_attention=True)),
    "Gemma3ForCausalLM": Family("models.gemma3", "Gemma3ForCausalLM",
                                FamilyFlags(qk_norm=True, sliding_window_in_attention=True)),
}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture this engine does not implement."""


def family_of(architectures: list[str] | None) -> tuple[str, Family]:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(ARCHITECTURES))}")


def family_flags(architectures: list[str] | None) -> tuple[str, FamilyFlags]:
    arch, family = family_of(architectures)
    return arch, family.flags


def model_class(architecture: str) -> type:
    """The CausalLM class of a supported architecture (its module is imported on first use)."""
    family = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(family.module), family.class_name)
