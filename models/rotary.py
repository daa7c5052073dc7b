"""Rotary position embedding: the cos/sin tables (per layer type where a config has several; the
inverse frequencies of every rope type in models/rope_init.py) and neox-style rotation, with one
dispatch point per call: the fused Triton kernel on CUDA (models/fused_kernels.py), the C kernel on
a CPU decode step (models/cpu_kernels.py), else the torch reference, which keeps HF's rounding
points.

The table is computed once for the engine's context limit `max_positions`. `longrope` (Phi-3's su
scaling) has two sets of factors, and HF switches between them at run time, for every position at
once, by the current sequence length: short factors while it is at most
original_max_position_embeddings, long ones beyond. A paged KV cache keeps keys rotated once, so the
choice here is made once: short factors when max_model_len <= original_max_position_embeddings (then
every sequence the engine accepts is one HF runs with short factors: equal to HF), long factors
otherwise (equal to HF for sequences whose prompt already exceeds the original length; shorter ones
differ from HF, which would use short factors for them until they grow past it).
"""

from __future__ import annotations

import torch
from torch import nn

from models import cpu_kernels
from models.layers import fused
from models.rope_init import rope_inverse_frequencies


ROPE_SIGNED_MAX_ROWS = 64
"""Steps of at most this many tokens rotate through `_rotate_signed` (decode); longer ones `_rotate`."""


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves, as HF Llama) from a cos/sin table indexed by position."""

    def __init__(self, config, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.config, self.max_positions, self.layer_type = config, max_positions, layer_type
        inv_freq, _ = rope_inverse_frequencies(config, layer_type, max_positions)
        self.rotary_dim = inv_freq.numel() * 2
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, self.rotary_dim, dtype=torch.float32),
                             persistent=False)
        if self.cos_sin_cache.device.type != "meta":
            self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        inv_freq, attention_scaling = rope_inverse_frequencies(self.config, self.layer_type, self.max_positions)
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
                         kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """Rotated q, with rotated k and v written into kv_cache at slot_mapping, in one fused
        kernel (q and k RMS-normalised first with qk_norm = (q weight, k weight, eps)); None where
        that kernel does not apply (no CUDA, fused ops off, partial rotary)."""
        kernels = fused(q)
        if kernels is None or self.rotary_dim != q.shape[-1]:
            return None
        return kernels.rope_and_cache(positions, q, k, v, self.cos_sin_cache, kv_cache, slot_mapping, qk_norm)

    def begin_step(self, positions: torch.Tensor) -> None:
        """Marks this step's positions (the model calls it before its layers and `end_step` after):
        the torch reference path gathers their cos/sin rows on its first call and every layer reuses
        them. A step whose layers all take a kernel (CUDA, or the C RoPE) gathers nothing."""
        self._step = (positions, None)

    def end_step(self) -> None:
        self._step = None

    _step: tuple | None = None

    def _tables(self, positions: torch.Tensor) -> tuple:
        """(cos, sin, signed) of `positions`, [T, 1, D/2] each, signed = ([cos, cos], [-sin, sin]) for
        `_rotate_signed` or None (long steps, odd rotary_dim); gathered once per step."""
        step = self._step
        if step is not None and step[0] is positions and step[1] is not None:
            return step[1]
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        signed = None
        if positions.numel() <= ROPE_SIGNED_MAX_ROWS and self.rotary_dim % 2 == 0:
            signed = (torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))
        if step is not None and step[0] is positions:
            self._step = (positions, (cos, sin, signed))
        return cos, sin, signed

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        qk = _adjacent_heads(q, k)  # q and k side by side in one projection row: one pass for both
        if qk is not None and self.rotary_dim == qk.shape[-1]:
            out = cpu_kernels.rope(qk, positions, self.cos_sin_cache)  # a CPU decode step: one C pass
            if out is not None:
                return out[:, :q.shape[1]], out[:, q.shape[1]:]
        cos, sin, signed = self._tables(positions)
        if qk is not None:
            if signed is not None and qk.dtype == torch.float32 and self.rotary_dim == qk.shape[-1]:
                out = _rotate_signed(qk, *signed)
            else:
                out = _rotate(qk, cos, sin, self.rotary_dim)
            return out[:, :q.shape[1]], out[:, q.shape[1]:]
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, Hq + Hk, D] view over q and k when k's heads directly follow q's in the same rows
    (q and k split from one qkv projection), else None."""
    if (q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.shape[0] != k.shape[0]
            or q.shape[2] != k.shape[2] or q.stride() != k.stride() or q.stride(2) != 1
            or q.stride(1) != q.shape[2] or q.device != k.device
            or k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size()
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def _rotate_signed(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """`_rotate` of a float32 x over its whole last dim in 4 kernels instead of 7, from the step's
    [cos, cos] and [-sin, sin] tables: [x2, x1] * [-sin, sin] + x * [cos, cos]. Bit for bit the same
    (negation is exact, addition commutes); faster for a decode step's few rows only (measured
    slower at 1230 rows on a 2-core CPU), hence ROPE_SIGNED_MAX_ROWS."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2, x1], dim=-1).mul_(sin2).add_(x * cos2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """[x1*cos - x2*sin, x2*cos + x1*sin] on the first rotary_dim features (HF's rotate_half
    form, same roundings), computed in float32 straight into the halves of one output."""
    whole = rotary_dim == x.shape[-1]
    rot = x if whole else x[..., :rotary_dim]
    if rot.dtype != torch.float32:
        rot = rot.float()
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.empty(rot.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out if whole else torch.cat([out, x[..., rotary_dim:]], dim=-1)
