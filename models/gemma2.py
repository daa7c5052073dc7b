"""Gemma 2 (Gemma2ForCausalLM): the embedding scaled by sqrt(hidden_size); RMSNorm as x * (1 + w)
(`OffsetRMSNorm`); a norm before AND after both attention and the MLP; GELU-tanh gating;
attention scaled by query_pre_attn_scalar^-0.5 with its scores soft-capped (attn_logit_softcapping)
on every layer, and a sliding window on the layers `layer_types` marks "sliding_attention"
(alternating); the final logits soft-capped too (final_logit_softcapping, in `CausalLM`).

Window and soft-cap are per-layer constants of the attention op (attention/layer.py), applied by the
backends; the rest is the shared layers', with their fast paths.
"""

from __future__ import annotations

import torch
from torch import nn

from models.causal_lm import CausalLM, DecoderModel, add_norm, layer_sliding_window
from models.hf_config import ModelSpec
from models.layers import GatedMLP, OffsetRMSNorm, activation_name
from models.rotary import RotaryEmbedding
from models.llama import SelfAttention


class GemmaDecoderLayer(nn.Module):
    """input_layernorm -> attention -> post_attention_layernorm, + residual;
    pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm, + residual. The residual adds
    are fused into the next norm, as everywhere ((hidden, residual) in and out)."""

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, cache_index: int, layer_index: int) -> None:
        super().__init__()
        config = spec.hf_config
        self.self_attn = SelfAttention(
            spec, rotary, cache_index, norm_class=OffsetRMSNorm, scale=config.query_pre_attn_scalar ** -0.5,
            sliding_window=layer_sliding_window(spec, layer_index),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None))
        hidden_act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, activation_name(hidden_act))
        size, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(DecoderModel):
    norm_class = OffsetRMSNorm
    embedding_scaled = True

    def make_layer(self, spec: ModelSpec, layer_index: int, cache_index: int,
                   rotaries: dict[str, RotaryEmbedding]) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(spec, rotaries["default"], cache_index, layer_index)


class Gemma2ForCausalLM(CausalLM):
    model_class = Gemma2Model
