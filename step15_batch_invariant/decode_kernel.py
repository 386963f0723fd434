"""Attention on the GPU summed in pieces of a fixed size, the same for a decode row and a prefill row.

Step 06's decode kernel cuts a long sequence into as many splits as the batch leaves the GPU room for, so how a
token's keys are grouped follows the batch. Here the keys are cut into pieces of `PIECE` keys from key 0,
whatever the batch: each piece is folded into a running softmax of its own (64-key tiles, in order), then the
pieces are merged in order. That is the token's arithmetic everywhere:

- `attend_in_pieces`: a tile of query rows (a prefill chunk's, a verification's) walks its pieces one after the
  other in one program, merging as it goes. Step 15 hands it to step 06's prefill kernels (`ATTEND`).
- `pieces_decode`: one token per request, one program per (request, KV head, worker), the group's query heads
  as the program's rows (each key tile is read once per group), 16 of them for groups up to 16. A worker
  computes pieces worker, worker + WORKERS, ...; with one worker it merges in registers, with more each piece
  is stored (float32, exactly) and the last worker to finish merges all of them, in order. How many workers
  follows the batch, as step 06's splits do; it decides only which program computes a piece, never how a
  piece or the merge is summed.

A row's sum does not depend on which row of a tile it is, nor on what the other rows hold, and a piece or a
key tile wholly past a row's position changes nothing (it rescales by exp(0) = 1 and adds 0). Nor on how many
rows the tile has: every sum over keys runs on the tensor cores (`online_softmax_step`: a row's weights too,
not only the weighted values), whose order is the same for a 16-row decode tile and a 64-row prefill tile, where
`tl.sum`'s order follows how the compiler spreads each shape over threads. `probe.py` and `bench_kernels.py`
check decode rows against the same token in prefill chunks bit for bit on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step06_paged_attention.triton_kernels import (causal_bounds, dot_precision, empty_softmax, load_kv_tile,
                                                   softmax_tile_weights)

# Keys per piece: 16 of the kernels' 64-key tiles; fixed, never derived from the batch. Smaller pieces spread a
# long sequence over more programs at a small batch, but each piece starts its tile loop afresh and ends in a
# merge, which every prefill and decode row pays.
PIECE = tl.constexpr(1024)
QUERY_ROWS = 64  # rows per prefill program, as in step 06; a decode program has the fewest that hold its group
KEY_TILE = 64  # keys per tile, the same
MAX_WORKERS = 32  # programs sharing one sequence's pieces, at most


@triton.jit
def online_softmax_step(q, k, v, allowed, m_i, l_i, acc, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """Step 06's `_online_softmax_step` with a row's weights added up on the tensor cores, as `acc` is, in an
    order that does not follow the tile's shape (`tl.sum`'s order follows how the compiler spreads the tile
    over threads)."""
    m_new, p, alpha = softmax_tile_weights(q, k, allowed, m_i, PRECISION, MASKED)
    ones = tl.full([p.shape[1], 16], 1.0, v.dtype)  # 16 equal columns: a dot's narrowest; max picks one
    l_i = l_i * alpha + tl.max(tl.dot(p.to(v.dtype), ones, input_precision=PRECISION), axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_key_tiles(q, pos, m_i, l_i, acc, K_CACHE, V_CACHE, TABLE_ROW, start, end, last, kv_head, d, stride_slot,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                     MASKED: tl.constexpr):
    """Step 06's `attend_key_tiles` (the same tiles, in the same order), each folded by `online_softmax_step`."""
    for tile_start in range(start, end, TILE):
        t = tile_start + tl.arange(0, TILE)
        valid = t < last
        k, v = load_kv_tile(K_CACHE, V_CACHE, TABLE_ROW, t, valid, kv_head, d, stride_slot, HEAD_DIM, BLOCK_SIZE)
        allowed = valid[None, :] & (t[None, :] <= pos[:, None])  # causal
        m_i, l_i, acc = online_softmax_step(q, k, v, allowed, m_i, l_i, acc, PRECISION, MASKED)
    return m_i, l_i, acc


