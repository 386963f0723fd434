"""Attention that reads a token's keys in the same pieces, in the same order, whatever else is in the step.

A token's attention output is a sum over its keys. Steps 06 to 12 sum it in different ways depending on the
batch: the decode kernel cuts a sequence into as many splits as the batch leaves the GPU room for, the
prefill kernel walks it tile by tile, and on a CPU PyTorch's attention pads every sequence to the longest of
its batch. Here every row, whether it decodes, ends a prefill chunk of any budget, or verifies a proposed
token, is summed over fixed pieces of `KEY_SPLIT` keys from the first key on, each piece folded into a
running softmax in order. A piece past the row's own position is all masked, and folding it in is exact
(it scales by exp(0) = 1 and adds 0), so a longer neighbour in the batch changes nothing.

- `InvariantTorchBackend` (any device; a CPU's default): `split_attention` in plain PyTorch.
- `InvariantTritonBackend` (GPU): pieces of 1,024 keys (sixteen 64-key tiles folded in order), each a running
  softmax of its own, then merged in order: step 06's prefill kernels with a body that sums in pieces, and a
  decode kernel whose programs share a long sequence's pieces (`decode_kernel.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from step06_paged_attention.backends import AttentionMetadata, TorchBackend
from step12_cuda_graph.mixed_graphs import TILE_ROWS, TileListTritonBackend

KEY_SPLIT = 32  # keys per piece of the running softmax: fixed, never derived from the batch


def split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
                    split: int = KEY_SPLIT) -> torch.Tensor:
    """Causal attention of each query row over its keys, summed piece by piece.

    q: [rows, heads, head_dim]; keys, values: [rows or 1, width, kv_heads, head_dim] with width a multiple of
    `split` (1: every row shares them); query_pos: [rows], each row sees keys 0..query_pos. Float32 inside.
    Returns [rows, heads, head_dim] in q's dtype."""
    rows, heads, head_dim = q.shape
    group = heads // keys.shape[2]
    q32 = q.float()[:, None] * head_dim**-0.5  # [rows, 1, heads, head_dim]
    m = torch.full((rows, heads), float("-inf"), device=q.device)  # the running max of each row's scores
    l = torch.zeros(rows, heads, device=q.device)  # the running sum of exp(score - m)
    acc = torch.zeros(rows, heads, head_dim, device=q.device)  # the running sum of exp(score - m) * value
    for start in range(0, keys.shape[1], split):
        k = keys[:, start:start + split].float().repeat_interleave(group, dim=2)  # [rows or 1, split, heads, d]
        v = values[:, start:start + split].float().repeat_interleave(group, dim=2)
        scores = (q32 * k).sum(-1)  # [rows, split, heads]: one dot product per key, over head_dim
        key_pos = torch.arange(start, start + split, device=q.device)
        scores = scores.masked_fill((key_pos[None, :] > query_pos[:, None])[:, :, None], float("-inf"))
        m_new = torch.maximum(m, scores.amax(1))
        base = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that sees no key yet (padding) stays 0
        p = torch.exp(scores - base[:, None, :])
        scale = torch.exp(m - base)
        l = l * scale + p.sum(1)
        acc = acc * scale[..., None] + (p[..., None] * v).sum(1)
        m = m_new
    return (acc / l.masked_fill(l == 0.0, 1.0)[..., None]).to(q.dtype)


def padded_to_split(rows: torch.Tensor, width: int, split: int = KEY_SPLIT) -> torch.Tensor:
    """[n, width, ...] keys or values zero-padded along `width` to the next multiple of `split`."""
    extra = -width % split
    return F.pad(rows, (0, 0, 0, 0, 0, extra)) if extra else rows


class InvariantTorchBackend(TorchBackend):
    """Step 06's reference backend with both paths through `split_attention`."""

    name = "torch"

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata):
        keys = padded_to_split(self.gather(k_cache, meta, meta.max_seq_len), meta.max_seq_len)
        values = padded_to_split(self.gather(v_cache, meta, meta.max_seq_len), meta.max_seq_len)
        return split_attention(q, keys, values, meta.seq_lens.long() - 1)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata):
        keys = self.gather(k_cache, meta, meta.max_seq_len)
        values = self.gather(v_cache, meta, meta.max_seq_len)
        out = torch.empty_like(q)
        start = 0
        for i, (n, length) in enumerate(zip(meta.q_lens, meta.seq_lens_host)):
            rows = slice(start, start + n)  # this request's new tokens, at positions length - n .. length - 1
            query_pos = torch.arange(length - n, length, device=q.device)
            out[rows] = split_attention(q[rows], padded_to_split(keys[i:i + 1, :length], length),
                                        padded_to_split(values[i:i + 1, :length], length), query_pos)
            start += n
        return out


class InvariantTritonBackend(TileListTritonBackend):
    """Step 12's Triton backend, every row's keys summed in pieces of a fixed size (`decode_kernel.py`): prefill
    chunks and verification rows through step 06's prefill kernels with `attend_in_pieces`, decode rows through
    `pieces_decode`, with the same tiles, pieces and merges. Step 06's decode kernel is not used: with one split
    it walks the same tiles in the same order, yet on the H200 it gives other bits (`probe.py`): it adds a
    row's weights with `tl.sum`, whose order follows its tile's shape, where step 15 adds them on the tensor
    cores (`decode_kernel.online_softmax_step`)."""

    def num_splits(self, batch: int, kv_heads: int, max_seq_len: int) -> int:
        """Workers per (request, KV head): enough to fill one wave of about four programs per multiprocessor,
        as step 06 splits, but never more than the longest sequence has pieces, and one once the rows alone
        give every multiprocessor a program (on the H200, at batch 64, two workers were slower than one:
        results/gpu/batch-invariance-kernels.json)."""
        from step15_batch_invariant.decode_kernel import MAX_WORKERS, PIECE  # Triton is optional

        if batch * kv_heads >= self.num_sms:
            return 1
        one_wave = 4 * self.num_sms // (batch * kv_heads)
        return max(1, min(one_wave, -(-max_seq_len // PIECE.value), MAX_WORKERS))

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata):
        from step15_batch_invariant.decode_kernel import QUERY_ROWS, attend_in_pieces, pieces_decode

        batch, heads = q.shape[:2]
        kv_heads = k_cache.shape[2]
        if heads // kv_heads > QUERY_ROWS:  # a group too big for one program: a prefill program per head
            return self.paged_prefill(q, k_cache, v_cache, meta.block_table, meta.cu_q_lens, meta.seq_lens, 1,
                                      attend=attend_in_pieces)
        if self.arrived is None or self.arrived.numel() < batch * kv_heads:
            self.arrived = torch.zeros(max(batch, self.max_batch) * kv_heads, dtype=torch.int32, device=q.device)
        return pieces_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.max_seq_len,
                             self.num_splits(batch, kv_heads, meta.max_seq_len), self.arrived)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata):
        from step15_batch_invariant.decode_kernel import attend_in_pieces

        return self.paged_prefill(q, k_cache, v_cache, meta.block_table, meta.cu_q_lens, meta.seq_lens,
                                  meta.max_q_len, attend=attend_in_pieces)

    def prefill_tiles(self, q, k_cache, v_cache, meta: AttentionMetadata, tile_request, tile_index):
        from step12_cuda_graph.prefill_tiles import paged_prefill_tiles
        from step15_batch_invariant.decode_kernel import attend_in_pieces

        return paged_prefill_tiles(q, k_cache, v_cache, meta.block_table, meta.cu_q_lens, meta.seq_lens,
                                   tile_request, tile_index, TILE_ROWS, attend=attend_in_pieces)
