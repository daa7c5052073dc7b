"""The long-context attention paths on a GPU at real sizes: split-KV decode at 32k contexts, the
prefill tiles on prefix-cached chunks, against a float32 torch reference, and split-KV decode
captured in a CUDA graph and replayed with new metadata against the same launch run eagerly.

Llama-3.2-1B attention (32 query heads, 8 KV heads, head_dim 64) and Llama-3-8B's (head_dim 128),
bf16, KV blocks scattered through the cache (never contiguous), ragged batches with padding.
"""

from __future__ import annotations

import pytest
import torch

from attention.kernels import unified_attention as ua
from tests.paged_batch import make_batch

pytestmark = pytest.mark.cuda

SHAPES = {"llama-3.2-1b": (32, 8, 64), "llama-3-8b": (32, 8, 128)}


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def batch(query_lens, context_lens, shape="llama-3.2-1b", pad_tokens=2, pad_reqs=1, seed=0):
    hq, hkv, d = SHAPES[shape]
    return make_batch(query_lens, context_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16,
                      dtype=torch.bfloat16, pad_tokens=pad_tokens, pad_reqs=pad_reqs, seed=seed, device="cuda")


def reference(b, window=None, soft_cap=None) -> torch.Tensor:
    """float32 on the GPU, one request at a time, K/V gathered through the block table."""
    hq, hkv = b.query.shape[1], b.kv_cache.shape[3]
    block_size = b.kv_cache.shape[2]
    out = torch.zeros(b.query.shape, dtype=torch.float32, device="cuda")
    qsl, seq_lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for r, seq_len in enumerate(seq_lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        pos = torch.arange(seq_len, device="cuda")
        blocks = b.block_table[r, pos // block_size].long()
        k = b.kv_cache[0, blocks, pos % block_size].float().repeat_interleave(hq // hkv, dim=1)
        v = b.kv_cache[1, blocks, pos % block_size].float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", b.query[start:end].float(), k) * b.scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = seq_len - (end - start) + torch.arange(end - start, device="cuda")
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def attend(b, **kwargs) -> torch.Tensor:
    out = torch.full_like(b.query, float("nan"))
    ua.unified_attention(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale, **kwargs)
    return out


def check(b, out, window=None, soft_cap=None) -> None:
    actual = b.num_actual_tokens
    assert torch.isfinite(out).all(), "a row was left unwritten"
    assert (out[actual:] == 0).all(), "padded token rows must be zeroed"
    torch.testing.assert_close(out[:actual].float(), reference(b, window, soft_cap)[:actual], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window,soft_cap", [(None, None), (4096, None), (None, 30.0)])
def test_split_kv_decode_at_32k_matches_the_reference(shape, window, soft_cap):
    """Batch 1 at 32k takes MAX_SPLITS splits (graph launch: no max_seq_len), a ragged batch fewer."""
    b = batch([1], [32767], shape, seed=1)
    check(b, attend(b, sliding_window=window, soft_cap=soft_cap), window, soft_cap)
    ragged = batch([1] * 5, [32000, 17, 9000, 1, 20480], shape, seed=2)
    check(ragged, attend(ragged, sliding_window=window, soft_cap=soft_cap), window, soft_cap)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prefill_tiles", [True, False])
def test_prefix_cached_chunks_and_decodes_in_one_launch(shape, prefill_tiles):
    """A chunk of a long prompt on its cached prefix, a fresh prompt, a short suffix on a cached
    prefix, and long-context decodes, with either tile shape."""
    b = batch([1024, 300, 1, 17, 1], [7000, 0, 15000, 4000, 33], shape, seed=3)
    check(b, attend(b, prefill_tiles=prefill_tiles, max_query_len=1024, max_seq_len=15001))
    windowed = attend(b, prefill_tiles=prefill_tiles, sliding_window=1000, soft_cap=20.0)
    check(b, windowed, 1000, 20.0)


def test_short_suffix_on_a_long_prefix_splits_with_the_prefill_tiles():
    b = batch([40], [30000], seed=4)
    plan = ua._plan(b.query, b.kv_cache, b.query, b.query_start_loc, b.seq_lens, b.block_table, b.scale, None,
                    30040, max_query_len=40)
    assert plan.args[16] > 1 and plan.merge is not None   # num_splits, and the merge kernel
    check(b, attend(b, max_seq_len=30040, max_query_len=40))


@pytest.mark.parametrize("num_reqs", [1, 4])
def test_full_graph_split_decode_replays_like_the_eager_launch(num_reqs, kernel_switches):
    """Capture split-KV decode once (split count from the padded shape, partials in the persistent
    scratch, the merge kernel: KernelConfig.fused_merge auto); replay with contexts from 1 to 40k
    and compare with the same launch run eagerly with the merge kernel (bit for bit: same splits,
    same merge), with the eager default (the in-kernel merge: same up to rounding) and with the
    reference."""
    steps = [[40000, 5, 1, 12345][:num_reqs], [1, 30000, 777, 2][:num_reqs], [16384, 16383, 3, 64][:num_reqs]]
    b = batch([1] * num_reqs, [40000] * num_reqs, pad_tokens=0, pad_reqs=0, seed=5)   # room for every step
    hq, hkv, d = SHAPES["llama-3.2-1b"]
    blocks = b.kv_cache.shape[1]
    out = torch.empty_like(b.query)
    splits = ua.default_num_splits(num_reqs, num_reqs, hkv, torch.device("cuda"))
    assert splits > 1

    def run():
        ua.unified_attention(b.query, b.kv_cache, out, b.query_start_loc, b.seq_lens, b.block_table, b.scale)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator().manual_seed(6)
    for contexts in steps:
        per_req = blocks // num_reqs
        table = torch.randperm(blocks, generator=gen)[: per_req * num_reqs].view(num_reqs, per_req)
        b.block_table[:, :per_req].copy_(table[:, : b.block_table.shape[1]].to(torch.int32))
        b.seq_lens.copy_(torch.tensor(contexts, dtype=torch.int32) + 1)
        b.query.copy_(torch.randn(b.query.shape, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        kernel_switches(fused_merge=False)
        assert torch.equal(replayed, attend(b, num_splits=splits))
        kernel_switches(fused_merge=None)
        torch.testing.assert_close(replayed.float(), attend(b, num_splits=splits).float(), atol=1e-2, rtol=1e-2)
        check(b, replayed)
    assert all(int(t.abs().sum()) == 0 for t in ua._tickets.values())
