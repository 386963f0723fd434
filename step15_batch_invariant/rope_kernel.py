"""RoPE on q and k in one Triton launch: the one rotation every path of the batch-invariant engine runs.

Step 13's decode kernel rotates and writes the cache in one launch, while the other paths rotate with
PyTorch's element-wise ops. Both are exact per element, but not the same arithmetic: PyTorch rounds each of
x * cos, rotate(x) * sin and their sum to the model's dtype, where a kernel computes the whole expression in
float32 (fusing a multiply and an add) and rounds once. A token rotated one way in its prefill chunk and the
other way when it decodes would get other bits. So under `--batch-invariant` every path calls this kernel,
which rotates with step 13's own `rotate_head`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step13_fused_decode.fused_kernels import rotate_head


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, stride_xt, stride_xh, stride_ct, HEADS: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # Step 13's rotation of one head, without its KV write: the same float32 expression, rounded once.
    rotate_head(X + t * stride_xt + h * stride_xh, OUT + (t * HEADS + h) * 2 * HALF, COS + t * stride_ct,
                SIN + t * stride_ct, tl.arange(0, HALF), HALF)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], each head's vector contiguous (tokens may be strided, as slices of a
    packed projection); cos, sin: [tokens, 1, head_dim]. Returns the rotated x, contiguous."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    _rope_kernel[(tokens, heads)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), HEADS=heads,
                                  HALF=head_dim // 2)
    return out
