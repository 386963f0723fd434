"""Exercise 15-split-attention: attention that sums a token's keys in fixed pieces, in order, in any batch.

Write the body of `split_attention`; `python -m exercises run 15-split-attention` plugs it into step 15 in place
of `step15_batch_invariant.attention.split_attention` (both paths of its CPU backend, decode and prefill, call
it) and runs step 15's tests and its dry run (`--batch-invariant`) on it.
"""

from __future__ import annotations

import torch


def split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
                    split: int = 32) -> torch.Tensor:
    """Causal attention of each query row over its keys, folded into a running softmax `split` keys at a time.

    q: [rows, heads, head_dim]; keys, values: [rows or 1, width, kv_heads, head_dim], width a multiple of
    `split` (a first dimension of 1: every row shares them); query_pos: [rows], row r sees keys 0..query_pos[r].
    heads is a multiple of kv_heads (grouped-query attention: query head h reads KV head h // (heads //
    kv_heads)). Work in float32; return [rows, heads, head_dim] in q's dtype.

    Keep per row and head a running max m (start: -inf), a running sum l of exp(score - m) (start: 0) and a
    running acc, the sum of exp(score - m) * value (start: 0). For each piece of `split` keys, from the first:
    scores = (q . k) / sqrt(head_dim), with keys past the row's position set to -inf; m_new = max(m, the
    piece's max); scale = exp(m - m_new); l = l * scale + sum of exp(scores - m_new); acc = acc * scale + sum
    of exp(scores - m_new) * v; m = m_new. The result is acc / l.

    Why it is batch-invariant: a piece wholly past a row's position is all -inf, so it leaves m as it is,
    scales by exp(0) = 1 and adds 0: a longer neighbour (or more padding) adds pieces that change nothing. Sum
    with plain element-wise products and `.sum` over a dimension, not a batched matmul, whose method could
    follow the batch. Guard a row that sees no key yet (padding rows): use 0 instead of m_new where m_new is
    -inf, and divide by 1 where l is 0.

    Hints (step15_batch_invariant/README.md, "Fix 2: attention in pieces of a fixed size"):
    `keys[:, start:start + split].float().repeat_interleave(group, dim=2)` is a piece for every query head;
    `(q.float()[:, None] * k).sum(-1)` its scores, [rows, split, heads].
    """
    raise NotImplementedError("write step15_batch_invariant.attention.split_attention: see the hints")
