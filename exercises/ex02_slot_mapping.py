"""Exercise 02-slot-mapping: where a token's K/V lives in the paged pool.

Write the body of `slot`; `python -m exercises run 02-slot-mapping` plugs it into step 02's engine in place of
`PagedKVCache.slot` and runs step 02's tests and dry run on it.
"""

from __future__ import annotations

from step02_paged_kv.kv_cache import PagedKVCache


def slot(self: PagedKVCache, block_table: list[int], position: int) -> int:
    """The physical slot of the token at logical `position` of a request whose blocks are `block_table`.

    Inputs: `block_table[i]` is the physical block holding the request's logical block `i`, its positions
    `i * block_size .. (i + 1) * block_size - 1` (`self.block_size` slots a block); `position` >= 0 and inside
    the table.
    Returns: an int, the slot: the pool's slots are numbered block by block, so slot `b * block_size + o` is
    offset `o` of physical block `b`.
    Rule: the position's logical block and offset in it, then that logical block's physical block from the table.

    Example: block_size 4, block_table [6, 2, 10], position 5 -> logical block 1 = physical block 2, offset 1
    -> slot 9. Position 8 -> logical block 2 = physical block 10, offset 0 -> slot 40.

    Hints (step02_paged_kv/README.md, "The idea" and its worked example): the blocks of a table need not be
    consecutive, nor in increasing order.
    """
    raise NotImplementedError("write PagedKVCache.slot: see the hints in its docstring")
