"""Persistent input buffers: every step copies into the same host and device tensors.

CUDA graphs read their inputs from fixed addresses, so the runner never hands the model
a freshly allocated tensor: `prepare` fills host (pinned on CUDA) numpy views, copies the
used prefix to the device buffers, and returns views `[:padded]` of them.
"""

from __future__ import annotations

import numpy as np
import torch

from attention.metadata import CommonAttentionMetadata


class _Buffer:
    """A device tensor with a host mirror whose numpy view the batch builder writes."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, fill: int = 0) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.full(shape, fill, dtype=dtype, device=device)

    def upload(self, n: int) -> torch.Tensor:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class InputBatch:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device) -> None:
        self.max_num_tokens, self.max_num_reqs, self.block_size = max_num_tokens, max_num_reqs, block_size
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64, device, fill=-1)
        self.token_request_index = _Buffer((max_num_tokens,), torch.int32, device, fill=-1)
        self.query_start_loc = _Buffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_reqs,), torch.int32, device)
        self.block_table = _Buffer((max_num_reqs, max_blocks_per_req), torch.int32, device)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)

    def prepare(self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]],
                padded_tokens: int, padded_reqs: int, slots_enabled: bool = True,
                ) -> CommonAttentionMetadata:
        """Fill the buffers for requests with these new tokens, context lengths and block tables.

        Padded token rows get slot -1 and request index -1; padded requests get query length 0
        and seq_len 0. `slots_enabled=False` marks every row inert (graph capture warm-up)."""
        num_reqs = len(token_ids)
        if num_reqs > padded_reqs or padded_reqs > self.max_num_reqs:
            raise ValueError(f"{num_reqs} requests padded to {padded_reqs} exceed max_num_seqs {self.max_num_reqs}")
        query_lens = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=num_reqs)
        num_tokens = int(query_lens.sum())
        if num_tokens > padded_tokens or padded_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens padded to {padded_tokens} exceed {self.max_num_tokens}")
        starts = np.asarray(num_computed, dtype=np.int64)
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:num_reqs + 1])
        qsl[num_reqs + 1:padded_reqs + 1] = num_tokens
        self.seq_lens.np[:num_reqs] = starts + query_lens
        self.seq_lens.np[num_reqs:padded_reqs] = 0
        self.num_computed[:num_reqs] = starts
        self.num_computed[num_reqs:padded_reqs] = 0
        table = self.block_table.np
        for row, blocks in enumerate(block_ids):
            table[row, :len(blocks)] = blocks
        table[num_reqs:padded_reqs] = 0

        req_index = np.repeat(np.arange(num_reqs, dtype=np.int64), query_lens)
        offsets = np.arange(num_tokens, dtype=np.int64) - qsl[req_index]
        positions = starts[req_index] + offsets
        self.input_ids.np[:num_tokens] = np.fromiter((t for ids in token_ids for t in ids), np.int64, num_tokens)
        self.positions.np[:num_tokens] = positions
        self.token_request_index.np[:num_tokens] = req_index
        if slots_enabled:
            blocks = table[req_index, positions // self.block_size].astype(np.int64)
            self.slot_mapping.np[:num_tokens] = blocks * self.block_size + positions % self.block_size
        else:
            self.slot_mapping.np[:num_tokens] = -1
        for buffer, fill in ((self.input_ids, 0), (self.positions, 0), (self.slot_mapping, -1),
                             (self.token_request_index, -1)):
            buffer.np[num_tokens:padded_tokens] = fill

        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.upload(padded_reqs + 1),
            query_start_loc_cpu=self.query_start_loc.cpu[:padded_reqs + 1],
            seq_lens=self.seq_lens.upload(padded_reqs),
            seq_lens_cpu=self.seq_lens.cpu[:padded_reqs],
            num_computed_tokens_cpu=torch.from_numpy(self.num_computed[:padded_reqs]),
            block_table=self.block_table.upload(padded_reqs),
            slot_mapping=self.slot_mapping.upload(padded_tokens),
            token_request_index=self.token_request_index.upload(padded_tokens),
            num_reqs=padded_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(self.seq_lens.np[:num_reqs].max()) if num_reqs else 0,
            uniform_decode=bool(num_reqs) and bool((query_lens == 1).all()),
        )
        self.input_ids.upload(padded_tokens)
        self.positions.upload(padded_tokens)
        return common

    def model_inputs(self, padded_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids.gpu[:padded_tokens], self.positions.gpu[:padded_tokens]
