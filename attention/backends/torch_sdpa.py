"""Paged attention in plain torch: the CPU backend and the reference for the Triton one.

Vectorised over requests: queries are gathered into [num_reqs, max_query_len] and keys into
[num_reqs, max_seq_len] (whole blocks at a time, through the block table); one masked SDPA
call covers prefill with a cached prefix, chunked prefill and decode in the same batch, with
GQA handled by SDPA itself (no repeated K/V). Everything that depends only on the step (gather
indices, the mask, which rows write the cache) is built once per step, on the first layer,
and shared by every layer. A pure decode step (one query token per request, the common case)
skips the query gather and the output scatter, and folds each KV head's group of query heads
into the query-length dimension ([R, Hkv, group, D] against [R, Hkv, kv_len, D]): one small
attention per KV head instead of one per query head.

On a CPU with the C kernel (cpu_decode_attention.py beside this file: a C compiler), a pure
decode step skips all of this: each layer's KV write and attention are one C call that reads the
paged cache through the block table (`cpu_decode_attention.decode_attention`, 16 positions at a
time, requests in parallel on torch's OpenMP threads): the mask, the dense copy's upkeep and SDPA's
padded read are gone (the engine-vs-HF figure this serves: `graphrunner bench cpu`,
docs/PERFORMANCE.md).

Otherwise (prefill and mixed steps, or no C kernels), keys and values are also kept in a dense
per-layer copy ([request row, position], `_DenseKV`), so a step appends its new tokens there instead
of gathering every request's whole context out of the paged cache in every layer (the gather was the
largest cost after the matmuls; a C decode step drops the copy, which it would not keep up to
date). The paged cache stays the source of truth: a row is read from the copy only while
bookkeeping proves it equal to the cache (same slots, no write to them since), else it is
gathered again; the copy is dropped when it would exceed 1/8 of the layer's cache.
Shapes depend on max_seq_len, so FULL graphs can't hold it (support NEVER); as a PIECEWISE
break point it runs eagerly between graph segments and is fine.

Per-layer sliding windows (`layer.sliding_window`) are one more additive mask per window, built
from the step's causal mask by the first layer with that window (`_StepLayout.mask_for`); logit
soft-capping (`layer.logits_soft_cap`, which SDPA lacks) takes the explicit matmul-softmax-matmul of
HF's eager attention. The C decode kernel has neither: such layers take the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attention.backends.base import AttentionBackend, AttentionCGSupport
from attention.metadata import CommonAttentionMetadata
from attention.backends import cpu_decode_attention


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values into their slots; slot -1 (padded rows) is skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0].index_copy_(0, slots, key[valid])
    flat[1].index_copy_(0, slots, value[valid])


@dataclass
class _StepLayout:
    """Where each query and key of the step sits in the padded [request, position] grid."""
    actual: int
    num_reqs: int
    max_q: int
    decode: bool
    """Every request has exactly one query token and token r is request r's: no query gather."""
    q_index: torch.Tensor | None    # [R * max_q] token row of each query slot (0 where padded); None for decode
    out_index: torch.Tensor | None  # [actual] the query slot of each token row; None for decode
    mask: torch.Tensor              # [R, 1, max_q, kv_width] additive: 0 where causal and within seq_len, else -inf
    kv_blocks: torch.Tensor | None  # [2 * R * blocks] K then V block ids in the [2 * num_blocks] view (cache path)
    blocks: int
    kv_index: torch.Tensor | None   # [R * max_q] token rows of the step's own keys (no-cache path)
    slots: torch.Tensor | None      # slots this step writes (cache path)
    write_rows: torch.Tensor | None # token rows that write, None when all `actual` rows do
    dense: "_DenseStep | None" = None  # the dense copy's plan for this step (CPU), None: gather from the cache
    kv_width: int = 0
    """Key positions the attention reads per request: the longest seq_len with the dense copy (no
    position past it is ever unmasked, and decode attention is bound by reading K/V), whole
    blocks (blocks * block_size) when gathering from the cache."""
    native_decode: bool = False
    """A decode step over a CPU fp32 cache: each layer's attention is one C call reading the paged cache
    (attention/backends/cpu_decode_attention.decode_attention); no mask, gather indices or dense copy are built."""
    q_pos: torch.Tensor | None = None   # [R, max_q] absolute position of each query slot (where the mask is)
    allowed: torch.Tensor | None = None # [R, max_q, kv_width] causal and within seq_len (where the mask is)
    windowed: dict = field(default_factory=dict)
    """sliding window -> its additive mask (`mask_for`), built by the first layer with that window."""

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The step's mask for a layer with this sliding window (None: `mask`): a query at position
        p also loses the keys at positions <= p - window."""
        if window is None:
            return self.mask
        mask = self.windowed.get(window)
        if mask is None:
            kv_pos = torch.arange(self.allowed.shape[-1], device=self.allowed.device)
            allowed = self.allowed & (kv_pos[None, None, :] > self.q_pos[:, :, None] - window)
            mask = torch.zeros(allowed.shape, dtype=self.mask.dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
            mask = self.windowed[window] = mask[:, None].to(self.mask.device)
        return mask


@dataclass
class TorchSDPAMetadata:
    common: CommonAttentionMetadata
    layouts: dict = field(default_factory=dict)
    """(num_blocks, block_size) of the cache, or None without one -> _StepLayout, filled by the first
    layer of the step."""

    def __getattr__(self, name: str):
        """The common fields read through (`metadata.uniform_decode`); guarded so that a copy
        made without __init__ (copy, pickle) raises instead of recursing."""
        if name == "common":
            raise AttributeError(name)
        return getattr(self.common, name)


def _layout(common: CommonAttentionMetadata, kv_cache: torch.Tensor | None, device: torch.device,
            dtype: torch.dtype, dense_kv: "_DenseKV | None" = None, native: bool = False) -> _StepLayout:
    num_reqs = common.num_reqs
    qsl = common.query_start_loc_cpu[: num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = common.seq_lens_cpu[:num_reqs].long()
    actual = int(qsl[-1])
    max_q = int(query_lens.max()) if num_reqs else 0
    decode = max_q == 1 and actual == num_reqs
    if (native and decode and num_reqs and kv_cache is not None and kv_cache.device.type == "cpu"
            and kv_cache.dtype == torch.float32):
        if dense_kv is not None:
            dense_kv.reset()  # the C calls write the cache alone: the copy no longer follows it
        return _StepLayout(actual, num_reqs, max_q, decode, q_index=None, out_index=None, mask=None, kv_blocks=None,
                           blocks=0, kv_index=None, slots=None, write_rows=None, native_decode=True)
    q_cols = torch.arange(max_q)
    q_valid = q_cols[None, :] < query_lens[:, None]
    q_index = torch.where(q_valid, qsl[:-1, None] + q_cols[None, :], 0).reshape(-1)
    kv_blocks = kv_index = slots = write_rows = dense = None
    blocks = 0
    if kv_cache is not None:
        block_size, num_blocks = kv_cache.shape[2], kv_cache.shape[1]
        max_kv = int(seq_lens.max()) if num_reqs else 0
        blocks = -(-max_kv // block_size)
        max_kv = blocks * block_size
        table = common.block_table[:num_reqs, :blocks].long().reshape(-1)
        kv_blocks = torch.cat([table, table + num_blocks])  # K and V of each block in one gather
        context, kv_len = seq_lens - query_lens, seq_lens
        slots = common.slot_mapping[:actual]
        valid = slots >= 0
        if not bool(valid.all()):
            write_rows = valid.nonzero().squeeze(1)
            slots = slots[write_rows]
        if dense_kv is not None:
            dense = dense_kv.plan(common, kv_cache, num_reqs, blocks, table, context, query_lens)
        if dense is not None:
            max_kv = int(seq_lens.max())
    else:
        max_kv = max_q
        context, kv_len = torch.zeros_like(query_lens), query_lens
        kv_index = q_index.to(device)
    # The mask is built where it is used: on a GPU, a start-up's profile batch (max_num_batched_tokens
    # of prompts, no KV cache) makes a [requests, max_q, max_kv] mask of millions of entries, which the
    # host built element by element before copying it over.
    where = device if device.type == "cuda" else torch.device("cpu")
    kv_pos = torch.arange(max_kv, device=where)
    q_pos = (context[:, None] + q_cols[None, :]).to(where)
    allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < kv_len.to(where)[:, None, None])
    # Additive float mask, built once: SDPA would otherwise convert a bool mask in every layer.
    mask = torch.zeros(allowed.shape, dtype=dtype, device=where).masked_fill_(~allowed, float("-inf"))
    out_index = None if decode else q_valid.reshape(-1).nonzero().squeeze(1).to(device)
    return _StepLayout(actual, num_reqs, max_q, decode, None if decode else q_index.to(device), out_index,
                       mask[:, None].to(device), kv_blocks, blocks, kv_index, slots, write_rows, dense, max_kv,
                       q_pos=q_pos, allowed=allowed)


@dataclass
class _DenseStep:
    """This step's use of the dense copy: rows to refill from the cache, where new tokens go."""
    stale_rows: torch.Tensor        # request rows whose copy is not the cache's content: gathered again
    stale_blocks: torch.Tensor      # [2 * stale * blocks] their K then V block ids ([2 * num_blocks] view)
    write_index: torch.Tensor       # [written tokens] row * capacity_len + position of each written token
    rows: int
    length: int                     # capacity along positions (>= max_kv)


