"""One Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3) switched by ModelSpec flags.

The forward takes flattened tokens (no batch or padding dimension) and reads per-step
attention state from the forward context. Under pipeline parallelism a rank holds only
its contiguous slice of layers; the first rank embeds, the last normalises and projects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attention.layer import Attention
from models.hf_config import ModelSpec
from models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, small_batch


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next."""
    hidden_states: torch.Tensor
    residual: torch.Tensor


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, cache_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, cache_index, rotary)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv_proj's output [T, (Hq + 2 Hkv) D] -> attention output [T, Hq D], before o_proj."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attn(positions, q, k, v)

    def cache_written_here(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this layer's kv_cache, slot_mapping) when the step's one row may take
        `norm_qkv_rope_cache`: the attention layer would itself rotate and write the cache
        (`Attention.cache_written_here`, RoPE over the whole head_dim), and no qk_norm sits between
        the projection and RoPE. Else None."""
        if hidden.shape[0] != 1 or self.qk_norm or self.attn.rotary.rotary_dim != self.head_dim:
            return None
        return self.attn.cache_written_here()


def add_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None):
    """(norm(hidden + residual), hidden + residual); the first layer (residual None) starts the
    residual stream with its input."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, cache_index: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(spec, rotary, cache_index)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        kernels = small_batch(hidden)
        if kernels is not None:
            return self.forward_small_batch(kernels, positions, hidden, residual)
        hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_small_batch(self, kernels, positions, hidden, residual):
        """The same layer for a decode row in fewer launches (models/small_batch_kernels.py):
        input_layernorm fused into qkv_proj, post_attention_layernorm + SiLU*mul into gate_up_proj,
        one-row GEMVs for o_proj and down_proj. Where the attention layer would rotate q/k and write
        the KV cache itself (`SelfAttention.cache_written_here`: one row, no qk_norm, full rotary, a
        cache-writing backend), RoPE and the KV write are fused into the qkv kernel too
        (`norm_qkv_rope_cache`) and only the attention op runs after it. Same contract: (hidden,
        residual) in and out, residual None on the first layer."""
        attn, mlp = self.self_attn, self.mlp
        norm, proj = self.input_layernorm, attn.qkv_proj
        cache = attn.cache_written_here(hidden)
        if cache is not None:   # one row: norm + qkv + RoPE + KV write in one launch, then attention
            q, residual = kernels.norm_qkv_rope_cache(
                hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias, positions,
                attn.attn.rotary.cos_sin_cache, cache[0], cache[1], attn.num_heads, attn.num_kv_heads, attn.head_dim)
            hidden = attn.attn.attend_rotated(q)
        else:
            qkv, residual = kernels.norm_linear(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias)
            hidden = attn.attend(positions, qkv)
        hidden = kernels.linear(hidden, attn.o_proj.weight, attn.o_proj.bias)
        norm, proj = self.post_attention_layernorm, mlp.gate_up_proj
        act, residual = kernels.norm_gate_up_silu(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias)
        return kernels.linear(act, mlp.down_proj.weight, mlp.down_proj.bias), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, layer_range: range, max_positions: int) -> None:
        super().__init__()
        self.is_first = layer_range.start == 0
        self.is_last = layer_range.stop == spec.num_layers
        if self.is_first:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        rotary = self.rotary_emb = RotaryEmbedding(spec.hf_config, max_positions)
        # Keyed by the global layer index so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, rotary, cache_index=n)
                                     for n, i in enumerate(layer_range)})
        if self.is_last:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden_states, intermediate.residual
        self.rotary_emb.begin_step(positions)  # cos/sin gathered once, shared by every layer
        try:
            for layer in self.layers.values():
                hidden, residual = layer(positions, hidden, residual)
        finally:
            self.rotary_emb.end_step()
        if not self.is_last:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], intermediate=None)` -> hidden [T, H] on the last
    pipeline rank, IntermediateTensors elsewhere; `compute_logits(hidden [N, H])` -> [N, V] fp32 (model dtype on request)."""

    def __init__(self, spec: ModelSpec, layer_range: range | None = None, max_positions: int | None = None):
        super().__init__()
        self.spec = spec
        self.layer_range = layer_range if layer_range is not None else range(spec.num_layers)
        self.model = LlamaModel(spec, self.layer_range, max_positions or spec.max_position_embeddings)
        if self.model.is_last:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
            if spec.tie_word_embeddings and self.model.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Recompute non-parameter state after `to_empty` (the module is built on the meta
        device to skip a useless random init) and re-tie the head to the embedding."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_cache()
        if hasattr(self, "lm_head") and self.model.is_first and self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_local_layers(self) -> int:
        return len(self.layer_range)

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None = None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of the rows of hidden; in float32 for the sampler, or in the model dtype where
        only their argmax is needed (the same index: the float32 values are exact conversions)."""
        kernels = small_batch(hidden)
        if kernels is not None:   # one row: the one-row GEMV streams the LM head faster than cuBLAS
            logits = kernels.linear(hidden, self.lm_head.weight, self.lm_head.bias)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits
