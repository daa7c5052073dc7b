"""Persistent input buffers: every step copies into the same host and device tensors.

CUDA graphs read their inputs from fixed addresses, so the runner never hands the model
a freshly allocated tensor: `prepare` fills host (pinned on CUDA) numpy views, copies the
used prefix to the device buffers, and returns views `[:padded]` of them.

`prepare` runs every step, so it is written for the host time it costs: whole-batch numpy
operations instead of per-request Python, a shorter path for uniform decode batches, tensor
views made once per size, and block-table rows rewritten only when a request's table changed.
"""

from __future__ import annotations

from itertools import chain, repeat

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
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._uploaded: bytes | None = None

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) views `[:n]`, made once per size: slicing a tensor costs about a
        microsecond, and a step asks for a dozen of them."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self.cpu[:n], self.gpu[:n])
        return views

    def upload(self, n: int) -> None:
        """Copy rows [:n] to the device (nothing to do on a CPU, where both are one tensor)."""
        if self.gpu is not self.cpu:
            host, device = self.views(n)
            device.copy_(host, non_blocking=True)
        self._uploaded = None

    def upload_if_changed(self, n: int) -> None:
        """`upload`, unless the last upload (through here) sent the same bytes for the same n: a
        host-to-device copy costs far more host time than comparing a few hundred bytes. For buffers that
        often hold what the device has (query_start_loc and token_request_index of decode steps:
        0, 1, 2, ...). Any other write to the device rows must `forget` (none does today)."""
        data = self.np[:n].tobytes()
        if data != self._uploaded:
            self.upload(n)
            self._uploaded = data

    def forget(self) -> None:
        """The device rows changed behind the host's back: the next upload_if_changed copies."""
        self._uploaded = None


