"""Exercise 10-lru-evict: blocks for new work, free ones first, then cached ones, least recently used first.

Write the body of `allocate`; `python -m exercises run 10-lru-evict` plugs it into step 10's block pool in
place of `PrefixCachingAllocator.allocate` and runs step 10's tests and dry run on it.
"""

from __future__ import annotations

from step10_prefix_caching.block_pool import PrefixCachingAllocator


def allocate(self: PrefixCachingAllocator, n: int) -> list[int]:
    """Hand out `n` blocks for new work, each with one reference: free blocks first, then evicted cached ones.

    Inputs: the pool's state (`PrefixCachingAllocator.__init__` and step 02's `BlockAllocator`):
    - `self.free_blocks`: a deque of the blocks nobody holds that have no key;
    - `self.cached`: an OrderedDict `{block: None}` of the blocks nobody holds that keep their key, least
      recently used first (`free` appends a block when its last holder lets it go; `claim` takes it out);
    - `self.block_of_key` and `self.key_of_block`: a cached or held block's key, both ways;
    - `self.ref_counts` (`{block: holders}`) and `self.owned` (a set): the blocks some request holds;
    - `self.evictions`, the cached blocks taken for new work so far; `self.num_free` is
      `len(self.free_blocks) + len(self.cached)`.
    Returns: the `n` blocks, in the order taken; each now has one holder (`ref_counts` 1, in `owned`).
    Rule: more than `self.num_free` asked: raise `OutOfBlocksError` (step02_paged_kv.block_allocator) and change
    nothing. Otherwise free blocks go first, from the left of `self.free_blocks`; then cached blocks, the least
    recently used first (the prefix least likely to be asked for again). A cached block taken is evicted: out of
    `self.cached`, its key forgotten both ways (its K/V is about to be overwritten: no prompt may claim it), one
    more eviction counted.

    Example: free_blocks deque([5]), cached {2: None, 7: None} (2 freed before 7), keys {2: k2, 7: k7}:
    allocate(2) returns [5, 2]; cached is then {7: None}, k2 is gone from both maps, evictions grew by 1, and
    ref_counts[5] == ref_counts[2] == 1. allocate(3) instead raises OutOfBlocksError.

    Hints (step10_prefix_caching/README.md, "The idea: a key per full block, chained over the prefix", its
    paragraph "A block's life"): an OrderedDict keeps insertion order and can pop from either end; a held block
    is never in `self.cached`, so evicting never takes a block someone holds.
    """
    raise NotImplementedError("write PrefixCachingAllocator.allocate: see the hints in its docstring")
