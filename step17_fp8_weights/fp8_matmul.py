"""The multiply of a decode step's few rows by an FP8 weight: y = (x V^T) * scale + bias, V the e4m3 values.

A decode step reads every weight once for a handful of rows, so it lasts as long as the weight takes to stream from
memory: one byte a weight here against two in bf16. The kernel is step 13's skinny multiply with one change: each
program owns a band of `block_n` output features over the whole of K (`band_product`), loading the e4m3 values and
widening them to the input's dtype (exactly: e4m3's 3 mantissa bits and 4 exponent bits fit in bf16 and float32),
with float32 sums on the tensor cores; then each output feature's sum is multiplied by its row's scale, once, before
the rest of step 13's ending (`finish_band`: the bias, and in the fused decode the residual add and the next norm's
sums of squares). Up to `MAX_ROWS` rows: a decode step's batch.

More rows than that are compute-bound, not read-bound: `scaled_mm_rowwise` gives them to cuBLAS's FP8 multiply
(`torch._scaled_mm`), each activation row quantized to e4m3 with its own scale first, in one launch (`quantize_rows`;
`fp8.fp8_linear` chooses).

A weight with few bands leaves multiprocessors with one program or none, and one program alone does not keep enough
loads in flight. There K is cut into parts (`Fp8Config.split_k`, a second grid axis): each program sums its band
over its part, and the last part of a band to finish adds up the parts, in order, and ends the band.

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from step13_fused_decode.dependent_launch import wait_for_previous_kernel
# MAX_ROWS: the most rows our kernel takes, step 13's tile (a decode step's batch). Past it the multiply goes to
# cuBLAS's FP8 tiles (`scaled_mm_rowwise`), each row of x quantized first.
from step13_fused_decode.skinny_matmul import (MAX_ROWS, SkinnyConfig, band_product, device_limits, finish_band,
                                               launch, row_inverse_rms)


@dataclass(frozen=True)
class Fp8Config(SkinnyConfig):
    """Step 13's launch settings; K cut into `split_k` parts (a program per band and part of K)."""

    split_k: int = 1

    def grid(self, n: int) -> tuple[int, ...]:
        return (triton.cdiv(n, self.block_n), self.split_k)


@cache  # one set per shape and settings, shared by every launch of them (one at a time, on one stream)
def launch_args(n: int, config: Fp8Config, device: torch.device) -> dict[str, torch.Tensor | int]:
    """The kernel's arguments that follow from its settings: how many parts of K, where they meet (each part's
    float32 sums [split_k, MAX_ROWS, n]) and per band the count of parts done. The last part of a band to count in
    adds the parts up and resets the count, so the buffers are made once and kept (a captured CUDA graph holds their
    addresses), as step 13's `ArgmaxState` is."""
    return {"PARTS_OF_K": config.split_k,
            "PARTS": torch.empty((config.split_k, MAX_ROWS, n), dtype=torch.float32, device=device),
            "PARTS_ARRIVED": torch.zeros(config.grid(n)[0], dtype=torch.int32, device=device)}


