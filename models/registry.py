"""Supported architectures: one Llama-family implementation, switched by flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyFlags:
    qkv_bias: bool | None = None
    """True/False forces q/k/v biases; None reads `attention_bias` from the HF config."""
    qk_norm: bool = False
    """Qwen3: RMSNorm over head_dim on q and k before RoPE."""


ARCHITECTURES: dict[str, FamilyFlags] = {
    "LlamaForCausalLM": FamilyFlags(),
    "MistralForCausalLM": FamilyFlags(qkv_bias=False),
    "Qwen2ForCausalLM": FamilyFlags(qkv_bias=True),
    "Qwen3ForCausalLM": FamilyFlags(qk_norm=True),
}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture this engine does not implement."""


def family_flags(architectures: list[str] | None) -> tuple[str, FamilyFlags]:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