@triton.jit
def attend_piece(q, pos, start, end, seen_by_all, last, K_CACHE, V_CACHE, TABLE_ROW, kv_head, d, stride_slot,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Keys `start`..`end` (one piece) folded into a running softmax of their own: (m, l, acc) in float32.
    Tiles before `seen_by_all` are seen by every row and skip the causal mask, as in step 06."""
    m, l, acc = empty_softmax(BLOCK_M, HEAD_DIM)
    unmasked_end = tl.minimum(tl.maximum(seen_by_all, start), end)
    m, l, acc = attend_key_tiles(q, pos, m, l, acc, K_CACHE, V_CACHE, TABLE_ROW, start, unmasked_end, last,
                                 kv_head, d, stride_slot, HEAD_DIM, BLOCK_SIZE, TILE, PRECISION, False)
    m, l, acc = attend_key_tiles(q, pos, m, l, acc, K_CACHE, V_CACHE, TABLE_ROW, unmasked_end, end, last,
                                 kv_head, d, stride_slot, HEAD_DIM, BLOCK_SIZE, TILE, PRECISION, True)
    return m, l, acc


@triton.jit
def merge_piece(m_all, l_all, acc_all, m, l, acc):
    """Fold one piece's (m, l, acc) into the running ones: an online-softmax step's rescaling. A piece that saw
    no key (m = -inf, l = 0) leaves them exactly as they were."""
    m_new = tl.maximum(m_all, m)
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    old, new = tl.exp(m_all - base), tl.exp(m - base)
    return m_new, l_all * old + l * new, acc_all * old[:, None] + acc * new[:, None]


@triton.jit
def attend_in_pieces(q, pos, first_pos, context, scale, K_CACHE, V_CACHE, TABLE_ROW, kv_head, d, stride_slot,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Step 06's `attend_causally` (same arguments, same result up to rounding), the keys summed piece by piece."""
    q = (q.to(tl.float32) * scale).to(q.dtype)
    m_all, l_all, acc_all = empty_softmax(BLOCK_M, HEAD_DIM)
    last, seen_by_all = causal_bounds(first_pos, context, BLOCK_M, TILE)
    for start in range(0, last, PIECE):
        m, l, acc = attend_piece(q, pos, start, tl.minimum(start + PIECE, last), seen_by_all, last, K_CACHE, V_CACHE,
                                 TABLE_ROW, kv_head, d, stride_slot, HEAD_DIM, BLOCK_SIZE, BLOCK_M, TILE, PRECISION)
        m_all, l_all, acc_all = merge_piece(m_all, l_all, acc_all, m, l, acc)
    return acc_all / tl.where(l_all == 0.0, 1.0, l_all)[:, None]


@triton.jit
def _pieces_decode_kernel(Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQ_LENS, ACC, M, L, ARRIVED, OUT, scale,
                          stride_qb, stride_qh, stride_bt, stride_slot, stride_ob, stride_oh, max_pieces,
                          WORKERS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                          PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    worker = tl.program_id(2)
    context = tl.load(SEQ_LENS + b)  # the new token included: it sits at position context - 1
    pieces = (context + PIECE - 1) // PIECE
    active = tl.maximum(tl.minimum(pieces, WORKERS), 1)  # workers with pieces (one, for an empty row: zeros)
    if worker < active:  # a worker past the sequence's pieces has nothing to do
        g = tl.arange(0, BLOCK_M)
        heads = kv_head * GROUP + g
        in_group = g < GROUP  # rows past the group's heads are zeros, as rows past a chunk's end are
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0)
        q = (q.to(tl.float32) * scale).to(q.dtype)
        pos = tl.zeros([BLOCK_M], tl.int32) + (context - 1)  # every row is the same token
        _, seen_by_all = causal_bounds(context - 1, context, BLOCK_M, TILE)  # as for the token in a prefill
        table_row = BLOCK_TABLE + b * stride_bt
        m_all, l_all, acc_all = empty_softmax(BLOCK_M, HEAD_DIM)
        out = OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        # Where this (request, KV head)'s pieces are kept when several workers share them: per row of the group,
        # max_pieces stats (m, l) and max_pieces sums of HEAD_DIM.
        stats = ((b * tl.num_programs(1) + kv_head) * GROUP + g) * max_pieces
        sums = stats[:, None] * HEAD_DIM + d[None, :]
        for piece in range(worker, pieces, WORKERS):
            start = piece * PIECE
            m, l, acc = attend_piece(q, pos, start, tl.minimum(start + PIECE, context), seen_by_all, context,
                                     K_CACHE, V_CACHE, table_row, kv_head, d, stride_slot, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_M, TILE, PRECISION)
            if WORKERS == 1:  # every piece is this program's: merged as the prefill merges them, in registers
                m_all, l_all, acc_all = merge_piece(m_all, l_all, acc_all, m, l, acc)
            else:
                tl.store(M + stats + piece, m, mask=in_group)
                tl.store(L + stats + piece, l, mask=in_group)
                tl.store(ACC + sums + piece * HEAD_DIM, acc, mask=in_group[:, None])
        if WORKERS == 1:
            _store_rows(out, acc_all, l_all, in_group)
        else:  # count in; the worker that counts in last merges every piece, in order
            tl.debug_barrier()  # every thread's stores are made before the count says they are
            counter = ARRIVED + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1) == active - 1:  # acquire and release
                for piece in range(0, pieces):
                    m = tl.load(M + stats + piece, mask=in_group, other=float("-inf"), cache_modifier=".cg")
                    l = tl.load(L + stats + piece, mask=in_group, other=0.0, cache_modifier=".cg")
                    acc = tl.load(ACC + sums + piece * HEAD_DIM, mask=in_group[:, None], other=0.0,
                                  cache_modifier=".cg")
                    m_all, l_all, acc_all = merge_piece(m_all, l_all, acc_all, m, l, acc)
                tl.store(counter, 0)  # back to 0 for the next call (the next layer reuses the counters)
                _store_rows(out, acc_all, l_all, in_group)


