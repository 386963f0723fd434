"""Step 03's only change: the gather and the write-back become single indexing operations.

Step 02 copied each request's blocks out of the pool in Python loops, one small copy per layer, request and
block; the number of copies grew with the batch and the context. Here the engine builds, once per forward,
two index tensors: a slot mapping (where each new token goes) and a padded block table (which blocks each
row reads). Each layer then does one scatter and one gather, however large the batch.
"""

from __future__ import annotations

import torch

from step02_paged_kv.kv_cache import PagedDecodeForward, PagedKVCache, PagedPrefillForward


def flat_slots(cache: PagedKVCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools viewed as [num_blocks * block_size, kv_heads, head_dim]: one row per slot."""
    return cache.k[layer_idx].flatten(0, 1), cache.v[layer_idx].flatten(0, 1)


class VectorizedPrefillForward(PagedPrefillForward):
    def __init__(self, cache: PagedKVCache, block_table: list[int], num_tokens: int, device: torch.device) -> None:
        super().__init__(cache, block_table, num_tokens, device)
        slots = [cache.slot(block_table, p) for p in range(num_tokens)]
        self.slot_mapping = torch.tensor(slots, device=device)

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_slots, v_slots = flat_slots(self.cache, layer_idx)
        k_slots.index_copy_(0, self.slot_mapping, k)
        v_slots.index_copy_(0, self.slot_mapping, v)


class VectorizedDecodeForward(PagedDecodeForward):
    def __init__(
        self, cache: PagedKVCache, block_tables: list[list[int]], seq_lens: list[int], device: torch.device
    ) -> None:
        super().__init__(cache, block_tables, seq_lens, device)
        slots = [cache.slot(table, n - 1) for table, n in zip(block_tables, seq_lens)]
        self.slot_mapping = torch.tensor(slots, device=device)
        # Rows shorter than the longest are padded with block 0: its contents are read but masked out.
        padded = [table[: self.max_blocks] + [0] * (self.max_blocks - len(table)) for table in block_tables]
        self.block_table = torch.tensor(padded, device=device)  # [batch, max_blocks]

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_slots, v_slots = flat_slots(self.cache, layer_idx)
        k_slots.index_copy_(0, self.slot_mapping, k)
        v_slots.index_copy_(0, self.slot_mapping, v)

    def gather_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        # [batch, max_blocks] indexes [num_blocks, block_size, ...] -> [batch, max_blocks, block_size, ...]
        batch = len(self.seq_lens)
        keys = self.cache.k[layer_idx][self.block_table].view(batch, self.max_blocks * self.cache.block_size, *self.cache.k.shape[3:])
        values = self.cache.v[layer_idx][self.block_table].view_as(keys)
        return keys[:, : self.max_len], values[:, : self.max_len]
