"""Step 13's fused decode, made to compute each op exactly as the batch-invariant model does on every other path.

A decode step replays step 13's fused twin of the model (packed projections, fewer and larger kernels) while
prefill chunks and verification rows run the model itself, so for a token to get the same bits on both, each
fused op must do the arithmetic of its unfused counterpart:
- packed projections multiply through `invariant_matmul` (its tile depends on the weight's inputs only, so
  q/k/v packed and q, k, v one by one sum each output alike); the residual add then the next norm stay step
  13's add-and-norm kernel, which rounds the sum to the model's dtype as PyTorch's add does;
- RoPE is `rope_kernel.rope`, as in the model's twin, instead of step 13's rotate-and-write kernel; the K/V
  write is then the backend's;
- the skinny multiply and its fused norm are left out (a different kernel up to 16 rows), and so is PDL.
The norms and SiLU are step 13's kernels on both paths already (`invariant_ops.py`).
"""

from __future__ import annotations

import torch

from step13_fused_decode.engine import FusedDecodeGraphs, FusedMixedGraphs, FusedVerifyGraphs
from step13_fused_decode.fused_forward import FusedDecodeForward, FusedMixedForward
from step13_fused_decode import fused_kernels
from step13_fused_decode.packed_projections import PackedLinear, PackedProjections, PreparedNorm
from step15_batch_invariant.invariant_ops import invariant_linear, rotate


class InvariantPackedLinear(PackedLinear):
    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> PreparedNorm:
        norm = self.norm_after
        stream, normed = fused_kernels.add_rms_norm(residual, self.linear(x), norm.weight, norm.eps)
        return PreparedNorm(stream, norm, normed=normed)


class InvariantProjections(PackedProjections):
    linear_class = InvariantPackedLinear


class InvariantDecodeForward(FusedDecodeForward):
    def rotate_and_attend(self, layer_idx, q, k, v, cos, sin):  # noqa: ANN001, ANN201
        return self.attend(layer_idx, *rotate(q, k, cos, sin), v)


class InvariantMixedForward(FusedMixedForward):
    def rotate_and_attend(self, layer_idx, q, k, v, cos, sin):  # noqa: ANN001, ANN201
        return self.attend(layer_idx, *rotate(q, k, cos, sin), v)


class InvariantDecodeGraphs(FusedDecodeGraphs):
    @staticmethod
    def projections_class() -> type:
        return InvariantProjections

    def context(self, meta, positions):  # noqa: ANN001, ANN201
        return InvariantDecodeForward(self.cache, self.backend, meta, positions, self.pdl)


class InvariantMixedGraphs(FusedMixedGraphs):
    def context(self, meta, positions, tile_request, tile_index):  # noqa: ANN001, ANN201
        return InvariantMixedForward(self.cache, self.backend, meta, positions, tile_request, tile_index,
                                     self.model.pdl)


class InvariantVerifyGraphs(FusedVerifyGraphs, InvariantMixedGraphs):
    pass  # the verification rows of step 12, over the invariant mixed step's context
