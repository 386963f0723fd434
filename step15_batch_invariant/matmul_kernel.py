"""A matrix multiply that computes every output the same way whatever the number of rows.

y = x W^T, x: [rows, K], W: [N, K]. Each program owns one tile of `BLOCK_M` rows by `block_n` output
features and walks K from start to end in steps of `block_k`, accumulating in float32: so an output's sum
is always taken over the same chunks of K, in the same order, with the same instruction, whichever tile
its row falls in and however many rows there are. Nothing here looks at the row count: the tile comes
from the weight's number of inputs alone (`tile_for`), and there is no split of K (a split would add partial sums
in an order that depends on how many splits the batch size called for).

A library's multiply (cuBLAS, or MKL on a CPU) is free to do otherwise, and does: it picks a kernel, a
tile and a split of K for each shape, so the same row comes out with different rounding in a batch of 1
and a batch of 64 (`probe.py` measures it).

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # rows per tile: the same for every call, a decode step's single row as a prefill's thousands


@dataclass(frozen=True)
class MatmulTile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def tile_for(k: int) -> MatmulTile:
    """The tile for a weight of k inputs. It depends on k alone, not on the output features either: q, k and
    v multiplied one by one (a prefill) and packed into one weight (step 13's decode) then sum every output
    with the same instructions. Bands of 32 features give a one-row decode step a program for each of an
    H200's 132 multiprocessors even on its narrowest weights (3,584 features: 112 bands)."""
    return MatmulTile(block_n=32, block_k=min(128, triton.next_power_of_2(k)))


@triton.jit
def _invariant_matmul_kernel(X, W, BIAS, OUT, rows, n, k, stride_x, stride_w, stride_out,
                             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # neighbouring programs share a band of the weight, read from memory once
    pid_n = tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_idx = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):  # the one order every output is summed in
        x = tl.load(X + m_idx[:, None] * stride_x + (k0 + k_idx)[None, :],
                    mask=(m_idx[:, None] < rows) & (k0 + k_idx[None, :] < k), other=0.0)
        w = tl.load(W + n_idx[:, None] * stride_w + (k0 + k_idx)[None, :],
                    mask=(n_idx[:, None] < n) & (k0 + k_idx[None, :] < k), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee" if IEEE else "tf32")
    if HAS_BIAS:
        acc += tl.load(BIAS + n_idx, mask=n_idx < n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + m_idx[:, None] * stride_out + n_idx[None, :], acc.to(OUT.dtype.element_ty),
             mask=(m_idx[:, None] < rows) & (n_idx[None, :] < n))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), x: [rows, K] with contiguous rows, weight: [N, K] contiguous. Row i of the result
    depends on row i of x and on the weight only, bit for bit."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("invariant_matmul needs x's rows and the weight contiguous")
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    tile = tile_for(k)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, tile.block_n))
    _invariant_matmul_kernel[grid](x, weight, bias if bias is not None else weight, out, rows, n, k,
                                   x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                   IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=tile.block_n,
                                   BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
