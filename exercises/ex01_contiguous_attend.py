"""Exercise 01-contiguous-attend: one request's attention over its own contiguous KV cache.

Write the body of `attend`; `python -m exercises run 01-contiguous-attend` plugs it into step 01's engine in
place of `ContiguousForward.attend` and runs step 01's tests and dry run on it.
"""

from __future__ import annotations

import torch

from step01_serial.kv_cache import ContiguousForward


def attend(self: ContiguousForward, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one request's new tokens over its whole contiguous cache, the new tokens' K/V stored first.

    Inputs: `self` is a forward of the tokens at positions `[self.start, self.end)` of one request; its cache
    `self.cache.k` / `self.cache.v`, `[num_layers, capacity, num_kv_heads, head_dim]`, holds positions
    `0 .. self.start - 1`. `q` is `[num_new, num_heads, head_dim]`, `k` and `v` `[num_new, num_kv_heads, head_dim]`
    (fewer KV heads than query heads: grouped-query attention, query head h reads KV head h // (num_heads //
    num_kv_heads)).
    Returns: `[num_new, num_heads, head_dim]`, each new token's attention output.
    Rule: afterwards the cache holds `k`, `v` at rows `[self.start, self.end)` of layer `layer_idx`; new token i
    (position `self.start + i`) attends to the cached keys at positions `0 .. self.start + i`, no further.

    Example: a prompt of 5 tokens was cached (start 0, end 5); the first decode step has start 5, end 6: its one
    query attends to 6 keys, positions 0..5. Two tokens added after a cached prefix of 5 (start 5, end 7): the
    first sees positions 0..5, the second 0..6.

    Hints (step01_serial/README.md, "The code" and the question on masks): store before you read;
    `torch.nn.functional.scaled_dot_product_attention` can do the attention (mind its layout of heads and tokens,
    and its grouped-query option); its `is_causal` aligns the first query with the first key, which is right
    only when there is no cached prefix.
    """
    raise NotImplementedError("write ContiguousForward.attend: see the hints in its docstring")
