"""The Llama family (Llama, Mistral, Qwen2, Qwen3), switched by ModelSpec flags (models/registry.py):
q/k/v biases, o_proj bias, q/k RMSNorm before RoPE.

Its decoder layer has a one-row decode path (`forward_small_batch`) that folds the pre-norms into
the projections after them (models/small_batch_kernels.py). Phi-3 builds from this layer too.
"""

from __future__ import annotations

import torch
from torch import nn

from attention.layer import Attention
from models.causal_lm import CausalLM, DecoderModel, IntermediateTensors, add_norm, layer_sliding_window
from models.hf_config import ModelSpec
from models.layers import GatedMLP, QKVLinear, RMSNorm, activation_name, linear_by, row_parallel_linear, small_batch
from models.rotary import RotaryEmbedding

__all__ = ["DecoderLayer", "IntermediateTensors", "LlamaForCausalLM", "LlamaModel", "SelfAttention"]


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, cache_index: int, *,
                 norm_class: type[RMSNorm] = RMSNorm, scale: float | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        # Column-parallel q/k/v: this tensor-parallel rank's heads only (all of them on one rank).
        self.qkv_proj = QKVLinear(spec.hidden_size, spec.num_heads, spec.num_kv_heads, self.head_dim, spec.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.num_heads, self.qkv_proj.heads.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = row_parallel_linear(spec.num_heads * self.head_dim, spec.hidden_size, spec.o_proj_bias,
                                          "num_attention_heads * head_dim")
        if spec.qk_norm:
            self.q_norm = norm_class(self.head_dim, spec.rms_norm_eps)
            self.k_norm = norm_class(self.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, cache_index, rotary, scale=scale,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

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
            rotated = self._norm_rotate_and_cache(positions, q, k, v)
            if rotated is not None:
                return self.attn.attend_rotated(rotated)
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attn(positions, q, k, v)

    def _norm_rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor) -> torch.Tensor | None:
        """q rotated, with k and v in the KV cache, the q/k norms applied by the same kernel
        (`fused_kernels.rope_and_cache` with qk_norm): where the attention layer would rotate and
        write the cache itself and the norms would take their kernel. Two norm launches and two
        contiguous copies of q and k fewer per layer. Else None."""
        if not self.q_norm.kernel_rounds_like_reference(q) or self.q_norm.eps != self.k_norm.eps:
            return None
        cache = self.attn.cache_written_here()
        if cache is None:
            return None
        weights = (self.q_norm.kernel_weight(), self.k_norm.kernel_weight(), self.q_norm.eps)
        return self.attn.rotary.rotate_and_cache(positions, q, k, v, *cache, qk_norm=weights)

    def cache_written_here(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this layer's kv_cache, slot_mapping) when the step's one row may take
        `norm_qkv_rope_cache`: the attention layer would itself rotate and write the cache
        (`Attention.cache_written_here`, RoPE over the whole head_dim), and no qk_norm sits between
        the projection and RoPE. Else None."""
        if hidden.shape[0] != 1 or self.qk_norm or self.attn.rotary.rotary_dim != self.head_dim:
            return None
        return self.attn.cache_written_here()


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, cache_index: int,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(spec, rotary, cache_index, sliding_window=sliding_window)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias,
                            activation_name(getattr(spec.hf_config, "hidden_act", "silu")))
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        kernels = small_batch(hidden)
        if kernels is not None and self.mlp.activation == "silu":
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
        residual) in and out, residual None on the first layer. Under tensor parallelism every
        kernel here works on this rank's shard (its heads, its MLP columns: the weights it holds),
        and o_proj / down_proj each end with their all-reduce (`linear_by`: in the GEMV itself where the
        push all-reduce is set up)."""
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
        hidden = linear_by(kernels, hidden, attn.o_proj)   # + the all-reduce under TP
        norm, proj = self.post_attention_layernorm, mlp.gate_up_proj
        act, residual = kernels.norm_gate_up_silu(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias)
        return linear_by(kernels, act, mlp.down_proj), residual


class LlamaModel(DecoderModel):
    def make_layer(self, spec: ModelSpec, layer_index: int, cache_index: int,
                   rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        window = layer_sliding_window(spec, layer_index) if spec.sliding_window_in_attention else None
        return DecoderLayer(spec, rotaries["default"], cache_index, window)


class LlamaForCausalLM(CausalLM):
    model_class = LlamaModel
