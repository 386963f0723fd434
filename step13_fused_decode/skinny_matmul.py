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

A greedy decode step needs only the argmax of the output head, so `skinny_linear_argmax` returns that and
writes no logits: each program finds the best column of its band per row, folds it into one int64 per row
with an atomic max, and the program that finishes last writes the token ids. The logits are rounded to the
model's dtype first, so the token is the one PyTorch's argmax would pick from a logits tensor.

On a machine without a GPU, set TRITON_INTERPRET=1 to run it on CPU tensors (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from step13_fused_decode.dependent_launch import wait_for_previous_kernel

MAX_ROWS = 16  # the rows of one tile, the most the kernel takes; larger batches keep cuBLAS (not measured)


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch settings: output columns per program, K per loop iteration, warps, pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    def grid(self, n: int) -> tuple[int, ...]:
        """The programs for n output features: one per band, each over the whole of K."""
        return (triton.cdiv(n, self.block_n),)


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


# What an empty slot of `ArgmaxState.best` holds: lower than any packed (value, column) of a logit.
LOWEST_INT64 = tl.constexpr(-2**63)


@triton.jit
def row_inverse_rms(SQUARES_IN, M, K, num_parts_in, eps, PARTS_IN: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each row's 1 / root mean square over its K values, from the sums of squares in the parts that the kernel
    that wrote x left ([M, num_parts_in])."""
    rows = tl.arange(0, BLOCK_M)
    parts = tl.arange(0, PARTS_IN)
    squares = tl.load(SQUARES_IN + rows[:, None] * num_parts_in + parts[None, :],
                      mask=(rows < M)[:, None] & (parts < num_parts_in)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def band_product(X, W, M, N, K, stride_xm, stride_wn, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's band of the product: x's rows times `BLOCK_N` output features of W over the whole of K, summed
    in float32. W's tiles are multiplied in x's dtype (a weight stored in it is read as it is)."""
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
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0).to(x.dtype)
        if IEEE:  # float32 models: full-precision products, as cuBLAS gives them (no TF32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def finish_band(acc, BIAS, OUT, RESIDUAL, NEXT_NORM_W, SCALED, SQUARES_OUT, BEST, ARRIVED, TOKENS, M, N, stride_om,
                HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What becomes of this program's band `acc` (float32, from `band_product`): the bias added; then written, or
    added to the residual stream and made ready for the next norm, or only its rows' best columns kept (ARGMAX)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if ADD_RESIDUAL:  # the residual stream plus this projection, rounded as `residual + projection` would be
        residual = tl.load(RESIDUAL + rows[:, None] * stride_om + cols[None, :], mask=mask, other=0.0)
        acc = acc.to(OUT.dtype.element_ty).to(tl.float32) + residual.to(tl.float32)
    out = acc.to(OUT.dtype.element_ty)
    if ARGMAX:  # each row's greedy token instead of its logits (OUT gives only the dtype they are rounded to)
        logits = tl.where(col_mask[None, :], out.to(tl.float32), float("-inf"))  # past N: never the best
        best = tl.max(logits, axis=1)
        first = tl.min(tl.where(logits == best[:, None], cols[None, :], N), axis=1)  # ties: torch takes the first
        # One int64 per row whose signed order is the value's, then the lower column: one atomic max then keeps
        # both. A float's bits, read as an int32, are in order for positive floats and in reverse for negative
        # ones; flipping all but the sign bit of the negative ones puts them in order too. -0.0 is made 0.0 first,
        # since the two are equal to torch.argmax and must not differ here.
        bits = tl.where(best == 0.0, 0.0, best).to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        packed = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - first).to(tl.int64)  # a lower column: larger
        tl.atomic_max(BEST + rows, packed, mask=row_mask)
        # Count in; the program that counts in last reads every row's best and writes the tokens, so no
        # other kernel reduces the bands (step 06's decode kernel merges its splits the same way).
        tl.debug_barrier()  # every thread's atomics are made before the count says they are
        if tl.atomic_add(ARRIVED, 1) == tl.num_programs(0) - 1:  # acquire and release: the others' maxima seen
            # Read and reset in one atomic (at the L2, where the others' atomics were made), so that the next
            # call, or the next replay of a graph, finds the slots empty again.
            packed = tl.atomic_xchg(BEST + rows, tl.full((BLOCK_M,), LOWEST_INT64, tl.int64), mask=row_mask)
            tl.store(TOKENS + rows, 0x7FFFFFFF - (packed & 0x7FFFFFFF), mask=row_mask)
            tl.store(ARRIVED, 0)
    else:
        tl.store(OUT + rows[:, None] * stride_om + cols[None, :], out, mask=mask)
    if ADD_RESIDUAL:  # made ready for the norm that reads the stream next: this band's squares, and the band
        stream = out.to(tl.float32)  # scaled by the norm's weight (columns past N are zeros)
        tl.store(SQUARES_OUT + rows * tl.num_programs(0) + tl.program_id(0), tl.sum(stream * stream, axis=1),
                 mask=row_mask)
        scale = tl.load(NEXT_NORM_W + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(SCALED + rows[:, None] * stride_om + cols[None, :],
                 (stream * scale[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_matmul_kernel(X, W, BIAS, OUT, SQUARES_IN, RESIDUAL, NEXT_NORM_W, SCALED, SQUARES_OUT, BEST, ARRIVED,
                          TOKENS, M, N, K, stride_xm, stride_wn, stride_om, num_parts_in, eps,
                          HAS_BIAS: tl.constexpr, NORMALISE: tl.constexpr, PARTS_IN: tl.constexpr,
                          ADD_RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    if NORMALISE:  # x is the residual stream scaled by the norm's weight: each output row is divided by its RMS
        inverse_rms = row_inverse_rms(SQUARES_IN, M, K, num_parts_in, eps, PARTS_IN, BLOCK_M)
    acc = band_product(X, W, M, N, K, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    if NORMALISE:
        acc *= inverse_rms[:, None]
    finish_band(acc, BIAS, OUT, RESIDUAL, NEXT_NORM_W, SCALED, SQUARES_OUT, BEST, ARRIVED, TOKENS, M, N, stride_om,
                HAS_BIAS, ADD_RESIDUAL, ARGMAX, BLOCK_M, BLOCK_N)


class ArgmaxState:
    """Where the programs of one `skinny_linear_argmax` launch meet: each row's best (value, column) so far,
    packed in one int64, and the count of programs done. Every launch leaves both as it found them (the lowest
    int64, 0), so they are made once and kept: a captured CUDA graph holds their addresses, and zeroing them
    per call would cost it a kernel. One launch at a time: two in flight on different streams would mix."""

    def __init__(self, device: torch.device | str) -> None:
        self.best = torch.full((MAX_ROWS,), LOWEST_INT64.value, dtype=torch.int64, device=device)
        self.arrived = torch.zeros(1, dtype=torch.int32, device=device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig = SkinnyConfig(), pdl: bool = False, squares: torch.Tensor | None = None,
                  eps: float = 0.0, kernel: triton.JITFunction | None = None, **kernel_args: torch.Tensor
                  ) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows <= MAX_ROWS, K] with contiguous rows and a contiguous weight.

    With `squares` [rows, parts] (from `skinny_linear_add`), x is a residual stream already scaled by an
    RMSNorm's weight, and each output row is divided by its root mean square: the projection of norm(x).
    `pdl`: launch with programmatic dependent launch (`step13_fused_decode/dependent_launch.py`).
    `kernel`: another kernel with this one's arguments, built on `band_product` and `finish_band`, given its
    further arguments as `kernel_args` (default: this module's own)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    launch(x, weight, out, config, pdl, bias=bias, squares=squares, eps=eps, kernel=kernel, **kernel_args)
    return out


def skinny_linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: SkinnyConfig = SkinnyConfig(), pdl: bool = False,
                         squares: torch.Tensor | None = None, eps: float = 0.0, state: ArgmaxState | None = None,
                         kernel: triton.JITFunction | None = None, **kernel_args: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of `skinny_linear(x, weight, bias, config, pdl, squares, eps)`, as int64 [rows],
    without the logits: the greedy tokens of an output head. The outputs are compared as rounded to x's dtype,
    ties going to the lowest column, as `logits.argmax(dim=-1)` picks them. `state`: buffers kept from call to
    call (a new one if not given, which a CUDA graph must not capture)."""
    state = ArgmaxState(x.device) if state is None else state
    tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    # The logits are not written: x stands in for them, with the dtype they are rounded to.
    launch(x, weight, x, config, pdl, bias=bias, squares=squares, eps=eps, argmax=state, tokens=tokens,
            kernel=kernel, **kernel_args)
    return tokens


def skinny_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, next_norm_weight: torch.Tensor,
                      config: SkinnyConfig = SkinnyConfig(), pdl: bool = False,
                      kernel: triton.JITFunction | None = None, **kernel_args: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual + F.linear(x, weight) (no bias), made ready for the RMSNorm that reads it next, in one launch.

    Returns (stream, scaled, squares): the new residual stream [rows, n]; the stream times the next norm's
    weight, which `skinny_linear` multiplies as it is; and each row's sum of squares in one float32 part per
    program [rows, parts], which `skinny_linear` adds up to normalise its output rows. No norm kernel runs."""
    rows, n = x.shape[0], weight.shape[0]
    if residual.shape != (rows, n) or not residual.is_contiguous():
        raise ValueError(f"the residual must be [{rows}, {n}] and contiguous, got {tuple(residual.shape)}")
    out, scaled = torch.empty_like(residual), torch.empty_like(residual)
    squares = torch.empty((rows, triton.cdiv(n, config.block_n)), dtype=torch.float32, device=x.device)
    launch(x, weight, out, config, pdl, residual=residual, next_norm_weight=next_norm_weight, scaled=scaled,
            squares_out=squares, kernel=kernel, **kernel_args)
    return out, scaled, squares


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: SkinnyConfig, pdl: bool,
            bias: torch.Tensor | None = None, squares: torch.Tensor | None = None, eps: float = 0.0,
            residual: torch.Tensor | None = None, next_norm_weight: torch.Tensor | None = None,
            scaled: torch.Tensor | None = None, squares_out: torch.Tensor | None = None,
            argmax: ArgmaxState | None = None, tokens: torch.Tensor | None = None,
            kernel: triton.JITFunction | None = None, **kernel_args: torch.Tensor) -> None:
    """One launch of the kernel (or of `kernel`, given `kernel_args` besides) on up to `MAX_ROWS` rows, each switch
    on where its tensors are given (bias; squares: NORMALISE; residual, next_norm_weight, scaled, squares_out:
    ADD_RESIDUAL; argmax, tokens: ARGMAX). A switch that is off never reads its pointers, so any tensor stands in
    for them."""
    rows, k = x.shape
    n = weight.shape[0]
    _check(x, weight)
    if squares is not None and (squares.shape[0] != rows or not squares.is_contiguous()):
        raise ValueError(f"squares must be [{rows}, parts] and contiguous, got {tuple(squares.shape)}")

    def given(tensor: torch.Tensor | None) -> torch.Tensor:
        return weight if tensor is None else tensor

    best, arrived = (argmax.best, argmax.arrived) if argmax is not None else (None, None)
    (kernel or _skinny_matmul_kernel)[config.grid(n)](
        x, weight, given(bias), out, given(squares), given(residual), given(next_norm_weight), given(scaled),
        given(squares_out), given(best), given(arrived), given(tokens),
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0), squares.shape[1] if squares is not None else 0,
        eps, HAS_BIAS=bias is not None, NORMALISE=squares is not None,
        PARTS_IN=triton.next_power_of_2(squares.shape[1]) if squares is not None else 1,
        ADD_RESIDUAL=residual is not None, ARGMAX=argmax is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, PDL=pdl, launch_pdl=pdl, **kernel_args,
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}: use F.linear")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("skinny_linear needs x's rows and the weight contiguous")
