"""The physical KV-cache blocks: reference counts, the LRU free queue and the prefix-cache index.

A block with `ref_count == 0` is free. A free block that still carries a `block_hash` keeps its
keys/values and stays findable in the prefix cache until it is handed out again; the free queue
is ordered least-recently-freed first, so the blocks reallocated (and their hashes evicted) first
are the ones nobody has used for the longest time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes
"""sha256 digest of (parent block's hash, the block's token ids); see kv_cache_manager.hash_block."""


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """`num_blocks` blocks, ids 0..num_blocks-1, all usable (block 0 is a real block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is the eviction order: popitem(last=False) takes the LRU block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_allocated = 0
        """Blocks handed out by `allocate` so far (a shared or prefix-cached block is not allocated again)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (for tests and debugging)."""
        return list(self._free)

    def cached_block_ids(self) -> dict[BlockHash, int]:
        return dict(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (LRU first), evicting any hash they still carry."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            ids.append(block_id)
        self.num_allocated += count
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each (prefix-cache hit); a free cached block leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a holder from each; blocks reaching 0 join the free queue's tail in this order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than it was held")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a full, computed block findable by its hash.

        If another block already holds the same content (two requests computed the same prefix
        at once), the index keeps that one and this block stays unhashed; it is freed as an
        ordinary block. Returns whether this block is now the cached one.
        """
        block = self.blocks[block_id]
        owner = self._cached.get(block_hash)
        if owner is not None:
            return owner == block_id
        if block.block_hash is not None:
            raise RuntimeError(f"block {block_id} is already cached under another hash")
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash (blocks in use keep their data and holders). Returns how many."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()
        return dropped
