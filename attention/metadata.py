"""Backend-independent attention metadata for one step.

All tensors are views of the model runner's persistent buffers, sliced to the
(padded) batch: row r of the request-level tensors is request r; padded requests have
seq_len 0 and query length 0, padded tokens have slot_mapping -1 (never written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32 on the device: token offsets of each request's queries."""
    query_start_loc_cpu: torch.Tensor
    """The same on the host (no device sync needed to read it)."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: context + new tokens, i.e. the KV length after this step."""
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    """[num_reqs] int32 on the host: tokens already in the KV cache before this step."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks_per_req] int32: physical block ids, unused entries 0."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: KV-cache slot of each token (block_id * block_size + offset); -1 = skip."""
    token_request_index: torch.Tensor
    """[num_tokens] int32: which request row each token belongs to; -1 for padded tokens."""
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool
    """Every request adds exactly one token (pure decode)."""

    @property
    def num_tokens(self) -> int:
        """Token rows in this (possibly padded) batch."""
        return self.slot_mapping.shape[0]
