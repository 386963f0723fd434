"""Step 13's fused decode over FP8 projections: the packs hold e4m3 values and row scales.

Step 13 packs each layer's q/k/v and gate/up into one weight and multiplies a decode step's rows with its skinny
kernel, the norm before and the residual add after folded into that multiply. Here a pack stacks the e4m3 values as
its weight and the row scales beside them, and launches `fp8_skinny_kernel` (step 13's kernel with the scale applied
to each output feature's sum) with the same switches: every fusion of step 13 holds, at a byte a weight. Rows past
step 13's 16 go through `fp8_linear`. The output head, kept in its dtype, stays step 13's pack.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from common.model import RMSNorm
from step13_fused_decode.engine import FusedDecodeGraphs
from step13_fused_decode.packed_projections import PackedLinear, PackedProjections, stack_in_place
from step13_fused_decode.skinny_matmul import MAX_ROWS
from step17_fp8_weights.fp8 import Fp8Linear, fp8_linear
from step17_fp8_weights.fp8_matmul import fp8_config, fp8_skinny_kernel, launch_args


class Fp8PackedLinear(PackedLinear):
    """A pack of `Fp8Linear` projections: `weight` is their e4m3 values stacked, `scale` their row scales."""

    def __init__(self, linears: tuple[nn.Module, ...], skinny: bool = False, pdl: bool = False,
                 norm_after: RMSNorm | None = None) -> None:
        if not isinstance(linears[0], Fp8Linear):  # the output head: as step 13 packs it
            super().__init__(linears, skinny, pdl, norm_after)
            return
        # Step 13 packs each layer's weight and bias; here the weight it stacks is each layer's e4m3 values.
        super().__init__(tuple(SimpleNamespace(weight=linear.values, bias=linear.bias,
                                               out_features=linear.out_features) for linear in linears),
                         skinny=False, pdl=pdl, norm_after=norm_after)
        self.scale = stack_in_place([linear.scale for linear in linears])
        self.kernel_args = {"kernel": fp8_skinny_kernel, "SCALE": self.scale}
        if skinny:  # the settings for FP8 weights (`fp8_config`), for step 13's tile in the model's dtype
            element_size = torch.empty(0, dtype=linears[0].dtype).element_size()
            self.skinny = fp8_config(MAX_ROWS, element_size, self.weight.device, *self.weight.shape)
            self.kernel_args |= launch_args(self.weight.shape[0], self.skinny, self.weight.device)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel_args:
            return super().multiply(x)
        return fp8_linear(x, self.weight, self.scale, self.bias)


class Fp8Projections(PackedProjections):
    linear_class = Fp8PackedLinear


class Fp8DecodeGraphs(FusedDecodeGraphs):
    @staticmethod
    def projections_class() -> type:
        return Fp8Projections
