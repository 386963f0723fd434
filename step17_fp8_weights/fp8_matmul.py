"""The multiply of a decode step's few rows by an FP8 weight: y = (x V^T) * scale + bias, V the e4m3 values.

A decode step reads every weight once for a handful of rows, so it lasts as long as the weight takes to stream from
memory: one byte a weight here against two in bf16. Each program owns a band of `block_n` output features over the
whole of K (as step 13's skinny multiply does), loads the e4m3 values, widens them to the input's dtype (exactly:
e4m3's 3 mantissa bits and 4 exponent bits fit in bf16 and float32), multiplies on the tensor cores with float32
sums, and multiplies each output feature's sum by its row's scale once, at the end, before the bias.

More rows than a tile are compute-bound, not read-bound: `scaled_mm_rowwise` gives them to cuBLAS's FP8 multiply
(`torch._scaled_mm`), each activation row quantized to e4m3 with its own scale on the way in.

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step13_fused_decode.skinny_matmul import SkinnyConfig, device_limits, skinny_config
from step17_fp8_weights.fp8 import E4M3, quantize

# One tile of rows, the most the kernel takes: a decode step's batch, read-bound. More rows are compute-bound, and
# go to `scaled_mm_rowwise`.
MAX_ROWS = 64


def fp8_config(n: int, block_m: int, x_element_size: int, multiprocessors: int = 132,
               shared_memory: int = 227 * 1024) -> SkinnyConfig:
    """Launch settings for `n` output features: step 13's bands, with twice the K per iteration (a byte a weight
    keeps the bytes in flight per stage as they were), and as many stages as fit the x tile (`block_m` rows in
    x's dtype) and the weight tile together in shared memory."""
    base = skinny_config(n, multiprocessors=multiprocessors, shared_memory=shared_memory)
    block_k, stages = 2 * base.block_k, base.num_stages
    while stages * (block_m * x_element_size + base.block_n) * block_k > shared_memory:
        if stages > 2:
            stages -= 1
        else:
            block_k //= 2
    return SkinnyConfig(base.block_n, block_k, base.num_warps, stages)


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


def fp8_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times the FP8 weight (`values` [N, K] e4m3, `scale` [N] float32): [M, N] in x's dtype.
    `config`: launch settings (default: `fp8_config`'s)."""
    m, k = x.shape
    n = values.shape[0]
    assert m <= MAX_ROWS and values.dtype == E4M3 and values.shape[1] == k and scale.shape == (n,)
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))  # the smallest tile a tensor-core dot takes is 16 rows
    config = config or fp8_config(n, block_m, x.element_size(), **device_limits(x.device))
    _fp8_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x, values, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), values.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def scaled_mm_fits(x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether cuBLAS's row-wise scaled FP8 multiply takes these operands: bf16 out, and K and N multiples of 16."""
    return x.is_cuda and x.dtype == torch.bfloat16 and values.shape[0] % 16 == 0 and values.shape[1] % 16 == 0


def scaled_mm_rowwise(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """x [M, K] bf16 times the FP8 weight on cuBLAS's FP8 tensor-core path: each row of x quantized to e4m3 with
    its own scale (its largest magnitude onto 448), the product scaled by both scales, in bf16."""
    rows = quantize(x)  # as a weight's rows are
    out = torch._scaled_mm(rows.values, values.t(), scale_a=rows.scale[:, None], scale_b=scale[None, :],
                           out_dtype=x.dtype)
    return out if bias is None else out + bias
