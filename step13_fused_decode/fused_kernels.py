"""The element-wise chains of a decoder layer, each as one Triton kernel instead of several PyTorch ones.

In PyTorch an RMSNorm is about eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), nine
with the residual add before it, RoPE about five per tensor (slice, negate, concatenate, two multiplies, add),
and the gated activation two. Each kernel reads and writes the whole activation and, even replayed from a CUDA
graph, pays a fixed cost of a few microseconds; a 7B model runs these chains 28 times per step. Here each
chain is one kernel that reads its inputs once, computes in float32 and writes once. Rounding happens once at
the end instead of after every operation, so in bfloat16 results can differ from PyTorch's in the last bit.
RoPE goes further: the kernel that rotates k also writes it, and v, into the KV cache, which saves step 06's
KV-write kernel. And the embedding lookup leaves its rows ready for the first layer's norm, as the skinny
matrix multiply leaves the residual stream for every later one, so that no norm kernel runs in a step.

On a machine without a GPU, set TRITON_INTERPRET=1 to run them on CPU tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step13_fused_decode.dependent_launch import wait_for_previous_kernel


@triton.jit
def _normalise_row(x, W, OUT, cols, mask, n, eps):
    """Store RMSNorm(x) for one float32 row like the reference: normalise in float32, round to the model's
    dtype, then scale by the weight."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = normed.to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(X, W, OUT, stride_x, stride_out, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _normalise_row(x, W, OUT + row * stride_out, cols, mask, n, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape, last dimension contiguous). `pdl`: launch
    with programmatic dependent launch (`step13_fused_decode/dependent_launch.py`)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps,
                                       BLOCK=triton.next_power_of_2(n), PDL=pdl, launch_pdl=pdl)
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(X, UPDATE, W, SUM, OUT, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0)
    update = tl.load(UPDATE + row * n + cols, mask=mask, other=0.0)
    # The sum is rounded to the model's dtype before it is normalised, as `x + update` in PyTorch is.
    total = (x.to(tl.float32) + update.to(tl.float32)).to(SUM.dtype.element_ty)
    tl.store(SUM + row * n + cols, total, mask=mask)
    _normalise_row(total.to(tl.float32), W, OUT + row * n, cols, mask, n, eps)


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, RMSNorm(x + update)) in one launch: x and update [tokens, hidden], contiguous."""
    tokens, n = x.shape
    total, out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(tokens,)](x, update, weight, total, out, n, eps, BLOCK=triton.next_power_of_2(n),
                                    PDL=pdl, launch_pdl=pdl)
    return total, out


@triton.jit
def _embed_for_norm_kernel(IDS, TABLE, NORM_W, STREAM, SCALED, SQUARES, stride_table, n, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    token = tl.load(IDS + row).to(tl.int64)
    x = tl.load(TABLE + token * stride_table + cols, mask=mask, other=0.0)
    tl.store(STREAM + row * n + cols, x, mask=mask)
    x = x.to(tl.float32)
    tl.store(SQUARES + row, tl.sum(x * x, axis=0))
    w = tl.load(NORM_W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(SCALED + row * n + cols, (x * w).to(SCALED.dtype.element_ty), mask=mask)


def embed_for_norm(input_ids: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor, pdl: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embedding rows of `input_ids` [tokens], made ready for the RMSNorm that reads them next, in one
    launch: (stream, scaled, squares) as the skinny matrix multiply leaves them after a residual add
    (`skinny_matmul.skinny_linear_add`): the rows, the rows times the norm's weight, and each row's sum of
    squares ([tokens, 1], float32), from which the projection after the norm divides by the root mean square."""
    tokens, n = input_ids.shape[0], table.shape[1]
    stream = torch.empty((tokens, n), dtype=table.dtype, device=table.device)
    scaled = torch.empty_like(stream)
    squares = torch.empty((tokens, 1), dtype=torch.float32, device=table.device)
    _embed_for_norm_kernel[(tokens,)](input_ids, table, norm_weight, stream, scaled, squares, table.stride(0), n,
                                      BLOCK=triton.next_power_of_2(n), PDL=pdl, launch_pdl=pdl)
    return stream, scaled, squares


@triton.jit
def rotate_head(src, dst, cos_row, sin_row, d, HALF: tl.constexpr):
    """RoPE on one head's vector at `src`, stored at `dst` in its dtype: computed in float32, rounded once."""
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    cos1 = tl.load(cos_row + d).to(tl.float32)
    cos2 = tl.load(cos_row + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_row + d).to(tl.float32)
    sin2 = tl.load(sin_row + HALF + d).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1)
    tl.store(dst + d, (x1 * cos1 - x2 * sin1).to(dst.dtype.element_ty))
    tl.store(dst + HALF + d, (x2 * cos2 + x1 * sin2).to(dst.dtype.element_ty))


@triton.jit
def _rope_and_kv_write_kernel(Q, K, V, COS, SIN, Q_OUT, K_CACHE, V_CACHE, SLOTS, stride_qt, stride_qh,
                              stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_slot,
                              HEADS: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
                              DECODE_EARLY: tl.constexpr):
    wait_for_previous_kernel(PDL, DECODE_EARLY)
    t = tl.program_id(0)
    h = tl.program_id(1)  # the query heads first, then the key/value heads
    d = tl.arange(0, HALF)
    # The inputs may be strided (slices of one packed projection); q's output is contiguous, and each
    # token's k and v go to its slot of the cache ([blocks, block_size, kv_heads, head_dim]).
    if h < HEADS:
        src = Q + t * stride_qt + h * stride_qh
        dst = Q_OUT + (t * HEADS + h) * 2 * HALF
    else:
        slot = tl.load(SLOTS + t).to(tl.int64)
        src = K + t * stride_kt + (h - HEADS) * stride_kh
        dst = K_CACHE + slot * stride_slot + (h - HEADS) * 2 * HALF
        v_src = V + t * stride_vt + (h - HEADS) * stride_vh
        v_dst = V_CACHE + slot * stride_slot + (h - HEADS) * 2 * HALF
        tl.store(v_dst + d, tl.load(v_src + d))
        tl.store(v_dst + HALF + d, tl.load(v_src + HALF + d))
    rotate_head(src, dst, COS + t * stride_ct, SIN + t * stride_ct, d, HALF)


def rotate_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, pdl: bool = False,
                        decode_early: bool = True) -> torch.Tensor:
    """RoPE on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], and each token's rotated k and
    its v written to its slot of one layer's caches [num_blocks, block_size, kv_heads, head_dim], in one
    launch: step 06's KV write and the RoPE kernel in one. cos and sin are [tokens, 1, head_dim]; each
    head's vector must be contiguous. Returns the rotated q, a new contiguous tensor. With `pdl`, the
    kernel after it (the decode kernel) is placed early unless `decode_early` is off."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rope_and_kv_write_kernel[(tokens, heads + kv_heads)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), kv_heads * head_dim,
        HEADS=heads, HALF=head_dim // 2, PDL=pdl, DECODE_EARLY=decode_early, launch_pdl=pdl,
    )
    return q_out


@triton.jit
def _silu_mul_kernel(GATE, UP, OUT, stride_gate, stride_up, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(GATE + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * n + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate and up [tokens, n], each row contiguous (the rows may be strided, as in
    slices of one packed projection); returns a new, contiguous tensor."""
    tokens, n = gate.shape
    out = torch.empty((tokens, n), dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(tokens, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), n, BLOCK=block,
                                                      PDL=pdl, launch_pdl=pdl)
    return out
