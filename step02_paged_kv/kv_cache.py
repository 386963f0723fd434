"""The paged KV cache, and the two forward contexts that use it: prefill and batched decode.

The pool holds K and V for every layer as `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.
A request's block table maps its logical blocks to physical ones: the token at position `p` lives in block
`table[p // block_size]`, at offset `p % block_size` (its *slot* is `block * block_size + offset`).

Decode runs every running request in one forward. Our attention needs each request's keys as one dense
row, so `PagedDecodeForward` gathers them out of the pool block by block, pads the rows to the longest
request, and masks the padding. Here the gather and the write-back are plain Python loops (layer x request x
block); step03 replaces exactly those two methods with vectorized indexing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.config import ModelConfig
from common.model import ForwardContext


class PagedKVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: padding slots are masked out, but masked garbage must never be NaN.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def slot(self, block_table: list[int], position: int) -> int:
        """Logical position -> physical slot in the pool (the translation every paged read and write does)."""
        return block_table[position // self.block_size] * self.block_size + position % self.block_size


class PagedPrefillForward(ForwardContext):
    """All tokens of one request, none of them cached yet: attend causally among themselves, then store."""

    def __init__(self, cache: PagedKVCache, block_table: list[int], num_tokens: int, device: torch.device) -> None:
        self.cache = cache
        self.block_table = block_table
        self.num_tokens = num_tokens
        self.positions = torch.arange(num_tokens, device=device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write_kv(layer_idx, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the prompt's K/V into its blocks, one block-sized chunk at a time."""
        size = self.cache.block_size
        for logical, block in enumerate(self.block_table):
            chunk = slice(logical * size, min((logical + 1) * size, self.num_tokens))
            filled = chunk.stop - chunk.start
            self.cache.k[layer_idx, block, :filled] = k[chunk]
            self.cache.v[layer_idx, block, :filled] = v[chunk]


class PagedDecodeForward(ForwardContext):
    """One new token for each of several requests, each attending over its whole cached sequence.

    `seq_lens[i]` counts request i's tokens including the new one, whose position is `seq_lens[i] - 1`.
    Everything derived from the lengths (the longest one, the padding mask) is built once here, per
    forward, and then reused by every layer.
    """

    def __init__(
        self, cache: PagedKVCache, block_tables: list[list[int]], seq_lens: list[int], device: torch.device
    ) -> None:
        self.cache = cache
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.max_len = max(seq_lens)  # a host int: no layer has to ask the device
        self.max_blocks = cache.blocks_for(self.max_len)
        self.positions = torch.tensor([n - 1 for n in seq_lens], device=device)
        lens = torch.tensor(seq_lens, device=device)
        key_pos = torch.arange(self.max_len, device=device)
        self.mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # [batch, 1, 1, max_len]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write_kv(layer_idx, k, v)
        keys, values = self.gather_kv(layer_idx)  # [batch, max_len, kv_heads, head_dim]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [batch, heads, 1, head_dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        return out[:, :, 0, :]

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each request's new K/V in its slot: a loop over requests."""
        # The layer's pool seen as one row per slot (a view: writing a row writes the pool).
        k_slots = self.cache.k[layer_idx].flatten(0, 1)
        v_slots = self.cache.v[layer_idx].flatten(0, 1)
        for i, (table, length) in enumerate(zip(self.block_tables, self.seq_lens)):
            slot = self.cache.slot(table, length - 1)  # the new token's position is length - 1
            k_slots[slot] = k[i]
            v_slots[slot] = v[i]

    def gather_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy every request's blocks into a dense, padded batch: a loop over requests and their blocks."""
        cache, size = self.cache, self.cache.block_size
        shape = (len(self.block_tables), self.max_blocks * size, *cache.k.shape[3:])
        keys = torch.zeros(shape, device=cache.k.device, dtype=cache.k.dtype)
        values = torch.zeros_like(keys)
        for i, (table, length) in enumerate(zip(self.block_tables, self.seq_lens)):
            for logical in range(cache.blocks_for(length)):
                rows = slice(logical * size, (logical + 1) * size)
                keys[i, rows] = cache.k[layer_idx, table[logical]]
                values[i, rows] = cache.v[layer_idx, table[logical]]
        return keys[:, : self.max_len], values[:, : self.max_len]
