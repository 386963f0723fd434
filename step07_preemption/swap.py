"""Moving a request's KV blocks between the device pool and host memory, in as few transfers as possible.

A request's blocks are scattered over the pool, in every layer. Swapping out gathers all of them, for all
layers, into one contiguous device tensor per K and V (`pool[:, blocks]`), then copies each to pinned host
memory in one transfer. Swapping in does the reverse into freshly allocated blocks. The per-block loop
(`per_block=True`) copies each block of each layer on its own, as a naive implementation would: the
benchmark compares the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from step02_paged_kv.kv_cache import PagedKVCache


@dataclass
class SwapStats:
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class HostKV:
    """One swapped-out request's K and V: [num_layers, num_blocks, block_size, kv_heads, head_dim] each."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


class Swapper:
    def __init__(self, cache: PagedKVCache, per_block: bool = False) -> None:
        self.cache = cache
        self.per_block = per_block
        self.pin = cache.k.device.type == "cuda"  # pinned host memory makes the copies fast and async-capable
        self.stats = SwapStats()

    def _host_like(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.cache.k.dtype, pin_memory=self.pin)

    def _sync(self) -> None:
        if self.cache.k.device.type == "cuda":
            torch.cuda.synchronize(self.cache.k.device)

    def swap_out(self, blocks: list[int]) -> HostKV:
        start = time.perf_counter()
        k_pool, v_pool = self.cache.k, self.cache.v
        shape = (k_pool.shape[0], len(blocks), *k_pool.shape[2:])
        host = HostKV(self._host_like(shape), self._host_like(shape))
        if self.per_block:
            for layer in range(k_pool.shape[0]):
                for i, block in enumerate(blocks):
                    host.k[layer, i].copy_(k_pool[layer, block])
                    host.v[layer, i].copy_(v_pool[layer, block])
        else:
            index = torch.tensor(blocks, device=k_pool.device)
            host.k.copy_(k_pool.index_select(1, index))  # one gather on the device, one transfer
            host.v.copy_(v_pool.index_select(1, index))
        self._sync()
        self._count(start, host, out=True)
        return host

    def swap_in(self, host: HostKV, blocks: list[int]) -> None:
        start = time.perf_counter()
        k_pool, v_pool = self.cache.k, self.cache.v
        if self.per_block:
            for layer in range(k_pool.shape[0]):
                for i, block in enumerate(blocks):
                    k_pool[layer, block].copy_(host.k[layer, i])
                    v_pool[layer, block].copy_(host.v[layer, i])
        else:
            index = torch.tensor(blocks, device=k_pool.device)
            k_pool.index_copy_(1, index, host.k.to(k_pool.device, non_blocking=True))
            v_pool.index_copy_(1, index, host.v.to(v_pool.device, non_blocking=True))
        self._sync()
        self._count(start, host, out=False)

    def _count(self, start: float, host: HostKV, out: bool) -> None:
        self.stats.seconds += time.perf_counter() - start
        self.stats.bytes_moved += host.k.nbytes + host.v.nbytes
        if out:
            self.stats.swapped_out_blocks += host.num_blocks
        else:
            self.stats.swapped_in_blocks += host.num_blocks
