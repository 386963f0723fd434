"""Exercise 03-vectorized-gather: a whole batch's K/V out of the paged pool in one indexing operation.

Write the body of `gather_kv`; `python -m exercises run 03-vectorized-gather` plugs it into step 03's engine in
place of `VectorizedDecodeForward.gather_kv` and runs step 03's tests and dry run on it.
"""

from __future__ import annotations

import torch

from step03_vectorized_gather.kv_cache import VectorizedDecodeForward


def gather_kv(self: VectorizedDecodeForward, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's cached keys and values of layer `layer_idx`, as one dense, padded batch.

    `self` is one decode forward of `batch = len(self.seq_lens)` requests; `self.seq_lens[i]` counts request
    i's tokens, the new one included (its K/V is already written). The pool is `self.cache.k` and
    `self.cache.v`, each `[num_layers, num_blocks, block_size, kv_heads, head_dim]` (`self.cache.block_size`
    slots a block). `self.block_table` is a `[batch, self.max_blocks]` integer tensor built once per forward:
    row i is request i's block table (its physical blocks, in logical order), padded with block 0 up to
    `self.max_blocks`, the block count of the longest request. `self.max_len` is the longest length, a Python
    int.

    Return `(keys, values)`, each `[batch, self.max_len, kv_heads, head_dim]`: `keys[i, p]` is the key of
    request i's token at position p, for every `p < self.seq_lens[i]`. Past its own length a row may hold
    anything finite (attention masks those positions): whatever the padding reads.
    Use one indexing operation per tensor (K, then V) for the whole batch: no Python loop over requests or
    blocks (that is step 02's `PagedDecodeForward.gather_kv`, which this replaces). The tests check the values
    and the shape, not how you got them: a loop passes them too, and is what this step removes.

    Example: blocks of 16, two requests of 40 and 9 tokens with tables [6, 7, 8] and [13], so
    `self.block_table` is [[6, 7, 8], [13, 0, 0]] and `self.max_len` is 40. Indexing one layer's pool
    `[num_blocks, 16, kv_heads, head_dim]` with it gives `[2, 3, 16, kv_heads, head_dim]`; merged to
    `[2, 48, kv_heads, head_dim]` and cut to 40 positions. Row 0 is blocks 6, 7, 8 end to end (40 tokens of
    its own); row 1 is block 13 (9 of its own, 7 unused slots), then block 0 twice, cut: 31 masked positions.

    Hints (step03_vectorized_gather/README.md, "The idea: index tensors built once per forward" and its worked
    example):
    - `self.cache.k[layer_idx]` is one layer's pool; indexing its first axis with a `[batch, max_blocks]`
      integer tensor returns `[batch, max_blocks, block_size, kv_heads, head_dim]`, one copy;
    - merge the two middle axes (`flatten(1, 2)`, `reshape` or `view`), then slice to `self.max_len`.
    """
    raise NotImplementedError("write VectorizedDecodeForward.gather_kv: see the hints in its docstring")