class _DenseKV:
    """Per-layer dense copies of the paged K/V, [2, rows, length, Hkv, D], for a CPU.

    Invariant: for request row r and position p with `row_slot[r, p] == s` and
    `row_epoch[r, p] == slot_epoch[s]`, every layer's copy at (r, p) equals the cache at slot s.
    Every step's writes go to both (and stamp the slots with a new epoch), a refill copies
    whole blocks from the cache, so a row is read from the copy only where that holds."""

    def __init__(self) -> None:
        self.copies: dict[int, torch.Tensor] = {}
        self.cache_ptr = None
        self.epoch = 0
        self.slot_epoch = self.row_slot = self.row_epoch = None
        self.reset_pending = False

    def reset(self) -> None:
        self.__init__()

    def plan(self, common: CommonAttentionMetadata, kv_cache: torch.Tensor, num_reqs: int, blocks: int,
             table: torch.Tensor, context: torch.Tensor, query_lens: torch.Tensor) -> _DenseStep | None:
        """Bookkeeping for one step (called once, on its first layer); None: gather instead."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        max_kv = blocks * block_size
        rows = max(num_reqs, 0 if self.row_slot is None else self.row_slot.shape[0])
        length = max(-(-max_kv // 64) * 64, 0 if self.row_slot is None else self.row_slot.shape[1])
        layer_bytes = 2 * rows * length * num_kv_heads * head_dim * kv_cache.element_size()
        cache_bytes = kv_cache.numel() * kv_cache.element_size()
        if kv_cache.device.type != "cpu" or num_reqs == 0 or layer_bytes * 8 > cache_bytes:
            self.reset()
            return None
        if (self.reset_pending or self.cache_ptr != kv_cache.data_ptr()
                or self.slot_epoch.numel() != num_blocks * block_size):
            self.reset()  # a new cache: nothing of the old copies holds
            self.cache_ptr = kv_cache.data_ptr()
            self.slot_epoch = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        if self.row_slot is None or self.row_slot.shape != (rows, length):
            grown_slot = torch.full((rows, length), -1, dtype=torch.long)
            grown_epoch = torch.full((rows, length), -2, dtype=torch.long)
            if self.row_slot is not None:
                old_rows, old_len = self.row_slot.shape
                grown_slot[:old_rows, :old_len] = self.row_slot
                grown_epoch[:old_rows, :old_len] = self.row_epoch
            self.row_slot, self.row_epoch = grown_slot, grown_epoch
        # Slots of every (row, position < max_kv) of the step, and which old positions the copy holds.
        offsets = torch.arange(block_size)
        slot_grid = (table.view(num_reqs, blocks, 1) * block_size + offsets).view(num_reqs, max_kv)
        row_slot, row_epoch = self.row_slot[:num_reqs, :max_kv], self.row_epoch[:num_reqs, :max_kv]
        held = (row_slot == slot_grid) & (row_epoch == self.slot_epoch[slot_grid])
        needed = torch.arange(max_kv)[None, :] < context[:, None]
        stale_rows = (needed & ~held).any(1).nonzero().squeeze(1)
        if stale_rows.numel():  # refilled whole from the cache: now equal to it everywhere
            row_slot[stale_rows] = slot_grid[stale_rows]
            row_epoch[stale_rows] = self.slot_epoch[slot_grid[stale_rows]]
        stale = table.view(num_reqs, blocks)[stale_rows].reshape(-1)
        # This step's tokens: written to both, under a new epoch.
        self.epoch += 1
        slots = common.slot_mapping[: int(query_lens.sum())]
        token_rows = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        positions = context[token_rows] + (torch.arange(slots.numel()) - torch.repeat_interleave(
            torch.cumsum(query_lens, 0) - query_lens, query_lens))
        written = slots >= 0
        token_rows, positions, slots = token_rows[written], positions[written], slots[written]
        self.slot_epoch[slots] = self.epoch
        self.row_slot[token_rows, positions] = slots
        self.row_epoch[token_rows, positions] = self.epoch
        return _DenseStep(stale_rows, torch.cat([stale, stale + num_blocks]), token_rows * length + positions,
                          rows, length)

    def keys_values(self, step: _DenseStep, kv_cache: torch.Tensor, new_kv: torch.Tensor | None, num_reqs: int,
                    max_kv: int, kv_blocks: torch.Tensor):
        """This layer's copy brought up to date; [R, max_kv, Hkv, D] views of its K and V."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        copy = self.copies.get(kv_cache.data_ptr())
        refill_rows, refill_blocks = step.stale_rows, step.stale_blocks
        if copy is None or copy.shape[1:3] != (step.rows, step.length):
            grown = torch.zeros(2, step.rows, step.length, num_kv_heads, head_dim, dtype=kv_cache.dtype)
            if copy is not None:  # grown: what it held still holds
                grown[:, : copy.shape[1], : copy.shape[2]] = copy
            else:  # new for this layer: every row from the cache
                refill_rows, refill_blocks = torch.arange(num_reqs), kv_blocks
                # Positions past this step's max_kv are not refilled, yet the shared bookkeeping may
                # vouch for them (a layer's cache replaced alone): start over next step.
                self.reset_pending = self.epoch > 1
            copy = self.copies[kv_cache.data_ptr()] = grown
        if refill_rows.numel():
            blocks = refill_blocks.numel() // (2 * refill_rows.numel())
            gathered = kv_cache.view(-1, block_size, num_kv_heads, head_dim).index_select(0, refill_blocks)
            gathered = gathered.view(2, refill_rows.numel(), blocks * block_size, num_kv_heads, head_dim)
            copy[:, :, : blocks * block_size].index_copy_(1, refill_rows, gathered)
        if step.write_index.numel():
            copy.view(2, -1, num_kv_heads, head_dim).index_copy_(1, step.write_index, new_kv)
        return copy[0, :num_reqs, :max_kv], copy[1, :num_reqs, :max_kv]


