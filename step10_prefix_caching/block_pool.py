"""A block pool whose full blocks outlive their requests: keyed by their tokens, shared, evicted last.

Step 02's allocator owned each block once and forgot its contents when it came back. Here a block has:

- a reference count: how many requests' block tables hold it (a shared block is read by several);
- once full and computed, a key: a SHA-256 digest chained over the key of the block before it and the block's
  own token ids. Equal keys mean the same tokens at the same positions after the same prefix, so the same K/V.
  A collision would hand a request another prompt's K/V; with 256 bits it is not a practical concern;
- a life: owned (count > 0), cached (count 0, key kept: it may be claimed again), free (no key). A cached block
  is only taken back for new work when no free block is left, least recently used first (its key is dropped).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from step02_paged_kv.block_allocator import BlockAllocator, OutOfBlocksError

ROOT_KEY = b""  # the key "before" a sequence's first block


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: its tokens, after everything `parent` stands for."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()  # 4 bytes a token


def chain_keys(token_ids: Sequence[int], block_size: int, num_blocks: int, parent: bytes = ROOT_KEY) -> Iterator[bytes]:
    """The keys of the first `num_blocks` full blocks of `token_ids`, each chained on the one before, one at
    a time: a lookup that stops at the first block not cached hashes no further."""
    for i in range(num_blocks):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        yield parent


class PrefixCachingAllocator(BlockAllocator):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.ref_counts: dict[int, int] = {}  # owned blocks only
        self.block_of_key: dict[bytes, int] = {}
        self.key_of_block: dict[int, bytes] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # count 0, key kept; least recently used first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks new work can have: free ones and cached ones (evicted on demand)."""
        return len(self.free_blocks) + len(self.cached)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free or cached")
        blocks = []
        for _ in range(n):
            if self.free_blocks:
                block = self.free_blocks.popleft()
            else:
                block, _ = self.cached.popitem(last=False)  # the least recently used cached block
                del self.block_of_key[self.key_of_block.pop(block)]
                self.evictions += 1
            self.ref_counts[block] = 1
            self.owned.add(block)
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """One reference fewer on each block; a block nobody holds is cached if it has a key, else free."""
        for block in blocks:
            if block not in self.ref_counts:
                raise ValueError(f"block {block} is not allocated: freed twice, or never owned")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                del self.ref_counts[block]
                self.owned.remove(block)
                if block in self.key_of_block:
                    self.cached[block] = None  # most recently used: last
                else:
                    self.free_blocks.append(block)

    def claim(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` (from the first) that are in the pool, one reference more
        on each: owned by others already, or cached (then owned again). Reads no key past the first miss."""
        blocks = []
        for key in keys:
            block = self.block_of_key.get(key)
            if block is None:
                break
            if block in self.cached:
                del self.cached[block]
                self.owned.add(block)
            self.ref_counts[block] = self.ref_counts.get(block, 0) + 1
            blocks.append(block)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """An owned block is full and computed: it can be claimed by `key`. If another block already holds
        those tokens (two requests computed the same prefix at once), this one stays unkeyed."""
        if key not in self.block_of_key and block not in self.key_of_block:
            self.block_of_key[key] = block
            self.key_of_block[block] = key