class InputBatch:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device, guard_uploads: bool = False) -> None:
        self.max_num_tokens, self.max_num_reqs, self.block_size = max_num_tokens, max_num_reqs, block_size
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64, device, fill=-1)
        self.token_request_index = _Buffer((max_num_tokens,), torch.int32, device, fill=-1)
        self.query_start_loc = _Buffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_reqs,), torch.int32, device)
        self.block_table = _Buffer((max_num_reqs, max_blocks_per_req), torch.int32, device)
        self.num_computed = _Buffer((max_num_reqs,), torch.int32, torch.device("cpu"))
        # Placeholder inputs (async scheduling): token rows to fill, and the previous step's sampled rows.
        self.placeholder_token_rows = _Buffer((max_num_reqs,), torch.int64, device)
        self.placeholder_sample_rows = _Buffer((max_num_reqs,), torch.int64, device)
        self.graph_greedy = _Buffer((1,), torch.int32, device, fill=1)
        """1 while the step takes the greedy tokens a decode graph computes, 0 when it does not (the
        graph's argmax kernels read it: runner/model_runner.py `forward_with_decode_head`)."""
        self.on_device = device.type != "cpu"
        """Host buffers are copied to separate device ones (on a CPU they are the same tensors)."""
        self.guard_uploads = guard_uploads and device.type == "cuda"
        """With a step in flight (async scheduling) the next `prepare` may run before this step's
        non-blocking uploads have left the pinned host buffers; an event recorded after them is
        waited for before the buffers are written again."""
        self._uploads_done: torch.cuda.Event | None = None
        self._request_view_cache: dict[int, dict[str, torch.Tensor]] = {}
        self._token_view_cache: dict[int, dict[str, torch.Tensor]] = {}
        self._arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        # What each block-table row holds: which table (None: not a known one) and how many of
        # its entries; every entry past those is 0 (the buffer starts zeroed).
        self._row_table_ids: list[int | None] = [None] * max_num_reqs
        self._row_num_blocks = [0] * max_num_reqs

    def prepare(self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]],
                padded_tokens: int, padded_reqs: int, slots_enabled: bool = True,
                block_table_ids: list[int] | None = None,
                placeholders: tuple[list[int], list[int], torch.Tensor] | None = None,
                graph_greedy: bool = True) -> CommonAttentionMetadata:
        """Fill the buffers for requests with these new tokens, context lengths and block tables.

        Padded token rows get slot -1 and request index -1; padded requests get query length 0
        and seq_len 0. `slots_enabled=False` marks every row inert (graph capture warm-up).
        `block_table_ids` name the tables (`Request.block_table_id`) so that rows already
        holding them are only extended; without them every row is written whole.
        `placeholders` = (token rows, sampled rows, the previous step's sampled tokens on the
        device): those input ids are gathered on the device after the upload (async scheduling).
        `graph_greedy`: whether the step takes the greedy tokens a decode graph computes."""
        if self._uploads_done is not None:
            self._uploads_done.synchronize()  # the last step's uploads have left the staging buffers
        self.graph_greedy.np[0] = graph_greedy
        num_reqs = len(token_ids)
        if num_reqs > padded_reqs or padded_reqs > self.max_num_reqs:
            raise ValueError(f"{num_reqs} requests padded to {padded_reqs} exceed max_num_seqs {self.max_num_reqs}")
        num_tokens = sum(map(len, token_ids))
        if num_tokens > padded_tokens or padded_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens padded to {padded_tokens} exceed {self.max_num_tokens}")
        table_changed = self._write_block_table(block_ids, block_table_ids, padded_reqs)
        uniform_decode = num_tokens == num_reqs > 0  # every request feeds >= 1 token: here each feeds one
        if uniform_decode:
            max_query_len, max_seq_len = 1, self._fill_decode(token_ids, num_computed, block_ids, slots_enabled)
        else:
            max_query_len, max_seq_len = self._fill_mixed(token_ids, num_computed, num_tokens, slots_enabled)
        if padded_reqs > num_reqs:
            self.query_start_loc.np[num_reqs + 1:padded_reqs + 1] = num_tokens
            self.seq_lens.np[num_reqs:padded_reqs] = 0
            self.num_computed.np[num_reqs:padded_reqs] = 0
        if padded_tokens > num_tokens:
            for buffer, fill in ((self.input_ids, 0), (self.positions, 0), (self.slot_mapping, -1),
                                 (self.token_request_index, -1)):
                buffer.np[num_tokens:padded_tokens] = fill

        if self.on_device:
            self._upload(padded_reqs, padded_tokens, table_changed,
                         placeholders is not None and self._all_rows_placeholders(num_tokens, placeholders[0]))
        if placeholders is not None:
            self._fill_placeholders(*placeholders)
        if self.guard_uploads:
            if self._uploads_done is None:
                self._uploads_done = torch.cuda.Event()
            self._uploads_done.record()
        return CommonAttentionMetadata(**self._request_views(padded_reqs), **self._token_views(padded_tokens),
                                       num_reqs=padded_reqs, num_actual_tokens=num_tokens,
                                       max_query_len=max_query_len, max_seq_len=max_seq_len,
                                       uniform_decode=uniform_decode)

    def _upload(self, padded_reqs: int, padded_tokens: int, table_changed: bool, ids_on_device: bool) -> None:
        """Copy what the step changed to the device; the steady decode step sends 3 small copies, not 7.
        Skipped: the block table when no row changed (the device holds every row as the host does:
        rows are only written here, and each write is uploaded the same step); query_start_loc and
        token_request_index when they hold what was sent last (0, 1, 2, ... in decode); input_ids
        when every token row is a placeholder that the device fills from the last step's samples
        (its padded rows then keep earlier valid ids: padded rows are inert); the greedy gate
        when it changed."""
        self.graph_greedy.upload_if_changed(1)
        self.query_start_loc.upload_if_changed(padded_reqs + 1)
        self.token_request_index.upload_if_changed(padded_tokens)
        self.seq_lens.upload(padded_reqs)
        self.slot_mapping.upload(padded_tokens)
        self.positions.upload(padded_tokens)
        if table_changed:
            self.block_table.upload(padded_reqs)
        if not ids_on_device:
            self.input_ids.upload(padded_tokens)

    @staticmethod
    def _all_rows_placeholders(num_tokens: int, token_rows: list[int]) -> bool:
        """Every token row 0..num_tokens-1 is a placeholder (token rows are increasing)."""
        return len(token_rows) == num_tokens and (num_tokens == 0 or token_rows[-1] == num_tokens - 1)

    def _request_views(self, padded_reqs: int) -> dict[str, torch.Tensor]:
        """The request-level tensors of the metadata, sliced once per size."""
        views = self._request_view_cache.get(padded_reqs)
        if views is None:
            qsl_cpu, qsl = self.query_start_loc.views(padded_reqs + 1)
            seq_lens_cpu, seq_lens = self.seq_lens.views(padded_reqs)
            views = self._request_view_cache[padded_reqs] = dict(
                query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
                num_computed_tokens_cpu=self.num_computed.views(padded_reqs)[0],
                block_table=self.block_table.views(padded_reqs)[1])
        return views

    def _token_views(self, padded_tokens: int) -> dict[str, torch.Tensor]:
        """The token-level tensors of the metadata, sliced once per size."""
        views = self._token_view_cache.get(padded_tokens)
        if views is None:
            views = self._token_view_cache[padded_tokens] = dict(
                slot_mapping=self.slot_mapping.views(padded_tokens)[1],
                token_request_index=self.token_request_index.views(padded_tokens)[1])
        return views

    def _fill_decode(self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]],
                     slots_enabled: bool) -> int:
        """One token per request (token i is request i's, at position num_computed[i]): the
        per-request lists go straight into the buffers. For a batch of decodes a few list
        conversions cost less than the dozen numpy operations of the general path.
        Returns max_seq_len."""
        num_reqs, bs = len(token_ids), self.block_size
        self.input_ids.np[:num_reqs] = [ids[0] for ids in token_ids]
        self.positions.np[:num_reqs] = num_computed
        self.num_computed.np[:num_reqs] = num_computed
        self.seq_lens.np[:num_reqs] = [start + 1 for start in num_computed]
        self.query_start_loc.np[:num_reqs + 1] = self._arange[:num_reqs + 1]
        self.token_request_index.np[:num_reqs] = self._arange[:num_reqs]
        if slots_enabled:
            self.slot_mapping.np[:num_reqs] = [blocks[pos // bs] * bs + pos % bs
                                               for blocks, pos in zip(block_ids, num_computed)]
        else:
            self.slot_mapping.np[:num_reqs] = -1
        return max(num_computed) + 1

    def _fill_mixed(self, token_ids: list[list[int]], num_computed: list[int], num_tokens: int,
                    slots_enabled: bool) -> tuple[int, int]:
        """Any batch (prefill chunks, decodes): whole-batch numpy over the token rows, slots
        read through the block table. Returns (max_query_len, max_seq_len)."""
        num_reqs = len(token_ids)
        starts = self.num_computed.np[:num_reqs]
        starts[:] = num_computed
        query_lens = np.fromiter(map(len, token_ids), dtype=np.int64, count=num_reqs)
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:num_reqs + 1])
        req_index = np.repeat(self._arange[:num_reqs], query_lens)
        positions = starts[req_index] + (self._arange[:num_tokens] - qsl[req_index])
        self.positions.np[:num_tokens] = positions
        seq_lens = self.seq_lens.np[:num_reqs]
        np.add(starts, query_lens, out=seq_lens)
        self.input_ids.np[:num_tokens] = np.fromiter(chain.from_iterable(token_ids), np.int64, num_tokens)
        self.token_request_index.np[:num_tokens] = req_index
        if slots_enabled:
            block_index, offset = np.divmod(positions, self.block_size)
            blocks = self.block_table.np[req_index, block_index].astype(np.int64)
            np.add(blocks * self.block_size, offset, out=self.slot_mapping.np[:num_tokens])
        else:
            self.slot_mapping.np[:num_tokens] = -1
        if not num_reqs:
            return 0, 0
        return int(query_lens.max()), int(seq_lens.max())

    def _write_block_table(self, block_ids: list[list[int]], table_ids: list[int] | None, padded_reqs: int) -> bool:
        """Bring rows [0, padded_reqs) up to date, writing only what changed; True if anything was.

        A table only grows while it keeps its id, so a row that already holds the request's
        table gets just the blocks appended since (in decode: nothing, except once per
        block_size steps). A different table in the row (the batch shifted after a request
        finished, a new or resumed request) is written whole and the row's old tail zeroed, so
        unused entries stay 0. Padded rows are zeroed."""
        table = self.block_table.np
        row_ids, row_lens = self._row_table_ids, self._row_num_blocks
        num_reqs = len(block_ids)
        changed = False
        if table_ids == row_ids[:num_reqs] and list(map(len, block_ids)) == row_lens[:num_reqs]:
            block_ids = ()  # every row holds its table already (most decode steps): two list compares
        for row, (blocks, table_id) in enumerate(zip(block_ids, table_ids or repeat(-1))):
            num_blocks, written = len(blocks), row_lens[row]
            if table_id == row_ids[row] and num_blocks >= written:  # the same table, perhaps grown
                if num_blocks > written:
                    table[row, written:num_blocks] = blocks[written:]
                    changed = True
            else:
                table[row, :num_blocks] = blocks
                if written > num_blocks:
                    table[row, num_blocks:written] = 0
                row_ids[row] = table_id if table_id >= 0 else None
                changed = True
            row_lens[row] = num_blocks
        for row in range(num_reqs, padded_reqs):
            if row_lens[row]:
                table[row, :row_lens[row]] = 0
                changed = True
            row_ids[row], row_lens[row] = None, 0
        return changed

    def _fill_placeholders(self, token_rows: list[int], sample_rows: list[int], prev_sampled: torch.Tensor) -> None:
        """input_ids[token_rows] = prev_sampled[sample_rows], on the device: no host sync, and the
        input buffer keeps its address (graphs read it)."""
        n = len(token_rows)
        if sample_rows == token_rows and token_rows[0] == 0 and token_rows[-1] == n - 1:
            # A decode batch of the same requests in the same order (the steady state): rows 0..n-1
            # (increasing, so the ends say it all) take sampled rows 0..n-1 — one copy, no uploads.
            self.input_ids.gpu[:n].copy_(prev_sampled[:n])
            return
        self.placeholder_token_rows.np[:n] = token_rows
        self.placeholder_sample_rows.np[:n] = sample_rows
        self.placeholder_token_rows.upload(n)
        self.placeholder_sample_rows.upload(n)
        dst, src = self.placeholder_token_rows.views(n)[1], self.placeholder_sample_rows.views(n)[1]
        self.input_ids.gpu.index_copy_(0, dst, prev_sampled.index_select(0, src).to(self.input_ids.gpu.dtype))

    def model_inputs(self, padded_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids.views(padded_tokens)[1], self.positions.views(padded_tokens)[1]