@cache  # asked per multiply where no pack holds the settings: worked out once per shape
def fp8_config(block_m: int, x_element_size: int, device: torch.device, n: int, k: int) -> Fp8Config:
    """Launch settings for a weight [n, k]: bands of 32 features, 3 stages, and as many programs as a device holds at
    once: for each of Qwen2.5-7B's four projections at 1 and 8 rows on an H100, the fastest of bench_fp8_matmul.py's
    grid or within a few percent of it.

    A program holds its x tile and weight tile in shared memory, one pair per stage. With 256 of K per iteration that
    is 48 KiB at 16 rows, so four programs share a multiprocessor, 528 on an H100. Gate/up's 1,184 bands fill those
    alone, and take 512 of K per iteration (fewer, longer loads). The other projections have 112 to 144 bands: K is
    cut in two until bands times parts fill the device, keeping 4 iterations or more per part (with 3 stages in
    flight, a shorter part spends most of its time filling the pipeline). Stages are dropped where the tiles (`block_m`
    rows in x's dtype) would not fit a device's shared memory."""
    block_n, stages = 32, 3
    limits = device_limits(device)
    shared_memory = limits.get("shared_memory", 227 * 1024)  # an H100's, in the interpreter
    multiprocessors = limits.get("multiprocessors", 132)
    bands = triton.cdiv(n, block_n)

    def fitting(block_k: int) -> tuple[int, int]:
        """Stages that fit, and how many programs of them run at once."""
        program_memory = (block_m * x_element_size + block_n) * block_k  # an x tile and a weight tile, per stage
        fit = stages
        while fit * program_memory > shared_memory and fit > 1:
            fit -= 1
        return fit, multiprocessors * max(1, shared_memory // (fit * program_memory))

    long_stages, long_at_once = fitting(512)
    if bands >= long_at_once:
        return Fp8Config(block_n, 512, 4, long_stages, 1)
    block_k = 256
    short_stages, at_once = fitting(block_k)
    split_k = 1
    while bands * split_k < at_once and 2 * split_k <= triton.cdiv(k, 4 * block_k):
        split_k *= 2
    return Fp8Config(block_n, block_k, 4, short_stages, split_k)


@triton.jit
def fp8_skinny_kernel(X, W, BIAS, OUT, SQUARES_IN, RESIDUAL, NEXT_NORM_W, SCALED, SQUARES_OUT, BEST, ARRIVED,
                      TOKENS, M, N, K, stride_xm, stride_wn, stride_om, num_parts_in, eps, SCALE, PARTS,
                      PARTS_ARRIVED, HAS_BIAS: tl.constexpr, NORMALISE: tl.constexpr, PARTS_IN: tl.constexpr,
                      ADD_RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                      PARTS_OF_K: tl.constexpr):
    """Step 13's skinny kernel over e4m3 values W and their row scales SCALE [N] (float32); on a grid whose second
    axis cuts K into PARTS_OF_K parts, the last part of each band to finish adds up the parts' sums (PARTS) first."""
    wait_for_previous_kernel(PDL)
    if NORMALISE:
        inverse_rms = row_inverse_rms(SQUARES_IN, M, K, num_parts_in, eps, PARTS_IN, BLOCK_M)
    # This program's part of K (all of it when PARTS_OF_K is 1); the parts start on a tile's edge.
    k_per_part = tl.cdiv(tl.cdiv(K, PARTS_OF_K), BLOCK_K) * BLOCK_K
    k_first = tl.program_id(1) * k_per_part
    acc = band_product(X + k_first, W + k_first, M, N, tl.minimum(k_per_part, K - k_first), stride_xm, stride_wn, IEEE,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    band = tl.program_id(0)
    cols = band * BLOCK_N + tl.arange(0, BLOCK_N)
    last = True
    if PARTS_OF_K > 1:
        rows = tl.arange(0, BLOCK_M)
        sums = PARTS + rows[:, None] * N + cols[None, :]  # this band in part 0's sums; part p's lie p * BLOCK_M * N on
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(sums + tl.program_id(1) * BLOCK_M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's stores are made before the count says they are
        last = tl.atomic_add(PARTS_ARRIVED + band, 1) == PARTS_OF_K - 1  # acquire and release
        if last:  # the parts added in order, whichever finished last: the same sums every time
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for part in range(PARTS_OF_K):
                acc += tl.load(sums + part * BLOCK_M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(PARTS_ARRIVED + band, 0)  # for the next launch, or the next replay of a graph
    if last:
        if NORMALISE:
            acc *= inverse_rms[:, None]
        acc *= tl.load(SCALE + cols, mask=cols < N, other=0.0)[None, :]  # once per output feature, after the sum
        finish_band(acc, BIAS, OUT, RESIDUAL, NEXT_NORM_W, SCALED, SQUARES_OUT, BEST, ARRIVED, TOKENS, M, N,
                    stride_om, HAS_BIAS, ADD_RESIDUAL, ARGMAX, BLOCK_M, BLOCK_N)


def fp8_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: Fp8Config | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times the FP8 weight (`values` [N, K] e4m3, `scale` [N] float32): [M, N] in x's dtype.
    `config`: launch settings (default: `fp8_config`'s)."""
    m, k = x.shape
    n = values.shape[0]
    assert values.dtype == torch.float8_e4m3fn and values.shape[1] == k and scale.shape == (n,)
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))  # as `launch` tiles the rows
    config = config or fp8_config(block_m, x.element_size(), x.device, n, k)
    launch(x, values, out, config, pdl=False, bias=bias, kernel=fp8_skinny_kernel, SCALE=scale,
           **launch_args(n, config, x.device))
    return out


@triton.jit
def quantize_rows_kernel(X, VALUES, SCALE, K, stride_x, max_value, smallest_scale, BLOCK: tl.constexpr):
    """One row of x to e4m3 with its own scale: its largest magnitude over `max_value` (448), as `fp8.quantize`
    scales a weight's row. Two passes over the row (the second mostly from the L2): the largest, then the values."""
    row = tl.program_id(0)
    x_row = X + row * stride_x
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
    # divisions rounded as IEEE's (div_rn; Triton's `/` is approximate in float32): the scale and the values `quantize`
    # computes, to the bit
    scale = tl.maximum(tl.div_rn(tl.max(largest, axis=0), max_value), smallest_scale)  # all-zero rows keep a scale > 0
    for k0 in range(0, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(tl.div_rn(x, scale), -max_value), max_value)
        tl.store(VALUES + row * K + ks, scaled.to(VALUES.dtype.element_ty), mask=ks < K)
    tl.store(SCALE + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) to e4m3 values [M, K] and a float32 scale per row [M], in one launch, as
    `fp8.quantize` computes them in five: what cuBLAS's row-wise FP8 multiply takes for x."""
    assert x.stride(-1) == 1
    m, k = x.shape
    values = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    max_value = torch.finfo(torch.float8_e4m3fn).max
    quantize_rows_kernel[(m,)](x, values, scale, k, x.stride(0), max_value, torch.finfo(torch.float32).tiny,
                               BLOCK=min(4096, triton.next_power_of_2(k)))
    return values, scale


def scaled_mm_fits(x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether cuBLAS's row-wise scaled FP8 multiply takes these operands: bf16 out, and K and N multiples of 16."""
    return x.is_cuda and x.dtype == torch.bfloat16 and values.shape[0] % 16 == 0 and values.shape[1] % 16 == 0


def scaled_mm_rowwise(x_values: torch.Tensor, x_scale: torch.Tensor, values: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x (as e4m3 rows `x_values` [M, K] and their scales `x_scale` [M]) times the FP8 weight on cuBLAS's FP8
    tensor-core path, the product scaled by both scales, in `out_dtype` (bf16)."""
    out = torch._scaled_mm(x_values, values.t(), scale_a=x_scale[:, None], scale_b=scale[None, :], out_dtype=out_dtype)
    return out if bias is None else out + bias
