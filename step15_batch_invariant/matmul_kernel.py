"""A matrix multiply that sums every output over K in one order, whatever the number of rows.

y = x W^T, x: [rows, K], W: [N, K]. Each program owns a tile of rows by output features and walks K from start
to end, each tensor-core multiply-add adding its slice of K into a float32 running sum. There is no split of
K: a split would add partial sums in an order that depends on how many splits the batch size called for,
which is what a library's multiply does (cuBLAS picks a kernel, a tile and a split of K for each shape, MKL
a matrix-vector kernel for one row), so the same row comes out with other bits at batch 1 and batch 64.

The tile's shape decides which outputs a program computes, not how each is summed: on the H200 every tile
shape we tried, 16 to 128 rows by 16 to 128 features by 64 to 256 of K, gives the same bits (`probe.py`
checks it on your GPU, `bench_kernels.py` for every tile of its sweep, and the engine's tests check whole
requests). So the tile may follow the shape, as a library's would: narrow bands for a decode step's few rows,
so that every multiprocessor streams its share of the weight, and wide tiles for a prefill, which reuse each
loaded weight across many rows, as wide as still gives the multiprocessors enough programs.

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do); the
interpreter's dot is NumPy's, whose bits do depend on the tile, so there one tile serves every call.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once: Triton chose its mode at its import


@dataclass(frozen=True)
class MatmulTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def tile_for(rows: int, n: int, k: int, element_size: int = 2, sms: int = 132) -> MatmulTile:
    """The tile for `rows` rows times an [n, k] weight. Every tile gives the same bits, so the tile may follow
    the shape as a library's does; these choices come from `bench_kernels.py`'s sweep on the H200
    (results/gpu/batch-invariance-kernels.json). Up to 16 rows, bands of 16 by 32 features that stream the
    weight; up to 64, 64 by 64 for a weight wider than deep, 64 by 32 stepping 256 of K otherwise. More rows
    (a prefill, or a decode of many sequences): the widest tile that still gives half the `sms` multiprocessors
    (the H200 has 132) a program, since a program walks all of K alone (no split): 128 x 128, or 64 x 128; a
    narrow weight (Qwen3-0.6B's o and down projections, 1,024 features) falls back to the 64-row bands.
    float32 halves the K step, so that the pipeline still fits in shared memory."""
    shrink = element_size // 2
    if INTERPRETED:
        return MatmulTile(128, 128, 64 // shrink, num_warps=8, num_stages=3)
    if rows <= 16:
        return MatmulTile(16, 32, 256 // shrink)
    if rows > 64:
        wide = (MatmulTile(128, 128, 64 // shrink, num_warps=8, num_stages=3), MatmulTile(64, 128, 128 // shrink))
        for tile in wide:
            if triton.cdiv(rows, tile.block_m) * triton.cdiv(n, tile.block_n) >= sms // 2:
                return tile
    return MatmulTile(64, 64, 128 // shrink) if n > k else MatmulTile(64, 32, 256 // shrink)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count, asked once (1 off a GPU, where the interpreter's one tile serves)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


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
    for k0 in range(0, k, BLOCK_K):  # the one order every output is summed in: K from start to end
        x = tl.load(X + m_idx[:, None] * stride_x + (k0 + k_idx)[None, :],
                    mask=(m_idx[:, None] < rows) & (k0 + k_idx[None, :] < k), other=0.0)
        w = tl.load(W + n_idx[:, None] * stride_w + (k0 + k_idx)[None, :],
                    mask=(n_idx[:, None] < n) & (k0 + k_idx[None, :] < k), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee" if IEEE else "tf32")
    if HAS_BIAS:
        acc += tl.load(BIAS + n_idx, mask=n_idx < n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + m_idx[:, None] * stride_out + n_idx[None, :], acc.to(OUT.dtype.element_ty),
             mask=(m_idx[:, None] < rows) & (n_idx[None, :] < n))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: MatmulTile | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), x: [rows, K] with contiguous rows, weight: [N, K] contiguous. Row i of the result
    depends on row i of x and on the weight only, bit for bit. `tile`: by default `tile_for`'s."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("invariant_matmul needs x's rows and the weight contiguous")
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    tile = tile or tile_for(rows, n, k, x.element_size(), multiprocessors(x.device))
    grid = (triton.cdiv(rows, tile.block_m), triton.cdiv(n, tile.block_n))
    _invariant_matmul_kernel[grid](x, weight, bias if bias is not None else weight, out, rows, n, k,
                                   x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                   IEEE=x.dtype == torch.float32, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                                   BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
