"""Exercise 03-vectorized-gather: a whole batch's K/V out of the paged pool in one indexing operation.

Write the body of `gather_kv`; `python -m exercises run 03-vectorized-gather` plugs it into step 03's engine in
place of `VectorizedDecodeForward.gather_kv` and runs step 03's tests and dry run on it.
"""

from __future__ import annotations

import torch

from step03_vectorized_gather.kv_cache import VectorizedDecodeForward


def gather_kv(self: VectorizedDecodeForward, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's cached keys and values of layer `layer_idx`, as one dense, padded batch.

    Inputs: `self` is one decode forward of `batch = len(self.seq_lens)` requests; `self.seq_lens[i]` counts
    request i's tokens, the new one included (its K/V is already written). The pool `self.cache.k` /
    `self.cache.v` is `[num_layers, num_blocks, block_size, kv_heads, head_dim]`. `self.block_table` is a
    `[batch, self.max_blocks]` integer tensor: row i is request i's block table (physical blocks in logical
    order), padded with block 0. `self.max_len` (an int) is the longest length.
    Returns: `(keys, values)`, each `[batch, self.max_len, kv_heads, head_dim]`.
    Rule: `keys[i, p]` is the key of request i's token at position p, for every `p < self.seq_lens[i]`; past its
    own length a row may hold anything finite (attention masks it). One indexing operation per tensor for the
    whole batch, no Python loop over requests or blocks: that loop is step 02's `PagedDecodeForward.gather_kv`,
    which this replaces. (The tests check values and shape; a loop passes them too, and is what this step removes.)

    Example: blocks of 16; two requests of 40 and 9 tokens with tables [6, 7, 8] and [13]: `self.block_table`
    is [[6, 7, 8], [13, 0, 0]], `self.max_len` 40. Row 0 is blocks 6, 7, 8 end to end, cut to 40 positions;
    row 1 is block 13 (9 tokens of its own, 7 unused slots), then block 0 twice, cut: 31 masked positions.

    Hints (step03_vectorized_gather/README.md, "The idea: index tensors built once per forward" and its worked
    example): indexing a tensor's first axis with an integer tensor of shape `[batch, max_blocks]` returns a
    tensor with those two axes in its place.
    """
    raise NotImplementedError("write VectorizedDecodeForward.gather_kv: see the hints in its docstring")
