"""The multiply of a decode step's few rows by an FP8 weight: y = (x V^T) * scale + bias, V the e4m3 values.

A decode step reads every weight once for a handful of rows, so it lasts as long as the weight takes to stream from
memory: one byte a weight here against two in bf16. Each program owns a band of `block_n` output features over the
whole of K (as step 13's skinny multiply does), loads the e4m3 values, widens them to the input's dtype (exactly:
e4m3's 3 mantissa bits and 4 exponent bits fit in bf16 and float32), multiplies on the tensor cores with float32
sums, and multiplies each output feature's sum by its row's scale once, at the end, before the bias.

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step13_fused_decode.skinny_matmul import device_limits, skinny_config

# One tile of rows, the most the kernel takes: a decode step's batch, read-bound. More rows are compute-bound, and
# `Fp8Linear` multiplies them by the widened values instead.
MAX_ROWS = 64


@triton.jit
def _fp8_matmul_kernel(X, W, SCALE, BIAS, OUT, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        x = tl.load(X + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + (k0 + ks)[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0).to(x.dtype)  # exact: every e4m3 value is a bf16 and a float32 value
        if IEEE:  # float32 models: full-precision products (no TF32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    acc *= tl.load(SCALE + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def fp8_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times the FP8 weight (`values` [N, K] e4m3, `scale` [N] float32): [M, N] in x's dtype."""
    m, k = x.shape
    n = values.shape[0]
    assert m <= MAX_ROWS and values.dtype == torch.float8_e4m3fn and values.shape[1] == k and scale.shape == (n,)
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    config = skinny_config(n, element_size=1, **device_limits(x.device))
    block_m = max(16, triton.next_power_of_2(m))  # the smallest tile a tensor-core dot takes is 16 rows
    _fp8_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x, values, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), values.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
