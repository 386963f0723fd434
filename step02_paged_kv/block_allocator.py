"""A pool of fixed-size KV blocks handed out from a free list.

The KV cache is allocated once, as `num_blocks` blocks of `block_size` token slots. A request owns a list of
blocks (its block table) that grows one block at a time; when it finishes, its blocks go back on the free
list for the next request. No block is ever owned twice, and every block comes back.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """More blocks were asked for than are free (the scheduler should have prevented it)."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return len(self.owned)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        self.owned.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self.owned:
                raise ValueError(f"block {block} is not allocated: freed twice, or never owned")
            self.owned.remove(block)
            self.free_blocks.append(block)
