"""Exercise 10-lru-evict: blocks for new work, free ones first, then cached ones, least recently used first.

Write the body of `allocate`; `python -m exercises run 10-lru-evict` plugs it into step 10's block pool in
place of `PrefixCachingAllocator.allocate` and runs step 10's tests and dry run on it.
"""

from __future__ import annotations

from step10_prefix_caching.block_pool import PrefixCachingAllocator


def allocate(self: PrefixCachingAllocator, n: int) -> list[int]:
    """Hand out `n` blocks for new work, each with one reference: free blocks first, then evicted cached ones.

    The pool's state (`PrefixCachingAllocator.__init__` and step 02's `BlockAllocator`):
    - `self.free_blocks`: a deque of the blocks nobody holds that have no key;
    - `self.cached`: an OrderedDict `{block: None}` of the blocks nobody holds that keep their key, least
      recently used first (`free` appends a block when its last holder lets it go; `claim` takes it out);
    - `self.block_of_key` and `self.key_of_block`: a cached or owned block's key, both ways;
    - `self.ref_counts` (`{block: holders}`) and `self.owned` (a set): the blocks held by some request;
    - `self.evictions`: how many cached blocks were taken for new work so far; `self.num_free` is
      `len(self.free_blocks) + len(self.cached)`.

    If `n` is more than `self.num_free`, raise `OutOfBlocksError` (step02_paged_kv.block_allocator) and
    change nothing. Otherwise take `n` blocks one at a time: the next free block from the left of
    `self.free_blocks` while there is one, else evict the least recently used cached block: out of
    `self.cached`, its key forgotten in both maps (no prompt may claim it any more: its K/V is about to be
    overwritten), one more eviction counted. Every block taken gets `ref_counts[block] = 1` and goes into
    `self.owned`. Return them in the order taken.

    Example: free_blocks deque([5]), cached {2: None, 7: None} (2 freed before 7), keys {2: k2, 7: k7}:
    allocate(2) returns [5, 2]; cached is then {7: None}, k2 is gone from both maps, evictions grew by 1,
    and ref_counts[5] == ref_counts[2] == 1. allocate(3) instead raises OutOfBlocksError.

    Hints (step10_prefix_caching/README.md, "The idea: a key per full block, chained over the prefix", its
    paragraph "A block's life"): `OrderedDict.popitem(last=False)` pops the first (oldest) entry; an owned block
    is never in `self.cached`, so evicting never takes a block someone holds.
    """
    raise NotImplementedError("write PrefixCachingAllocator.allocate: see the hints in its docstring")
