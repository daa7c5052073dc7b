"""Per-request block tables on top of the block pool, with automatic prefix caching.

Prefix caching: every FULL block of a request is named by a chained hash,
`sha256(parent_hash || token ids of the block)`, so equal hashes mean equal whole prefixes,
not just equal blocks. sha256 rather than Python's `hash()`: a 64-bit collision would
silently hand one request another prompt's keys/values, and a digest is also the same in
every process (pipeline ranks, restarts), and hashing a block's few token ids is cheap.

Blocks become cached only once their keys/values are really in the cache: the scheduler
calls `cache_full_blocks(request)` right after it advances `num_computed_tokens` past a block
boundary (in `Scheduler.update`), never at allocation time, when the step has not run yet.
With async scheduling that also keeps placeholders out of the hashes: `num_computed_tokens`
counts only applied steps, whose input tokens are all known by then.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Sequence

from runner.block_pool import BlockHash, BlockPool
from runner.request import Request


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained content hash of one full block (little-endian int64 token ids)."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._block_hashes: dict[str, list[BlockHash]] = {}
        """request id -> chained hashes of its full blocks so far (extended lazily)."""
        self._num_cached_blocks: dict[str, int] = {}
        """request id -> how many leading blocks of its table are already in the cache index."""
        self.prefix_cache_queries = 0
        """Tokens looked up (a request's length each time it is first scheduled)."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from the cache."""
        self._table_ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first `num_blocks` full blocks."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     request.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the request's tokens, and their token count.

        Never the whole sequence: the last token must be computed so that its position yields
        the logits to sample from, so at most `(num_tokens - 1) // block_size` blocks can hit.
        Takes no references; pass the ids to `allocate_slots`.

        A request with a `prompt_source` (another completion of the same prompt, `n` > 1, whose
        prompt is computed) gets that request's full prompt blocks, with or without prefix
        caching: the prompt is computed once and its blocks held by every completion (ref counts).
        """
        source = request.prompt_source
        if source is not None and not request.block_ids:
            num_full = min((request.num_tokens - 1) // self.block_size,
                           source.num_computed_tokens // self.block_size, len(source.block_ids))
            return source.block_ids[:num_full], num_full * self.block_size
        if not self.enable_prefix_caching or request.block_ids or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt_logprobs need every prompt position's logits: recompute (as vLLM)
        hits: list[int] = []
        for block_hash in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_block_ids: Sequence[int] = ()) -> bool:
        """Grow the block table so `num_computed_tokens + cached + num_new_tokens` tokens fit.

        With async scheduling the scheduler counts the request's in-flight tokens (scheduled in
        the step in flight, not yet in `num_computed_tokens`) in `num_new_tokens`: what must fit
        is computed + in flight + this step's new tokens.

        `computed_block_ids` are prefix-cache hits from `get_computed_blocks` (only for a request
        with an empty table); they are prepended and referenced. All or nothing: returns False
        and changes nothing when too few blocks are free. `num_computed_tokens` is not touched.
        The first allocation of a (re)scheduled request starts a new table: it gets a new
        `block_table_id` and records the prefix-cache query/hits.
        """
        table = request.block_ids
        if not computed_block_ids and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # the last block still has room: most decode steps end here
        if computed_block_ids and table:
            raise ValueError(f"request {request.request_id!r} already has blocks; "
                             "prefix-cache hits apply only to its first allocation")
        num_tokens = request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        num_needed = max(cdiv(num_tokens, self.block_size) - len(table) - len(computed_block_ids), 0)
        # Hit blocks that sit in the free queue stop being free once referenced.
        num_free_hits = sum(1 for b in computed_block_ids if self.pool.ref_counts[b] == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return False
        if not table:
            request.block_table_id = next(self._table_ids)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_block_ids) * self.block_size
                self._num_cached_blocks[request.request_id] = len(computed_block_ids)
        self.pool.touch(computed_block_ids)
        table.extend(computed_block_ids)
        table.extend(self.pool.allocate(num_needed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are full of computed tokens (idempotent)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache(request.block_ids[i], hashes[i])
        self._num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a chain's tail is evicted before its head."""
        self.pool.release(reversed(request.block_ids))
        request.block_ids = []
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights). Like vLLM, only while no block is
        in use: running requests' tables must stay consistent. Returns whether it reset."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True
