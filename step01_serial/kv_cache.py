"""One request's KV cache as one contiguous tensor, reserved in full when the request starts.

This is the simplest cache there is, and its cost is the lesson of step02: a request that may generate up
to `max_tokens` reserves room for all of them up front, used or not, and no other request can use that room.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.config import ModelConfig
from common.model import ForwardContext


class ContiguousKVCache:
    """K and V for every layer of one request: [num_layers, capacity, num_kv_heads, head_dim] each."""

    def __init__(self, config: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0  # tokens stored so far (a host int: no need to ask the device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class ContiguousForward(ForwardContext):
    """A forward of `num_new` tokens of one request whose first `start` tokens are already cached."""

    def __init__(self, cache: ContiguousKVCache, start: int, num_new: int, device: torch.device) -> None:
        if start + num_new > cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens; cannot store up to position {start + num_new}")
        self.cache = cache
        self.start = start
        self.end = start + num_new
        self.positions = torch.arange(start, self.end, device=device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        cache.k[layer_idx, self.start : self.end] = k
        cache.v[layer_idx, self.start : self.end] = v
        keys = cache.k[layer_idx, : self.end].transpose(0, 1)  # [kv_heads, end, head_dim]
        values = cache.v[layer_idx, : self.end].transpose(0, 1)
        queries = q.transpose(0, 1)  # [heads, new, head_dim]
        num_new = self.end - self.start
        if num_new == 1:
            mask, causal = None, False  # one query sees every cached key
        elif self.start == 0:
            mask, causal = None, True  # plain prefill
        else:  # new tokens after a cached prefix: query i sees keys up to start + i
            key_pos = torch.arange(self.end, device=q.device)
            query_pos = torch.arange(self.start, self.end, device=q.device)
            mask, causal = key_pos[None, :] <= query_pos[:, None], False
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True
        )
        return out.transpose(0, 1)  # [new, heads, head_dim]
