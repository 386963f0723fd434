"""Exercise 01-contiguous-attend: one request's attention over its own contiguous KV cache.

Write the body of `attend`; `python -m exercises run 01-contiguous-attend` plugs it into step 01's engine in
place of `ContiguousForward.attend` and runs step 01's tests and dry run on it.
"""

from __future__ import annotations

import torch

from step01_serial.kv_cache import ContiguousForward


def attend(self: ContiguousForward, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Store the new tokens' K/V in the cache, then attend over every token cached so far.

    `self` is a forward of the tokens at positions `[self.start, self.end)` of one request; `self.cache.k` and
    `self.cache.v` are `[num_layers, capacity, num_kv_heads, head_dim]`, filled up to `self.start`.
    `q` is `[num_new, num_heads, head_dim]`, `k` and `v` are `[num_new, num_kv_heads, head_dim]` (fewer KV
    heads than query heads: grouped-query attention). Return `[num_new, num_heads, head_dim]`: new token i
    (at position `self.start + i`) attends to the cached keys at positions `0 .. self.start + i`, no further.

    Hints (step01_serial/README.md, "The code" and the question on masks):
    - write `k` and `v` into `self.cache` at layer `layer_idx`, rows `[self.start, self.end)`, before reading;
    - `torch.nn.functional.scaled_dot_product_attention` wants `[heads, tokens, head_dim]` (transpose) and
      takes `enable_gqa=True` for the fewer KV heads;
    - one new token needs no mask; a prompt (`start == 0`) is plain causal; new tokens after a cached prefix
      need an explicit mask, because `is_causal` aligns the first query with the first key.
    """
    raise NotImplementedError("write ContiguousForward.attend: see the hints in its docstring")
