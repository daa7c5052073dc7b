"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP.

Each block has a torch `reference` (CPU, and the definition of correct) and, on CUDA, one
fused Triton kernel (models/fused_kernels.py): fewer launches per layer is what a small
model's graph replay is bound by. GRAPHRUNNER_FUSED_OPS=0 turns the kernels off (benchmarks
measure before/after in one run)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig


@functools.cache
def _fused_kernels():
    """The Triton kernels module, or None when Triton is missing or GRAPHRUNNER_FUSED_OPS=0."""
    if os.environ.get("GRAPHRUNNER_FUSED_OPS", "1") == "0":
        return None
    try:
        from models import fused_kernels
    except ImportError:
        return None
    return fused_kernels


def fused(x: torch.Tensor):
    return _fused_kernels() if x.is_cuda else None


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new
    residual too (the fused add+norm of vLLM, one less pass over the hidden states)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        kernels = fused(x)
        if kernels is None:
            return self.reference(x, residual)
        shape = x.shape
        result = kernels.add_rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps,
                                      None if residual is None else residual.reshape(-1, shape[-1]))
        if residual is None:
            return result.view(shape)
        return result[0].view(shape), result[1].view(shape)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


def rope_inverse_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling from transformers' own rope-init functions.

    Supports every static rope type transformers registers (default, linear, llama3, yarn, ...);
    `dynamic` and `longrope` change with the sequence length at run time and are refused.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # real numbers even while the module is being built on "meta"
        return _rope_init(config, ROPE_INIT_FUNCTIONS)


def _rope_init(config: PretrainedConfig, ROPE_INIT_FUNCTIONS) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope type {rope_type!r} depends on the sequence length at run time; unsupported")
    if rope_type in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if rope_type != "default":
        raise ValueError(f"unknown rope type {rope_type!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return LlamaRotaryEmbedding.compute_default_rope_parameters(config)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves, as HF Llama) from a cos/sin table indexed by position."""

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config, self.max_positions = config, max_positions
        inv_freq, _ = rope_inverse_frequencies(config)
        self.rotary_dim = inv_freq.numel() * 2
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, self.rotary_dim, dtype=torch.float32),
                             persistent=False)
        if self.cos_sin_cache.device.type != "meta":
            self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        inv_freq, attention_scaling = rope_inverse_frequencies(self.config)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
        self.cos_sin_cache.copy_(cache)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D] -> rotated copies."""
        kernels = fused(q)
        if kernels is None or self.rotary_dim != q.shape[-1]:
            return self.reference(positions, q, k)
        return kernels.rope(positions, q, k, self.cos_sin_cache)

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """Rotated q, with rotated k and v written into kv_cache at slot_mapping, in one fused
        kernel; None where that kernel does not apply (no CUDA, fused ops off, partial rotary)."""
        kernels = fused(q)
        if kernels is None or self.rotary_dim != q.shape[-1]:
            return None
        return kernels.rope_and_cache(positions, q, k, v, self.cos_sin_cache, kv_cache, slot_mapping)

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return out if rest.numel() == 0 else torch.cat([out, rest], dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up packed in one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = fused(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
