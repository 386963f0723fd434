"""step06's Triton kernels against a plain PyTorch reference, on tiny shapes.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in
conftest.py). Inputs are random, never zeros; block tables are shuffled so that no request's blocks are
contiguous; lengths are uneven and cross block boundaries; GQA ratios 1, 3 and 7 are covered.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="Triton is not installed (it ships for Linux x86-64 only)")
from step06_paged_attention import triton_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16
KV_HEADS = 2


def make_cache(num_blocks: int, block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=DEVICE, dtype=dtype), torch.randn(shape, device=DEVICE, dtype=dtype)


def shuffled_tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Each request gets random, non-contiguous blocks; rows padded with -1 (never read)."""
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    need = [-(-n // block_size) for n in seq_lens]
    rows, at = [], 0
    for n in need:
        rows.append(blocks[at : at + n] + [-1] * (max(need) - n))
        at += n
    return torch.tensor(rows, device=DEVICE, dtype=torch.int32)


def dense(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One request's first `length` cached tokens as [length, kv_heads, head_dim]: the reference gather."""
    block_size = cache.shape[1]
    blocks = table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q: [n, heads, dim] at positions first_pos.., keys [ctx, kv_heads, dim]; causal; float64 for exactness."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx, device=q.device)[None, :] <= (first_pos + torch.arange(n, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(),
        attn_mask=mask, enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_splits", [1, 3, 6, 12])  # 12: merged by the separate kernel
def test_paged_decode_matches_reference(group: int, block_size: int, num_splits: int) -> None:
    seq_lens = [1, 5, 37, 16]
    k_cache, v_cache = make_cache(64, block_size, torch.float32)
    table = shuffled_tables(seq_lens, block_size, 64)
    q = torch.randn(len(seq_lens), KV_HEADS * group, HEAD_DIM, device=DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32)
    arrived = torch.zeros(len(seq_lens) * KV_HEADS, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the splits' counters are back at 0 after a call, so a kept buffer serves the next
        out = triton_kernels.paged_decode(q, k_cache, v_cache, table, lens, num_splits=num_splits, tile=16,
                                          arrived=arrived)
        assert arrived.count_nonzero() == 0
        for i, n in enumerate(seq_lens):
            expected = reference_attention(q[i : i + 1], dense(k_cache, table[i], n), dense(v_cache, table[i], n),
                                           n - 1)
            torch.testing.assert_close(out[i : i + 1].double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("packed", [False, True])
def test_write_kv_stores_each_token_at_its_slot(block_size: int, packed: bool) -> None:
    k_cache, v_cache = make_cache(16, block_size, torch.float32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([37, 2, 60 % (16 * block_size), 11], device=DEVICE)
    row = KV_HEADS * HEAD_DIM
    if packed:  # column slices of packed projections (step 12): k and v with different token strides
        k_new = torch.randn(4, 3 * row, device=DEVICE)[:, row : 2 * row].view(4, KV_HEADS, HEAD_DIM)
        v_new = torch.randn(4, 5 * row, device=DEVICE)[:, 4 * row :].view(4, KV_HEADS, HEAD_DIM)
    else:
        k_new = torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE)
        v_new = torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE)
    triton_kernels.write_kv(k_new, v_new, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.flatten(0, 1), before_v.flatten(0, 1)
    expected_k[slots.long()] = k_new
    expected_v[slots.long()] = v_new
    assert torch.equal(k_cache.flatten(0, 1), expected_k) and torch.equal(v_cache.flatten(0, 1), expected_v)


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_prefill_with_cached_prefix_matches_reference(group: int, block_size: int) -> None:
    """Four requests: no prefix, a prefix ending mid-block, a prefix shorter and one longer than the new
    tokens (several whole key tiles before the causal diagonal, then the masked ones); causal attention."""
    prefix_lens, new_lens = [0, 6, 29, 70], [9, 4, 35, 21]
    context = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_cache, v_cache = make_cache(64, block_size, torch.float32)
    table = shuffled_tables(context, block_size, 64, seed=1)
    q = torch.randn(sum(new_lens), KV_HEADS * group, HEAD_DIM, device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    ctx = torch.tensor(context, device=DEVICE, dtype=torch.int32)
    out = triton_kernels.paged_prefill(q, k_cache, v_cache, table, cu, ctx, max(new_lens), block_m=16, tile=16)
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        expected = reference_attention(q[rows], dense(k_cache, table[i], p + n), dense(v_cache, table[i], p + n), p)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=2e-5)
