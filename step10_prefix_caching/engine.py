"""Step 10: prefix caching. Full KV blocks are kept, keyed by their tokens, and shared by requests that
start alike, so a prompt's cached prefix is not computed again.

Against step 09, `PrefixCachingEngine` changes three things:
- the pool (`block_pool.py`): reference counts on blocks; a full, computed block gets a key chained over its
  tokens and its prefix; blocks nobody holds stay cached until the pool needs them (least recently used);
- admission (`reserve_chunk`): a waiting request first claims the blocks of the longest cached run of its
  full blocks, and its prefill starts after them. Its last token is always computed, even when all of its
  blocks are cached: its logits give the first output token;
- bookkeeping (`mark_computed`): every block a forward fills is keyed, generated tokens included, so the
  next turn of a conversation finds the last one's answer cached too.
Chunking, preemption (both modes), abort and priorities are step 09's. `--no-enable-prefix-caching` keeps
the shared pool but never keys a block: step 09's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.loading import LoadedModel
from common.request import RequestStatus
from step09_chunked_prefill.engine import Chunk, ChunkedPrefillEngine, ChunkedPrefillEngineConfig, ChunkedRequest
from step10_prefix_caching.block_pool import ROOT_KEY, PrefixCachingAllocator, block_key, chain_keys


@dataclass
class PrefixCachingEngineConfig(ChunkedPrefillEngineConfig):
    enable_prefix_caching: bool = True


@dataclass(eq=False)
class PrefixCachedRequest(ChunkedRequest):
    block_keys: list[bytes] = field(default_factory=list)  # the keys of its full, computed blocks, in order


class PrefixCachingEngine(ChunkedPrefillEngine):
    config_class = PrefixCachingEngineConfig
    request_class = PrefixCachedRequest

    def __init__(self, loaded: LoadedModel, config: PrefixCachingEngineConfig) -> None:
        super().__init__(loaded, config)
        self.allocator: PrefixCachingAllocator = PrefixCachingAllocator(self.allocator.num_blocks)
        self.queried_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of those, found cached

    # ----- admission: claim the cached prefix first ------------------------------------------------------

    def reserve_chunk(self, request: PrefixCachedRequest, budget: int) -> Chunk | None:
        first_admission = request.status is RequestStatus.WAITING and not request.block_table
        if first_admission and self.config.enable_prefix_caching:
            self.claim_cached_prefix(request)
        chunk = super().reserve_chunk(request, budget)
        if chunk is None and first_admission and request.block_table:
            # Not admitted after all: give the claimed blocks back (they stay cached) and look again next time.
            self.allocator.free(request.block_table)
            request.block_table, request.num_computed, request.block_keys = [], 0, []
        return chunk

    def claim_cached_prefix(self, request: PrefixCachedRequest) -> None:
        """Take references on the longest cached run of the request's full blocks, leaving at least its last
        token to compute; its prefill then starts after them."""
        size = self.cache.block_size
        tokens = request.all_token_ids
        full_blocks = (len(tokens) - 1) // size  # never the block holding the last token: its logits are needed
        blocks = self.allocator.claim(chain_keys(tokens, size, full_blocks))  # hashes up to the first miss only
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(blocks) * size
        if blocks:
            request.block_table = blocks
            request.num_computed = len(blocks) * size
            request.block_keys = [self.allocator.key_of_block[b] for b in blocks]

    # ----- bookkeeping: key every block a forward fills -------------------------------------------------------

    def mark_computed(self, request: PrefixCachedRequest, end: int) -> None:
        super().mark_computed(request, end)
        if self.config.enable_prefix_caching:
            self.key_full_blocks(request, end)

    # The chained keys, on their own so that the idea reads without the step's bookkeeping (exercise 10-block-keys).
    def key_full_blocks(self, request: PrefixCachedRequest, end: int) -> None:
        """Every block that the request's first `end` tokens fill, and that has no key yet, gets one: chained on
        the key of the block before it, appended to `request.block_keys` and registered in the pool."""
        size = self.cache.block_size
        keys, table = request.block_keys, request.block_table
        full = end // size
        if len(keys) < full:
            tokens = request.all_token_ids
            parent = keys[-1] if keys else ROOT_KEY
            for i in range(len(keys), full):
                parent = block_key(parent, tokens[i * size : (i + 1) * size])
                keys.append(parent)
                self.allocator.register(table[i], parent)

    def preempt(self, victim: PrefixCachedRequest) -> None:
        super().preempt(victim)
        if victim.status is RequestStatus.WAITING:
            victim.block_keys = []  # its blocks stay cached; admitted again, it claims them

    # ----- reports ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return super().stats() | {"prefix_cache_queries_total": self.queried_tokens,
                                  "prefix_cache_hits_total": self.hit_tokens,
                                  "kv_blocks_cached": self.allocator.num_cached}

    def memory_report(self) -> str:
        rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        caching = ("prefix caching: off" if not self.config.enable_prefix_caching else
                   f"prefix caching: {self.hit_tokens} of {self.queried_tokens} prompt tokens found cached "
                   f"({rate:.0%}); {self.allocator.num_cached} blocks cached now, {self.allocator.evictions} evicted")
        return f"{super().memory_report()}\n{caching}"