def _key_value(key: torch.Tensor, value: torch.Tensor, rows: int, write_rows: torch.Tensor | None) -> torch.Tensor:
    """[2, written, Hkv, D]: this step's keys then values of the rows that write, as a view when
    value directly follows key in the same rows (both split from one qkv projection)."""
    if (key.stride() == value.stride() and key.stride(2) == 1 and key.stride(1) == key.shape[2]
            and value.data_ptr() == key.data_ptr() + key.shape[1] * key.shape[2] * key.element_size()
            and key.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()):
        both = key.as_strided((key.shape[0], 2, *key.shape[1:]), (key.stride(0), key.shape[1] * key.shape[2],
                                                                    *key.stride()[1:]))
        both = both[:rows] if write_rows is None else both.index_select(0, write_rows)
        return both.transpose(0, 1)
    if write_rows is None:
        return torch.stack([key[:rows], value[:rows]])
    return torch.stack([key.index_select(0, write_rows), value.index_select(0, write_rows)])


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                           soft_cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v, HF Gemma 2's eager attention step for
    step (softmax in float32); SDPA has no soft-cap. q [..., Q, D], k/v [..., K, D], mask [..., Q, K]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class TorchSDPABackend(AttentionBackend):
    name = "torch"
    cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, dense_kv: bool = True) -> None:
        """`dense_kv`: keep the dense K/V copy (KernelConfig.torch_dense_kv); False: gather from the cache."""
        self.dense_kv = _DenseKV() if dense_kv else None

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        return TorchSDPAMetadata(common)

    def forward(self, layer, query, key, value, out, kv_cache, metadata) -> None:
        if not isinstance(metadata, TorchSDPAMetadata):
            metadata = TorchSDPAMetadata(metadata)
        layout_key = None if kv_cache is None else (kv_cache.shape[1], kv_cache.shape[2])
        layout = metadata.layouts.get(layout_key)
        window, soft_cap = getattr(layer, "sliding_window", None), getattr(layer, "logits_soft_cap", None)
        plain = window is None and soft_cap is None   # what the C decode kernel computes
        if layout is None:   # the C decode kernel is a CPU's: a GPU never builds or loads it
            native = query.device.type == "cpu" and cpu_decode_attention.native_attention()
            layout = metadata.layouts[layout_key] = _layout(metadata.common, kv_cache, query.device, query.dtype,
                                                            self.dense_kv, native=plain and native)
        actual = layout.actual
        if layout.native_decode and not plain:
            # The C kernel has no window or soft-cap: this layer, and the rest of the step, take torch.
            layout = metadata.layouts[layout_key] = _layout(metadata.common, kv_cache, query.device, query.dtype,
                                                            self.dense_kv)
        if layout.native_decode:
            common = metadata.common
            if actual < out.shape[0]:
                out[actual:].zero_()
            if cpu_decode_attention.decode_attention(query[:actual], key, value, kv_cache, common.block_table,
                                                     common.seq_lens_cpu, common.slot_mapping, layer.scale,
                                                     out[:actual]):
                return
            # This layer's tensors do not fit the kernel: the torch path, for the rest of the step too.
            layout = metadata.layouts[layout_key] = _layout(metadata.common, kv_cache, query.device, query.dtype,
                                                            self.dense_kv)
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        new_kv = None
        if kv_cache is not None and layout.slots.numel():
            new_kv = _key_value(key, value, actual, layout.write_rows)   # [2, written, Hkv, D]
            kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, layout.slots, new_kv)
        if actual < out.shape[0]:
            out[actual:].zero_()
        if actual == 0:
            return
        num_reqs, max_q, group = layout.num_reqs, layout.max_q, layer.num_heads // num_kv_heads
        # index_select on flattened indices: about twice as fast on a CPU as advanced indexing.
        if layout.dense is not None:
            k, v = self.dense_kv.keys_values(layout.dense, kv_cache, new_kv, num_reqs, layout.kv_width,
                                             layout.kv_blocks)
            k, v = k.transpose(1, 2), v.transpose(1, 2)                          # [R, Hkv, max_kv, D]
        elif kv_cache is not None:
            kv = kv_cache.view(-1, *kv_cache.shape[2:]).index_select(0, layout.kv_blocks)
            kv = kv.view(2, num_reqs, layout.blocks * kv_cache.shape[2], num_kv_heads, head_dim)
            k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)                # [R, Hkv, max_kv, D]
        else:
            shape = (num_reqs, max_q, num_kv_heads, head_dim)
            k = key.index_select(0, layout.kv_index).view(shape).transpose(1, 2)
            v = value.index_select(0, layout.kv_index).view(shape).transpose(1, 2)
        mask = layout.mask_for(window)
        if layout.decode:
            # GQA folded: a KV head's `group` query heads are its query rows; one mask row serves all.
            q = query[:actual].unflatten(1, (num_kv_heads, group))                # [R, Hkv, group, D]
            if soft_cap is None:
                result = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale)
            else:
                result = _soft_capped_attention(q, k, v, mask, layer.scale, soft_cap)
            out[:actual].unflatten(1, (num_kv_heads, group)).copy_(result)
            return
        q = query.index_select(0, layout.q_index).view(num_reqs, max_q, layer.num_heads, head_dim)
        if soft_cap is None and window is None and kv_cache is None:
            # No cache (a start-up's profile batch): each request's keys are its own tokens from
            # position 0, so for every real query row the mask is the causal one (padded rows are
            # dropped). is_causal lets SDPA take a fused kernel; with an explicit mask a GPU takes
            # the math path, which materialises [R, Hq, max_q, max_q] scores.
            result = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=layer.scale,
                                                    enable_gqa=group != 1)     # [R, Hq, max_q, D]
        elif soft_cap is None:
            result = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=layer.scale,
                                                    enable_gqa=group != 1)     # [R, Hq, max_q, D]
        else:   # GQA as [R, Hkv, group * max_q] query rows against each KV head's keys
            q = q.transpose(1, 2).reshape(num_reqs, num_kv_heads, group * max_q, head_dim)
            mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(num_reqs, 1, group * max_q, -1)
            result = _soft_capped_attention(q, k, v, mask, layer.scale, soft_cap)
            result = result.view(num_reqs, layer.num_heads, max_q, head_dim)
        result = result.transpose(1, 2).reshape(num_reqs * max_q, layer.num_heads, head_dim)
        out[:actual] = result.index_select(0, layout.out_index)
