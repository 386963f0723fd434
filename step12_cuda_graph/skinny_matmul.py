"""A matrix multiply for a few rows of input: a decode step's projections at small batch sizes.

At batch 1 to 16 a projection y = x W^T reads a weight of megabytes to multiply it by a handful of rows, so
it lasts as long as the weight takes to stream from memory. What decides that time is how many of the
GPU's streaming multiprocessors (132 on an H200) keep loads in flight until the end. cuBLAS picks wide tiles
for these shapes: on Qwen2.5-7B's gate/up weight (37888 x 3584) its kernel is named for tiles of 384 x 8,
99 of them for 132 multiprocessors, and the smaller projections get split along K with a second kernel to
reduce the parts. Here each program owns a narrow band of output columns (`block_n`) over the whole of K,
the bands sized so that every multiprocessor streams its share until the end (`skinny_config`), and one
launch per projection adds the bias in the same pass. The rows are padded to 16 inside the kernel (the
smallest tile a tensor-core `tl.dot` takes); the padding is never loaded from memory.

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from step12_cuda_graph.dependent_launch import wait_for_previous_kernel

MAX_ROWS = 16  # the rows of one tile, the most the kernel takes; larger batches keep cuBLAS (not measured)


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch settings: output columns per program, K per loop iteration, warps, pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def skinny_config(n: int, element_size: int = 2, multiprocessors: int = 132, shared_memory: int = 227 * 1024
                  ) -> SkinnyConfig:
    """Launch settings for a weight of n output features, from `matmul_bench.py` on the H200.

    A pipeline deep enough to keep a multiprocessor's loads in flight fills most of its shared memory, so
    one program runs per multiprocessor. A weight with few output features (Qwen2.5-7B's o and down: 3584)
    is best cut into bands just narrow enough that every program runs at once, in one wave: 32 features,
    or 64 where 32 would make more programs than multiprocessors (q/k/v: 4608). A weight with many
    (gate/up, the output head) makes many waves anyway: shallower pipelines, two programs per multiprocessor.
    Stages are dropped where they would not fit in a device's shared memory (float32 weights, smaller GPUs)."""
    if n <= 32 * multiprocessors:
        config = SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
    elif n <= 64 * multiprocessors:
        config = SkinnyConfig(block_n=64, block_k=256, num_warps=4, num_stages=5)
    else:
        config = SkinnyConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
    block_k, stages = config.block_k, config.num_stages
    while stages * (MAX_ROWS + config.block_n) * block_k * element_size > shared_memory:  # an x and a weight tile
        if stages > 2:
            stages -= 1
        else:
            block_k //= 2
    return SkinnyConfig(config.block_n, block_k, config.num_warps, stages)


@cache  # asked once per projection at start-up (113 for a 28-layer model); the device does not change
def device_limits(device: torch.device) -> dict[str, int]:
    """The multiprocessor count and shared memory per program that `skinny_config` plans for."""
    if device.type != "cuda":
        return {}  # the interpreter: any settings run
    properties = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return {"multiprocessors": properties["multiprocessor_count"], "shared_memory": properties["max_shared_mem"]}


@triton.jit
def _skinny_matmul_kernel(X, W, BIAS, OUT, M, N, K, stride_xm, stride_wn, stride_om,
                          HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        x = tl.load(X + rows[:, None] * stride_xm + (k0 + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + (k0 + ks)[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:  # float32 models: full-precision products, as cuBLAS gives them (no TF32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig = SkinnyConfig(), pdl: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows <= MAX_ROWS, K] with contiguous rows and a contiguous weight.
    `pdl`: launch with programmatic dependent launch (`dependent_launch.py`)."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}: use F.linear")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("skinny_linear needs x's rows and the weight contiguous")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, PDL=pdl, launch_pdl=pdl,
    )
    return out
