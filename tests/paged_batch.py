"""Random paged-attention batches and a float64 reference, shared by the attention kernels' tests
(tests/test_triton_kernels.py: Triton; tests/test_cpu_kernels.py: the C decode kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """Random requests laid out in a shuffled paged cache, plus padding rows/requests."""
    query: torch.Tensor          # [T, Hq, D]
    kv_cache: torch.Tensor       # [2, NB, BS, Hkv, D]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    scale: float


def make_batch(query_lens: list[int], context_lens: list[int], *, num_q_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype=torch.float32, pad_tokens: int = 0,
               pad_reqs: int = 0, seed: int = 0, device: str = "cpu") -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()     # scattered, block 0 included
    block_table = torch.zeros(len(seq_lens) + pad_reqs, max_blocks, dtype=torch.int32)
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
    # Random everywhere (never zero), so stale or unread positions would change the answer.
    rand = lambda *shape: (torch.rand(*shape, generator=gen) + 0.1) * torch.where(  # noqa: E731
        torch.rand(*shape, generator=gen) < 0.5, -1.0, 1.0)
    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    num_actual = sum(query_lens)
    query = rand(num_actual + pad_tokens, num_q_heads, head_dim).to(dtype)
    qsl = torch.zeros(len(seq_lens) + pad_reqs + 1, dtype=torch.int32)
    qsl[1:len(seq_lens) + 1] = torch.tensor(query_lens).cumsum(0)
    qsl[len(seq_lens) + 1:] = num_actual
    slots = []
    for r, (c, q) in enumerate(zip(context_lens, query_lens)):
        for pos in range(c, c + q):
            slots.append(int(block_table[r, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32)
    return PagedBatch(*(t.to(device) for t in (query, kv_cache, qsl, seq_lens_t, block_table, slot_mapping)),
                      num_actual, head_dim ** -0.5)


def reference_attention(b: PagedBatch, sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """float64 on the CPU, one request at a time, K/V gathered through the block table. With
    `sliding_window` a query at position p sees keys p - window < k <= p; with `soft_cap` scores
    become cap * tanh(score / cap)."""
    b = PagedBatch(*(t.cpu() for t in (b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table,
                                       b.slot_mapping)), b.num_actual_tokens, b.scale)
    num_q_heads, num_kv_heads = b.query.shape[1], b.kv_cache.shape[3]
    block_size = b.kv_cache.shape[2]
    out = torch.zeros(b.query.shape, dtype=torch.float64)
    for r in range(b.seq_lens.shape[0]):
        start, end, seq_len = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1]), int(b.seq_lens[r])
        if end == start:
            continue
        pos = torch.arange(seq_len)
        blocks = b.block_table[r, pos // block_size].long()
        k = b.kv_cache[0, blocks, pos % block_size].double()      # [S, Hkv, D]
        v = b.kv_cache[1, blocks, pos % block_size].double()
        for i in range(end - start):
            q_pos = seq_len - (end - start) + i
            for h in range(num_q_heads):
                kh = h // (num_q_heads // num_kv_heads)
                first = 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)
                scores = k[first: q_pos + 1, kh] @ b.query[start + i, h].double() * b.scale
                if soft_cap is not None:
                    scores = torch.tanh(scores / soft_cap) * soft_cap
                out[start + i, h] = torch.softmax(scores, 0) @ v[first: q_pos + 1, kh]
    return out
