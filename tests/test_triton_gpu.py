"""The Triton paged-attention kernels at real sizes on a GPU, and inside a CUDA graph.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16, against a float32
torch reference. The graph test is the point of the kernel's design: one capture, replayed with
different seq_lens / query_start_loc / block_table contents of the same padded shapes.
"""

from __future__ import annotations

import pytest
import torch

from attention.kernels.kv_write import write_kv
from attention.kernels.unified_attention import default_num_splits, unified_attention

pytestmark = pytest.mark.cuda

HQ, HKV, D = 32, 8, 128


class Batch:
    """Persistent-style tensors for `num_reqs` request rows / `num_tokens` token rows, filled by `fill`."""

    def __init__(self, num_tokens: int, num_reqs: int, max_blocks: int, num_blocks: int, block_size: int,
                 dtype=torch.bfloat16) -> None:
        dev = "cuda"
        self.block_size = block_size
        self.kv_cache = torch.randn(2, num_blocks, block_size, HKV, D, device=dev).to(dtype)
        self.query = torch.randn(num_tokens, HQ, D, device=dev).to(dtype)
        self.key = torch.randn(num_tokens, HKV, D, device=dev).to(dtype)
        self.value = torch.randn(num_tokens, HKV, D, device=dev).to(dtype)
        self.out = torch.empty_like(self.query)
        self.query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        self.scale = D ** -0.5

    def fill(self, query_lens: list[int], context_lens: list[int], seed: int) -> None:
        """Copy a new step's metadata in place (as the model runner does before a replay)."""
        gen = torch.Generator().manual_seed(seed)
        num_reqs, bs = self.seq_lens.shape[0], self.block_size
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)] + [0] * (num_reqs - len(query_lens))
        perm = torch.randperm(self.kv_cache.shape[1], generator=gen)
        table = torch.zeros_like(self.block_table, device="cpu")
        used = 0
        for r, s in enumerate(seq_lens):
            n = -(-s // bs)
            table[r, :n] = perm[used:used + n]
            used += n
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:len(query_lens) + 1] = torch.tensor(query_lens).cumsum(0)
        qsl[len(query_lens) + 1:] = sum(query_lens)
        slots = torch.full_like(self.slot_mapping, -1, device="cpu")
        for r, (c, q) in enumerate(zip(context_lens, query_lens)):
            pos = torch.arange(c, c + q)
            slots[int(qsl[r]):int(qsl[r + 1])] = table[r, pos // bs].long() * bs + pos % bs
        self.block_table.copy_(table)
        self.query_start_loc.copy_(qsl)
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.slot_mapping.copy_(slots)
        self.query.copy_(torch.randn(self.query.shape, generator=gen))
        self.key.copy_(torch.randn(self.key.shape, generator=gen))
        self.value.copy_(torch.randn(self.value.shape, generator=gen))

    def run(self, num_splits: int | None = None) -> None:
        write_kv(self.key, self.value, self.kv_cache, self.slot_mapping)
        unified_attention(self.query, self.kv_cache, self.out, self.query_start_loc, self.seq_lens,
                          self.block_table, self.scale, num_splits=num_splits)

    def reference(self) -> torch.Tensor:
        """float32, per request, K/V gathered through the block table (after this step's write)."""
        out = torch.zeros(self.query.shape, dtype=torch.float32, device="cuda")
        qsl, seq_lens = self.query_start_loc.tolist(), self.seq_lens.tolist()
        for r, seq_len in enumerate(seq_lens):
            start, end = qsl[r], qsl[r + 1]
            if end == start:
                continue
            pos = torch.arange(seq_len, device="cuda")
            blocks = self.block_table[r, pos // self.block_size].long()
            k = self.kv_cache[0, blocks, pos % self.block_size].float().repeat_interleave(HQ // HKV, dim=1)
            v = self.kv_cache[1, blocks, pos % self.block_size].float().repeat_interleave(HQ // HKV, dim=1)
            q = self.query[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = seq_len - (end - start) + torch.arange(end - start, device="cuda")
            scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
        return out

    def check(self) -> None:
        num_actual = int(self.query_start_loc[-1])
        assert torch.isfinite(self.out).all()
        assert (self.out[num_actual:] == 0).all()
        torch.testing.assert_close(self.out[:num_actual].float(), self.reference()[:num_actual],
                                   atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_bs32_ctx4096(num_splits):
    batch = Batch(32, 32, max_blocks=256, num_blocks=32 * 256 + 8, block_size=16)
    context = torch.randint(1, 4096, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    context[0] = 4095
    batch.fill([1] * 32, context, seed=1)
    batch.out.fill_(float("nan"))
    batch.run(num_splits)
    batch.check()


def test_prefill_two_requests_of_1000():
    batch = Batch(2000, 2, max_blocks=63, num_blocks=140, block_size=16)
    batch.fill([1000, 1000], [0, 0], seed=2)
    batch.out.fill_(float("nan"))
    batch.run()
    batch.check()


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_with_padding(block_size):
    """Chunked prefill on a cached prefix, fresh prefill, decodes, padded tokens and requests."""
    batch = Batch(600, 8, max_blocks=4096 // block_size, num_blocks=8 * 4096 // block_size, block_size=block_size)
    batch.fill([300, 1, 200, 1, 1, 40], [1500, 3000, 0, 17, 4000, 64], seed=3)
    batch.out.fill_(float("nan"))
    batch.run()
    batch.check()


GRAPH_CASES = {   # (padded tokens, padded requests): steps of (query lens, context lens) replayed in turn
    (32, 32): [([1] * 32, [100 * i + 1 for i in range(32)]), ([1] * 20, [2000 - 50 * i for i in range(20)]),
               ([5, 1, 1], [0, 1000, 17])],
    (128, 8): [([100, 1, 1, 1], [0, 2000, 5, 99]), ([1] * 8, [1900] * 8), ([64, 64], [1000, 0])],
    (512, 4): [([300, 1, 100], [0, 1000, 50]), ([1] * 4, [4000, 3, 100, 2000]), ([512], [1000])],
}


@pytest.mark.parametrize("num_tokens,num_reqs", list(GRAPH_CASES))
def test_cuda_graph_replays_new_metadata(num_tokens, num_reqs):
    """Capture write_kv + unified_attention once; replay after refilling the metadata in place.
    The two small shapes take the split-KV path (default_num_splits > 1), the large one does not."""
    batch = Batch(num_tokens, num_reqs, max_blocks=256, num_blocks=num_reqs * 256 + 4, block_size=16)
    steps = GRAPH_CASES[(num_tokens, num_reqs)]
    assert (default_num_splits(num_tokens, num_reqs, HKV, torch.device("cuda")) > 1) == (num_tokens <= 128)
    batch.fill(*steps[0], seed=10)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        batch.run()                                  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch.run()
    for i, (query_lens, context_lens) in enumerate(steps):
        batch.fill(query_lens, context_lens, seed=20 + i)
        batch.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        batch.check()


@pytest.mark.parametrize("num_splits", [1, 8])
def test_fast_launch_matches_triton_launch(num_splits, monkeypatch, kernel_switches):
    """launch/fast_launch.py: relaunching the compiled kernel directly gives the same bits
    as Triton's own launch path, on the current stream, and a new specialisation (a misaligned
    query view) compiles/launches through Triton again instead of reusing the wrong kernel."""
    from attention.kernels import unified_attention as ua
    batch = Batch(8, 8, max_blocks=64, num_blocks=8 * 64 + 4, block_size=16)
    batch.fill([1] * 8, [900 + 7 * i for i in range(8)], seed=4)
    write_kv(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)

    def attend():
        batch.out.fill_(float("nan"))
        unified_attention(batch.query, batch.kv_cache, batch.out, batch.query_start_loc, batch.seq_lens,
                          batch.block_table, batch.scale, num_splits=num_splits)
        torch.cuda.synchronize()
        return batch.out.clone()

    from launch import fast_launch
    kernel_switches(fast_launch=False)
    expected = attend()
    kernel_switches(fast_launch=True)
    attend()                                          # records the compiled kernel for this key
    before = ua._attention_launch.fast_launches
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got_side = attend()
    got = attend()
    assert ua._attention_launch.fast_launches >= before + 2
    assert torch.equal(got, expected) and torch.equal(got_side, expected)
    batch.check()

    storage = torch.empty(batch.query.numel() + 8, dtype=batch.query.dtype, device="cuda")
    shifted = storage[1:1 + batch.query.numel()].view(batch.query.shape)   # 2 bytes past 16-byte alignment
    shifted.copy_(batch.query)
    keys = len(ua._attention_launch.compiled)
    out = torch.full_like(batch.out, float("nan"))
    for _ in range(2):
        unified_attention(shifted, batch.kv_cache, out, batch.query_start_loc, batch.seq_lens,
                          batch.block_table, batch.scale, num_splits=num_splits)
    torch.cuda.synchronize()
    assert len(ua._attention_launch.compiled) == keys + 1
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_in_kernel_split_merge_is_race_free_under_repetition(monkeypatch, kernel_switches):
    """The last-arrival merge (attention/kernels/unified_attention.py, FUSED_MERGE) read against
    the separate merge kernel, 200 launches in a row and inside a replayed graph: a missing
    release/acquire between the split programs would show as a mismatch in some launch. Contexts
    of 580-1000 tokens with 16 splits of at least MIN_SPLIT_TILES tiles: 3-4 active splits merge."""
    from attention.kernels import unified_attention as ua
    batch = Batch(8, 8, max_blocks=64, num_blocks=8 * 64 + 4, block_size=16)
    batch.fill([1] * 8, [1000 - 60 * i for i in range(8)], seed=7)
    write_kv(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)

    def attend(out):
        unified_attention(batch.query, batch.kv_cache, out, batch.query_start_loc, batch.seq_lens,
                          batch.block_table, batch.scale, num_splits=16)

    kernel_switches(fused_merge=False)
    expected = torch.empty_like(batch.out)
    attend(expected)
    kernel_switches(fused_merge=True)
    outs = [torch.full_like(batch.out, float("nan")) for _ in range(200)]
    for out in outs:
        attend(out)
    torch.cuda.synchronize()
    worst = max((out.float() - expected.float()).abs().max().item() for out in outs)
    assert worst < 2e-2, worst                        # bf16 rounding of two merge orders, never garbage
    assert all(int(t.abs().sum()) == 0 for t in ua._tickets.values())

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph_out = torch.full_like(batch.out, float("nan"))
    with torch.cuda.stream(stream):
        attend(graph_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(graph_out)
    for _ in range(50):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert (graph_out.float() - expected.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (1, 128256), (3, 1000), (32, 49152), (300, 32000)])
def test_gpu_argmax_equals_torch(rows, vocab):
    from runner.greedy import argmax_rows
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, vocab, device="cuda", generator=g).to(torch.bfloat16)
    x[0, vocab // 2] = x[0, vocab - 3] = 30.0        # a tie: the first wins
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.float()), x.float().argmax(dim=-1))


def test_step_graph_equals_unified_attention_per_layer():
    """The PIECEWISE step graph (runner/cudagraph/step_graph.py) on four layers: five kept segment
    graphs and four attention nodes in one CUDA graph, over two steps: contexts (40, 20, 7), then
    (3000, 1500, 7), whose launch differs (split KV), so the nodes are re-parameterised. Segment i
    copies layer i-1's output: a node out of order or with a wrong parameter shows as a mismatch
    against a full `unified_attention` call per layer."""
    from attention.kernels.unified_attention import StepAttention, interned_layer_key
    from runner.cudagraph import step_graph

    b = Batch(num_tokens=4, num_reqs=4, max_blocks=256, num_blocks=1024, block_size=16)
    caches = [torch.randn_like(b.kv_cache, dtype=torch.float32).to(b.kv_cache.dtype) for _ in range(4)]
    outs = [torch.full_like(b.query, float("nan")) for _ in caches]
    copies = [torch.full_like(b.query, float("nan")) for _ in caches]
    marker = torch.zeros(1, device="cuda")
    segments = []
    for i in range(len(caches) + 1):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            if i == 0:
                marker.add_(1)
            else:
                copies[i - 1].copy_(outs[i - 1])
        graph.instantiate()
        segments.append(graph)
    addresses = [(b.query.data_ptr(), cache.data_ptr(), out.data_ptr()) for cache, out in zip(caches, outs)]
    whole = step_graph.make_step_graph(segments, addresses)
    assert whole is not None, "the C library did not build or load here"
    key = interned_layer_key(b.query, caches[0], outs[0], b.scale)
    for number, contexts in enumerate(([40, 20, 7], [3000, 1500, 7])):
        b.fill([1, 1, 1], contexts, seed=5 + number)
        for t in outs + copies:
            t.fill_(float("nan"))
        max_seq_len = int(b.seq_lens.max())
        step = StepAttention(b.query_start_loc, b.seq_lens, b.block_table, max_seq_len)
        if not step.bind_without_launch(key, b.query, caches[0], outs[0], b.scale):
            # No compiled kernel for this launch yet: an eager call compiles it (as a Python replay would).
            unified_attention(b.query, caches[0], outs[0], b.query_start_loc, b.seq_lens, b.block_table, b.scale,
                              max_seq_len=max_seq_len)
            step = StepAttention(b.query_start_loc, b.seq_lens, b.block_table, max_seq_len)
            assert step.bind_without_launch(key, b.query, caches[0], outs[0], b.scale)
        bound = step.native_launch(key)
        assert bound is not None, "the attention launch has no driver form"
        for t in outs:
            t.fill_(float("nan"))
        whole.run(*bound)
        torch.cuda.synchronize()
        assert marker.item() == number + 1
        for cache, out, copy in zip(caches, outs, copies):
            ref = torch.full_like(b.query, float("nan"))
            unified_attention(b.query, cache, ref, b.query_start_loc, b.seq_lens, b.block_table, b.scale,
                              max_seq_len=max_seq_len)
            assert torch.equal(out, ref) and torch.equal(copy, ref), f"step {number}"
    assert whole.runs == 2 and whole.updates == 1


@pytest.mark.parametrize("context", [40, 3000], ids=["one-split", "splits"])
def test_step_attention_equals_unified_attention_per_layer(context):
    """Four layers of one eager step (different KV caches, the same metadata): the bound relaunches
    (tensors, or addresses as a PIECEWISE break passes them) compute bit for bit what a full
    `unified_attention` call per layer does, split KV included."""
    from attention.kernels.unified_attention import StepAttention, layer_key

    b = Batch(num_tokens=4, num_reqs=4, max_blocks=256, num_blocks=1024, block_size=16)
    b.fill([1, 1, 1], [context, context // 2, 7], seed=3)
    caches = [torch.randn_like(b.kv_cache, dtype=torch.float32).to(b.kv_cache.dtype) for _ in range(4)]
    max_seq_len = int(b.seq_lens.max())
    step = StepAttention(b.query_start_loc, b.seq_lens, b.block_table, max_seq_len)
    got, want = [], []
    for index, cache in enumerate(caches):
        out = torch.full_like(b.query, float("nan"))
        if index % 2:   # a PIECEWISE break's call: addresses computed once
            key = layer_key(b.query, cache, out, b.scale)
            step.call_addressed(key, (b.query.data_ptr(), cache.data_ptr(), out.data_ptr()), b.query, cache, out, b.scale)
        else:
            step(b.query, cache, out, b.scale)
        got.append(out)
        ref = torch.full_like(b.query, float("nan"))
        unified_attention(b.query, cache, ref, b.query_start_loc, b.seq_lens, b.block_table, b.scale,
                          max_seq_len=max_seq_len)
        want.append(ref)
    torch.cuda.synchronize()
    assert step.relaunches == 3
    for g, w in zip(got, want):
        assert torch.equal(g, w)
