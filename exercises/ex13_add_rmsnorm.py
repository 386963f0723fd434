"""Exercise 13-add-rmsnorm: the residual add and the RMSNorm after it, as one Triton kernel.

Write the body of `add_rms_norm`, and the `@triton.jit` kernel it launches above it in this file;
`python -m exercises run 13-add-rmsnorm` plugs it into step 13 in place of `fused_kernels.add_rms_norm` and runs
step 13's tests and dry run on it. Without a GPU, the kernel runs in Triton's interpreter (TRITON_INTERPRET=1,
which the runner sets there).
"""

from __future__ import annotations

import torch

try:  # Triton ships for Linux x86-64 only: without it this exercise cannot run (the others can)
    import triton  # noqa: F401 - for your code
    import triton.language as tl  # noqa: F401

    from step13_fused_decode.dependent_launch import wait_for_previous_kernel  # noqa: F401
except ImportError:
    pass


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + update, RMSNorm(x + update)), every row in one launch of a Triton kernel that you write.

    Inputs: `x` and `update`, `[tokens, hidden]`, contiguous, of one dtype (float32 on a CPU, bfloat16 on a
    GPU): the residual stream and a sublayer's output; `weight`, the norm's `[hidden]`; `eps`, its epsilon;
    `pdl`, whether to use a Hopper GPU's programmatic dependent launch (always False on a CPU).
    Returns: two new tensors shaped and typed like `x`:
    - `total`: x + update, added in float32 and rounded once to x's dtype (exactly PyTorch's `x + update`);
    - `normed`: RMSNorm(total) as `common/model.py`'s `RMSNorm` computes it: with t = total (as rounded) in
      float32, `t * rsqrt(sum(t * t) / hidden + eps)`, rounded to x's dtype, then times `weight` in float32,
      rounded to x's dtype again.
    Rule: one program per row, which reads its row of x and update once and stores total and normed. A row
    wider than a power of two is padded to one and masked: the padding must add nothing to the sum of squares.
    With `pdl`, the kernel waits for the previous kernel (`wait_for_previous_kernel`) before its first load,
    and is launched with PDL on.

    Example: hidden 3, eps 0, weight [1, 1, 2], x [[1, 2, 3]], update [[1, 0, -1]] -> total [[2, 2, 2]];
    mean square 4, rms 2 -> normed [[1, 1, 2]].

    Hints (step13_fused_decode/README.md, "The idea: take step 12's bar apart", its worked example "one kernel
    instead of nine"; "The pitfalls", "Rounding moves"): `rms_norm`'s kernel in
    `step13_fused_decode/fused_kernels.py` is a row kernel and its launch, without the add; round where PyTorch
    rounds.
    """
    raise NotImplementedError("write fused_kernels.add_rms_norm: see the hints in its docstring")
