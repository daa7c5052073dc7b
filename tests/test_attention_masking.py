"""Sliding windows and logit soft-capping in the torch attention backend (the reference the Triton
kernel is held to in tests/test_triton_kernels.py), against the float64 reference of
tests/paged_batch.py: mixed batches over the paged cache, pure decode (GQA folded), the no-cache
prefill path, and the C decode kernel declining such layers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from attention.backends.torch_sdpa import TorchSDPABackend
from attention.metadata import CommonAttentionMetadata
from attention.backends import cpu_decode_attention
from tests.paged_batch import make_batch, reference_attention

CASES = [(5, None), (None, 2.0), (7, 1.5), (1, None)]
IDS = ["window", "softcap", "window+softcap", "window1"]


def _common(b, query_lens: list[int], pad_tokens: int = 0) -> CommonAttentionMetadata:
    reqs = len(query_lens)
    qsl, seq_lens = b.query_start_loc, b.seq_lens
    rows = torch.repeat_interleave(torch.arange(reqs, dtype=torch.int32), torch.tensor(query_lens))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=seq_lens - qsl.diff(), block_table=b.block_table, slot_mapping=b.slot_mapping,
        token_request_index=torch.cat([rows, torch.full((pad_tokens,), -1, dtype=torch.int32)]), num_reqs=reqs,
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        uniform_decode=max(query_lens) == 1)


def _run(b, query_lens, window, soft_cap, pad_tokens=0, seed=0):
    """Write this step's random k/v through the backend, attend; (out, the reference on the written cache)."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = b.kv_cache.shape[3], b.kv_cache.shape[4]
    key, value = (torch.randn(b.query.shape[0], num_kv_heads, head_dim, generator=gen) for _ in range(2))
    layer = SimpleNamespace(num_heads=b.query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
                            scale=b.scale, sliding_window=window, logits_soft_cap=soft_cap)
    backend = TorchSDPABackend()
    metadata = backend.build_metadata(_common(b, query_lens, pad_tokens))
    cache, out = b.kv_cache.clone(), torch.full_like(b.query, float("nan"))
    with torch.inference_mode():
        backend.forward(layer, b.query, key, value, out, cache, metadata)
    written = dataclasses.replace(b, kv_cache=cache)
    return out, reference_attention(written, window, soft_cap), metadata


@pytest.mark.parametrize("window,soft_cap", CASES, ids=IDS)
def test_mixed_batch_over_the_cache(window, soft_cap):
    query_lens = [1, 9, 4, 1, 30]
    b = make_batch(query_lens, [50, 0, 20, 0, 3], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                   pad_tokens=3, seed=7)
    b.query *= 4
    out, ref, _ = _run(b, query_lens, window, soft_cap, pad_tokens=3)
    actual = sum(query_lens)
    assert (out[actual:] == 0).all()
    torch.testing.assert_close(out[:actual].double(), ref[:actual], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref[:actual], reference_attention(b)[:actual], atol=1e-3)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "c-kernel-allowed"])
@pytest.mark.parametrize("window,soft_cap", CASES, ids=IDS)
def test_decode_step_and_the_c_kernel_declines(window, soft_cap, native, monkeypatch):
    """A pure decode step (GQA folded into the query rows); where the C decode kernel would serve
    the step, a layer with a window or soft-cap takes the torch path instead (the C kernel has
    neither), so the answer is the reference's either way."""
    monkeypatch.setattr(cpu_decode_attention, "native_attention", lambda: native)
    query_lens = [1, 1, 1]
    b = make_batch(query_lens, [40, 7, 100], num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=16, seed=3)
    b.query *= 4
    out, ref, metadata = _run(b, query_lens, window, soft_cap)
    assert not any(layout.native_decode for layout in metadata.layouts.values())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", CASES + [(None, None)], ids=IDS + ["plain"])
def test_prefill_without_cache(window, soft_cap):
    """The profile run / no-cache path: causal within each request's own tokens (plain layers take
    SDPA's is_causal, with GQA, over requests of unequal length and an empty one), windowed, capped."""
    gen = torch.Generator().manual_seed(5)
    qsl = torch.tensor([0, 12, 12, 19], dtype=torch.int32)
    query = torch.randn(21, 4, 16, generator=gen) * 4
    key, value = torch.randn(21, 2, 16, generator=gen), torch.randn(21, 2, 16, generator=gen)
    lens = qsl.diff()
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=lens,
        num_computed_tokens_cpu=torch.zeros(3, dtype=torch.int32), block_table=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.full((21,), -1), token_request_index=torch.tensor([0] * 12 + [2] * 7 + [-1] * 2),
        num_reqs=3, num_actual_tokens=19, max_query_len=12, max_seq_len=12, uniform_decode=False)
    layer = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, sliding_window=window,
                            logits_soft_cap=soft_cap)
    backend = TorchSDPABackend()
    out = torch.full_like(query, float("nan"))
    backend.forward(layer, query, key, value, out, None, backend.build_metadata(common))
    assert (out[19:] == 0).all()
    for start, end in ((0, 12), (12, 19)):
        for i in range(end - start):
            first = 0 if window is None else max(0, i - window + 1)
            for h in range(4):
                k, v = key[start + first:start + i + 1, h // 2].double(), value[start + first:start + i + 1, h // 2].double()
                scores = k @ query[start + i, h].double() * 0.25
                if soft_cap is not None:
                    scores = torch.tanh(scores / soft_cap) * soft_cap
                torch.testing.assert_close(out[start + i, h].double(), torch.softmax(scores, 0) @ v, atol=1e-5, rtol=1e-5)
