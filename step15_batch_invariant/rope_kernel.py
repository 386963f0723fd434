"""RoPE on q and k in one Triton launch: the one rotation every path of the batch-invariant engine runs.

Step 13's decode kernel rotates and writes the cache in one launch, while the other paths rotate with
PyTorch's element-wise ops. Both are exact per element, but not the same arithmetic: PyTorch rounds each of
x * cos, rotate(x) * sin and their sum to the model's dtype, where a kernel computes the whole expression in
float32 (fusing a multiply and an add) and rounds once. A token rotated one way in its prefill chunk and the
other way when it decodes would get other bits. So under `--batch-invariant` every path calls this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, stride_xt, stride_xh, stride_ct, HEADS: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    src = X + t * stride_xt + h * stride_xh
    dst = OUT + (t * HEADS + h) * 2 * HALF
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    cos1 = tl.load(COS + t * stride_ct + d).to(tl.float32)
    cos2 = tl.load(COS + t * stride_ct + HALF + d).to(tl.float32)
    sin1 = tl.load(SIN + t * stride_ct + d).to(tl.float32)
    sin2 = tl.load(SIN + t * stride_ct + HALF + d).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1)
    tl.store(dst + d, (x1 * cos1 - x2 * sin1).to(OUT.dtype.element_ty))
    tl.store(dst + HALF + d, (x2 * cos2 + x1 * sin2).to(OUT.dtype.element_ty))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], each head's vector contiguous (tokens may be strided, as slices of a
    packed projection); cos, sin: [tokens, 1, head_dim]. Returns the rotated x, contiguous."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    _rope_kernel[(tokens, heads)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), HEADS=heads,
                                  HALF=head_dim // 2)
    return out
