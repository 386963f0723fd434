"""Exercise 10-block-keys: key every full, computed block on its whole prefix.

Write the body of `key_full_blocks`; `python -m exercises run 10-block-keys` plugs it into step 10's engine in
place of `PrefixCachingEngine.key_full_blocks` and runs step 10's tests and dry run on it.
"""

from __future__ import annotations

from step10_prefix_caching.engine import PrefixCachedRequest, PrefixCachingEngine


def key_full_blocks(self: PrefixCachingEngine, request: PrefixCachedRequest, end: int) -> None:
    """Give a key to every block of `request` that its first `end` tokens fill and that has no key yet.

    Inputs: called after each forward, `end` is how many of the request's tokens have their K/V in the cache. A
    block holds `size = self.cache.block_size` tokens: the request's block `i` is physical block
    `request.block_table[i]` and holds tokens `i * size .. (i + 1) * size - 1` of `request.all_token_ids`
    (prompt, then generated tokens). `request.block_keys` holds the keys of its first blocks, in order (from
    earlier calls, or claimed from the cache at admission); it may hold fewer than its full blocks.
    Returns: nothing; afterwards `request.block_keys` has one key per full block, and each new key is
    registered in the pool for its physical block (`self.allocator.register(block, key)`), so that a later
    prompt with the same prefix can claim the block.
    Rule: the key of block `i` is `block_key(key of block i - 1, block i's tokens)`, `ROOT_KEY` standing for the
    key before block 0 (both in `step10_prefix_caching.block_pool`): a key stands for every token up to its
    block's end, so two blocks with the same tokens after different prefixes get different keys. A block that
    is not full gets no key (its tokens are not all computed); a block that has its key is not hashed again.

    Example: size 4, tokens t0..t13, no key yet, end 6: block 0 is full: keys [k0], k0 = block_key(ROOT_KEY,
    [t0, t1, t2, t3]), registered for block_table[0]. Next call, end 9: k1 = block_key(k0, [t4, t5, t6, t7]),
    keys [k0, k1]. Next, end 11: nothing to do.

    Hints (step10_prefix_caching/README.md, "The idea: a key per full block, chained over the prefix", and in
    "Pitfalls", "Hashing a long prompt"): go on from the last key the request has; a prompt admitted later looks
    its blocks up by the same chain from `ROOT_KEY`, so a key that differs by one byte finds nothing.
    """
    raise NotImplementedError("write PrefixCachingEngine.key_full_blocks: see the hints in its docstring")
