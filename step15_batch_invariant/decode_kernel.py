"""Decode attention with step 06's prefill arithmetic, one program per (request, KV head).

A decode row must get the bits its token would get as a row of a prefill chunk, so the decode kernel has to
run the prefill kernel's tile body: the same 64 query rows by 64 keys, the same tiles of keys, in the same
order (`attend_causally`). Step 06's prefill kernel gives each query head a program of its own; for a
decode step that is one real row in 64, and each of a group's heads reads the group's keys again (7 times for
Qwen2.5-7B's 28 query and 4 KV heads). Here one program holds all of a group's heads as its rows, every row
at the new token's position, so each key tile is read once per group, as in step 06's decode kernel.

A row's sum does not depend on which row of the tile it is, nor on what the other rows hold (tensor cores
compute each output from its own row and column), which `probe.py` checks bit for bit on the GPU against
the same token as the last row of prefill chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step06_paged_attention.triton_kernels import attend_causally, dot_precision

QUERY_ROWS = 64  # the prefill kernel's rows per program: the tile shape its arithmetic is compiled for
KEY_TILE = 64  # and its keys per tile


@triton.jit
def _grouped_decode_kernel(Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQ_LENS, OUT, scale,
                           stride_qb, stride_qh, stride_bt, stride_slot, stride_ob, stride_oh,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           BLOCK_M: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(SEQ_LENS + b)  # the new token included: it sits at position context - 1
    g = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + g
    in_group = g < GROUP  # rows past the group's heads are zeros, as rows past a chunk's end are
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0)
    pos = tl.zeros([BLOCK_M], tl.int32) + (context - 1)  # every row is the same token
    out = attend_causally(q, pos, context - 1, context, scale, K_CACHE, V_CACHE, BLOCK_TABLE + b * stride_bt,
                          kv_head, d, stride_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_M, TILE, PRECISION)
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=in_group[:, None])


def grouped_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor) -> torch.Tensor:
    """q: [batch, heads, head_dim], one new token per request, its K/V already in the cache; caches: one layer,
    [num_blocks, block_size, kv_heads, head_dim]; seq_lens: [batch] int32, the new token included.
    Launched as step 06's `paged_prefill` launches (64 rows, 64 keys, 4 warps, 3 stages): the same arithmetic.
    Returns [batch, heads, head_dim]."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if group > QUERY_ROWS:
        raise ValueError(f"{group} query heads per KV head do not fit the {QUERY_ROWS} rows of a program")
    out = torch.empty_like(q)
    _grouped_decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_table, seq_lens, out, head_dim**-0.5,
        q.stride(0), q.stride(1), block_table.stride(0), kv_heads * head_dim, out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=QUERY_ROWS, TILE=KEY_TILE,
        PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=3)
    return out
