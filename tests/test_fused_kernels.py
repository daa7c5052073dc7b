"""The fused Triton kernels (models/fused_kernels.py) against the torch reference of models/layers.py.

Runs in Triton's interpreter on a CPU (scripts/test.sh sets TRITON_INTERPRET=1) and compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from models import layers, rotary as rotary_module

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from models import fused_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_add_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(DEVICE, dtype)
    residual = torch.randn(7, hidden, generator=g).to(DEVICE, dtype)
    norm = layers.RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
    _close(fused_kernels.add_rms_norm(x, norm.weight, 1e-6), norm.reference(x), dtype)
    out, res = fused_kernels.add_rms_norm(x, norm.weight, 1e-6, residual)
    ref_out, ref_res = norm.reference(x, residual)
    _close(out, ref_out, dtype)
    _close(res, ref_res, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    gate, up = x.chunk(2, dim=-1)
    _close(fused_kernels.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    """Gemma's gated activation against the torch reference of models/layers.GatedMLP."""
    x = torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) * 3
    _close(fused_kernels.gelu_tanh_and_mul(x), layers.GatedMLP.activate_gelu_tanh(x.cpu()).to(DEVICE), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 24)])
def test_rope_on_strided_q_and_k(dtype, heads, kv_heads, head_dim):
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=64)
    rotary = rotary_module.RotaryEmbedding(config, 64).to(DEVICE)
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(6, heads, head_dim), k.reshape(6, kv_heads, head_dim)   # strided views, as in the model
    positions = torch.tensor([0, 5, 1, 63, 7, 2], device=DEVICE)
    got_q, got_k = fused_kernels.rope(positions, q, k, rotary.cos_sin_cache)
    ref_q, ref_k = rotary.reference(positions, q, k)
    _close(got_q, ref_q, dtype)
    _close(got_k, ref_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 24)])
def test_rope_and_cache_rotates_q_and_writes_rotated_k_and_v_at_slots(dtype, heads, kv_heads, head_dim):
    """One launch = RoPE (reference) on q and k + the KV write at slot_mapping; -1 rows write nothing."""
    from transformers import LlamaConfig
    from attention.backends.torch_sdpa import write_kv
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=64)
    rotary = rotary_module.RotaryEmbedding(config, 64).to(DEVICE)
    g = torch.Generator().manual_seed(head_dim + heads)
    tokens, block_size, num_blocks = 6, 4, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))   # strided views, as in the model
    positions = torch.tensor([0, 5, 17, 3, 63, 0]).to(DEVICE)
    slots = torch.tensor([2, 19, 7, -1, 12, -1]).to(DEVICE)          # two padded rows
    sentinel = torch.full((2, num_blocks, block_size, kv_heads, head_dim), 7.0)
    cache = sentinel.clone().to(DEVICE, dtype)
    expected = sentinel.clone().to(DEVICE, dtype)

    q_rot = fused_kernels.rope_and_cache(positions, q, k, v, rotary.cos_sin_cache, cache, slots)

    q_ref, k_ref = rotary.reference(positions, q, k)
    write_kv(k_ref, v, expected, slots)
    _close(q_rot, q_ref, dtype)
    _close(cache, expected, dtype)
    assert (cache.float() == 7.0).sum() == (expected.float() == 7.0).sum()  # padded rows left the cache alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 24), (16, 8, 128)])
def test_rope_and_cache_with_qk_norm_equals_the_norm_kernel_then_rope(dtype, heads, kv_heads, head_dim):
    """Qwen3's q/k norms inside the RoPE + KV-write launch: what `add_rms_norm` on each head followed
    by `rope_and_cache` gives (the same rounding points; the float32 sum of squares may be ordered
    otherwise, as the two kernels lay the head out differently), and close to the torch reference
    (RMSNorm.reference, then RotaryEmbedding.reference)."""
    from transformers import LlamaConfig
    from attention.backends.torch_sdpa import write_kv
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=64)
    rotary = rotary_module.RotaryEmbedding(config, 64).to(DEVICE)
    g = torch.Generator().manual_seed(head_dim + 3 * heads)
    tokens, block_size, num_blocks, eps = 6, 4, 5, 1e-6
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))   # strided views, as in the model
    q_norm, k_norm = layers.RMSNorm(head_dim, eps).to(DEVICE, dtype), layers.RMSNorm(head_dim, eps).to(DEVICE, dtype)
    q_norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
    k_norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 17, 3, 63, 0]).to(DEVICE)
    slots = torch.tensor([2, 19, 7, -1, 12, -1]).to(DEVICE)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), 7.0).to(DEVICE, dtype)
    two_step_cache = cache.clone()

    got_q = fused_kernels.rope_and_cache(positions, q, k, v, rotary.cos_sin_cache, cache, slots,
                                         (q_norm.weight, k_norm.weight, eps))

    normed_q = fused_kernels.add_rms_norm(q.reshape(-1, head_dim), q_norm.weight, eps).view(q.shape)
    normed_k = fused_kernels.add_rms_norm(k.reshape(-1, head_dim), k_norm.weight, eps).view(k.shape)
    two_step_q = fused_kernels.rope_and_cache(positions, normed_q, normed_k, v, rotary.cos_sin_cache,
                                              two_step_cache, slots)
    _close(got_q, two_step_q, dtype)
    _close(cache, two_step_cache, dtype)

    with torch.no_grad():
        ref_q, ref_k = rotary.reference(positions, q_norm.reference(q), k_norm.reference(k))
    expected = torch.full_like(cache, 7.0)
    write_kv(ref_k, v, expected, slots)
    _close(got_q, ref_q, dtype)
    _close(cache, expected, dtype)


def test_rope_and_cache_refuses_norm_weights_of_another_width():
    q = torch.zeros(1, 2, 16, device=DEVICE)
    k = v = torch.zeros(1, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 1, 4, 1, 16, device=DEVICE)
    rotary_table = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="norm weights"):
        fused_kernels.rope_and_cache(torch.zeros(1, dtype=torch.long, device=DEVICE), q, k, v, rotary_table, cache,
                                     torch.zeros(1, dtype=torch.long, device=DEVICE),
                                     (torch.ones(8, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6))
