"""The physical KV-cache blocks: reference counts, the LRU free queue and the prefix-cache index.

A block with `ref_count == 0` is free. A free block that still carries a `block_hash` keeps its
keys/values and stays findable in the prefix cache until it is handed out again; the free queue
is ordered least-recently-freed first, so the blocks reallocated (and their hashes evicted) first
are the ones nobody has used for the longest time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

BlockHash = bytes
"""sha256 digest of (parent block's hash, the block's token ids); see kv_cache_manager.hash_block."""


class BlockPool:
    """`num_blocks` blocks, ids 0..num_blocks-1, all usable (block 0 is a real block).

    Each block's state is an entry of two lists indexed by block id (its holders, and the hash it
    carries), not an object per block: a GPU cache holds 10^5 blocks and more (138058 for the
    Llama-3.2-1B shape on an H100), and as many objects took 310 ms of every start-up to build, the
    garbage collector's passes over them included, against 31 ms for the lists (`python -m timeit
    -s "import gc, torch; from runner.block_pool import BlockPool; gc.enable()" "BlockPool(138058)"`,
    2-core CPU host)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        """Holders of each block; 0: free."""
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        """The prefix-cache hash each block carries, or None."""
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
            block_hash = self.block_hashes[block_id]
            if block_hash is not None:
                if self._cached.get(block_hash) == block_id:
                    del self._cached[block_hash]
                self.block_hashes[block_id] = None
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        self.num_allocated += count
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each (prefix-cache hit); a free cached block leaves the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a holder from each; blocks reaching 0 join the free queue's tail in this order."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} released more often than it was held")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a full, computed block findable by its hash.

        If another block already holds the same content (two requests computed the same prefix
        at once), the index keeps that one and this block stays unhashed; it is freed as an
        ordinary block. Returns whether this block is now the cached one.
        """
        owner = self._cached.get(block_hash)
        if owner is not None:
            return owner == block_id
        if self.block_hashes[block_id] is not None:
            raise RuntimeError(f"block {block_id} is already cached under another hash")
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash (blocks in use keep their data and holders). Returns how many."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            self.block_hashes[block_id] = None
        self._cached.clear()
        return dropped
