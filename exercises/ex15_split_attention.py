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

    Inputs: q, `[rows, heads, head_dim]`; keys and values, `[rows or 1, width, kv_heads, head_dim]` (a first
    dimension of 1: every row shares them), width a multiple of `split`; query_pos, `[rows]`: row r sees keys
    0..query_pos[r]. heads is a multiple of kv_heads (grouped-query attention: query head h reads KV head
    h // (heads // kv_heads)).
    Returns: `[rows, heads, head_dim]` in q's dtype, softmax(scores) @ values per row and head, computed in float32.
    Rule: keep per row and head a running max m (start -inf), a running sum l of exp(score - m) (start 0) and a
    running acc, the sum of exp(score - m) * value (start 0). Take the keys in pieces of exactly `split`, from
    the first: scores = (q . k) / sqrt(head_dim), keys past the row's position at -inf; m_new = max(m, the
    piece's max); rescale l and acc by exp(m - m_new) and add the piece's exp(scores - m_new) and
    exp(scores - m_new) * v; m = m_new. The result is acc / l.
    Why it is batch-invariant: a piece wholly past a row's position is all -inf: it leaves m as it is, scales by
    exp(0) = 1 and adds 0, so a longer neighbour (or more padding) adds pieces that change nothing. Sum with
    element-wise products and `.sum` over a dimension, not a batched matmul, whose method could follow the
    batch. A row that sees no key yet (a padding row) must give no NaN: use 0 instead of m_new where m_new is
    -inf, and divide by 1 where l is 0.

    Example: split 32, row 0 at position 19 beside a row at position 89 (width 96: three pieces): row 0's first
    piece holds its 20 keys; its second and third are all -inf and change neither m, l nor acc: its output has
    the bits it has alone in a width of 32.

    Hints (step15_batch_invariant/README.md, "Fix 2: attention in pieces of a fixed size").
    """
    raise NotImplementedError("write step15_batch_invariant.attention.split_attention: see the hints")
