"""The model's matrix multiplies and norms, computed so that a row's result never depends on its batch.

Everything else the model does to a row is already batch-invariant on both devices (`probe.py` measured
each op): element-wise work (RoPE, SiLU, the residual adds), the embedding lookup, and, on a CPU, PyTorch's
row reductions. Two kinds of op are not, and are replaced in a twin of the loaded model that
shares its weights (`batch_invariant_twin`), so that every path of the engine (prefill, decode, verification, graphs or eager)
runs the same numbers:

- the linear layers. On a CPU, PyTorch hands a multiply to a library that picks its method by the shape: one
  row goes through a matrix-vector kernel, two or more through a blocked one, so `mm(a[:1], b)` and
  `mm(a, b)[:1]` differ in the last bits. `row_tiled_linear` therefore always calls it on the same shape:
  `ROW_TILE` rows, the last tile padded with zeros. On a GPU, our own kernel (`matmul_kernel.py`).
- RMSNorm on a GPU, where PyTorch's reduction spreads a row over more threads when there are fewer rows:
  there, step 13's Triton kernel, one row per program.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from common.model import CausalLM, RMSNorm

ROW_TILE = 16  # rows per library call on a CPU: every call multiplies exactly this many


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by calls of exactly ROW_TILE rows each: whatever the batch, the library sees one
    shape, so it takes one path, and a row's result is the same in every tile and at every place in it."""
    rows = x.shape[0]
    padded = -(-rows // ROW_TILE) * ROW_TILE
    tiles = F.pad(x, (0, 0, 0, padded - rows)).view(-1, ROW_TILE, x.shape[1])
    out = torch.cat([torch.mm(tile, weight.t()) for tile in tiles])[:rows]
    return out if bias is None else out + bias  # an element-wise add: the same in any batch


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The batch-invariant linear layer of x's device, over x's last dimension."""
    flat = x.reshape(-1, x.shape[-1])
    if x.device.type == "cuda":
        from step15_batch_invariant.matmul_kernel import invariant_matmul  # Triton is optional on a CPU

        out = invariant_matmul(flat.contiguous(), weight, bias)
    else:
        out = row_tiled_linear(flat, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class InvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


class InvariantRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return super().forward(x)  # PyTorch's CPU row reductions are batch-invariant (probe.py)
        from step13_fused_decode.fused_kernels import rms_norm  # one row per program, as the reference rounds

        return rms_norm(x.contiguous(), self.weight, self.eps)


def batch_invariant_twin(model: CausalLM) -> CausalLM:
    """A copy of `model` whose linear layers and RMSNorms are their batch-invariant classes, over the very
    same weight tensors (nothing on the device is copied; `model` itself is left as it was, for the engines
    that share it). Every path that runs the twin, captured or eager, runs the new forwards."""
    assert model.rope is not None, "call prepare(device) first"
    shared = [*model.parameters(), *model.buffers(), model.rope.cos, model.rope.sin]
    twin = copy.deepcopy(model, memo={id(tensor): tensor for tensor in shared})
    for module in twin.modules():
        if type(module) is nn.Linear:
            module.__class__ = InvariantLinear
        elif type(module) is RMSNorm:
            module.__class__ = InvariantRMSNorm
    return twin