@triton.jit
def _store_rows(out, acc, l, in_group):
    """The merged rows, normalised as step 06 does (a row that saw nothing divides by 1, not 0), the group's only."""
    tl.store(out, (acc / tl.where(l == 0.0, 1.0, l)[:, None]).to(out.dtype.element_ty), mask=in_group[:, None])


def pieces_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, max_seq_len: int, workers: int = 1,
                  arrived: torch.Tensor | None = None) -> torch.Tensor:
    """q: [batch, heads, head_dim], one new token per request, its K/V already in the cache; caches: one layer,
    [num_blocks, block_size, kv_heads, head_dim]; seq_lens: [batch] int32, the new token included, none past
    `max_seq_len`. `workers` programs share each (request, KV head)'s pieces; with more than one, `arrived`
    holds int32 zeros, at least batch x kv_heads, where they count in (and which they leave at 0). Launched as
    step 06's `paged_prefill` is (64-key tiles, 4 warps, 3 stages), with the fewest rows (16 at least) that
    hold a group: a 2-head group in a 64-row tile would spend 32 times the work it needs.
    Returns [batch, heads, head_dim]."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if group > QUERY_ROWS:
        raise ValueError(f"{group} query heads per KV head do not fit the {QUERY_ROWS} rows of a program")
    max_pieces = max(1, -(-max_seq_len // PIECE.value))
    kept = max_pieces if workers > 1 else 0  # pieces are kept in memory only for a merge by another program
    acc = torch.empty(batch, heads, kept, head_dim, device=q.device, dtype=torch.float32)
    m = torch.empty(batch, heads, kept, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    if workers > 1 and (arrived is None or arrived.numel() < batch * kv_heads):
        arrived = torch.zeros(batch * kv_heads, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    _pieces_decode_kernel[(batch, kv_heads, workers)](
        q, k_cache, v_cache, block_table, seq_lens, acc, m, l, arrived if workers > 1 else m, out, head_dim**-0.5,
        q.stride(0), q.stride(1), block_table.stride(0), kv_heads * head_dim, out.stride(0), out.stride(1),
        max_pieces, WORKERS=workers, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        TILE=KEY_TILE, PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=3)
    return out
