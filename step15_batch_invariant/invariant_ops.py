"""The model's ops, computed so that a row's result depends on that row alone, on every path of the engine.

`probe.py` measures which ops give a row other bits when other rows share its call. On a CPU it is the
linear layers: PyTorch hands a multiply to a library that picks its method by the shape (one row goes through a
matrix-vector kernel, more through blocked ones), so `mm(a[:1], b)` and `mm(a, b)[:1]` differ in their last
bits. `row_tiled_linear` always calls it on one shape, `ROW_TILE` rows, the last tile padded with zeros. On
a GPU the linear layers run our own kernel (`matmul_kernel.py`), whose tiling never follows the batch.

`batch_invariant_twin` puts these in a twin of the loaded model that shares its weights, so that prefill,
decode and verification, captured or eager, run the same numbers. On a GPU the twin also computes RMSNorm,
RoPE and SiLU with the kernels that step 13's fused decode runs (`fused_path.py`), so that a token's
arithmetic is the same in a prefill chunk and in a fused decode step; PyTorch's own versions are invariant
but round differently from a fused kernel.

Split over ranks (step 04), a row-parallel layer adds the ranks' partial sums. An all-reduce picks how to add
them by the message's size (a ring cuts the message into one chunk per rank, so where a row's numbers fall, and
the order they are added in, follows the batch); the twin gathers the partial sums and adds them in rank order.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.model import MLP, Attention, CausalLM, RMSNorm, apply_rope
from step04_multi_gpu.sharding import RowParallelLinear, VocabParallelHead

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


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k: on a GPU by one kernel for every path (`rope_kernel.py` says why), on a CPU as the
    model does it."""
    if q.device.type != "cuda":
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    from step15_batch_invariant.rope_kernel import rope

    return rope(q, cos, sin), rope(k, cos, sin)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: on a GPU by step 13's kernel, which its fused decode runs too; on a CPU in PyTorch."""
    if gate.device.type != "cuda":
        return F.silu(gate) * up
    from step13_fused_decode.fused_kernels import silu_mul

    return silu_mul(gate, up)


class InvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


class InvariantRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return super().forward(x)  # PyTorch's row reductions are batch-invariant here (probe.py)
        from step13_fused_decode.fused_kernels import rms_norm  # one row per program, as fused decode runs it

        return rms_norm(x.contiguous(), self.weight, self.eps)


class InvariantAttention(Attention):
    def rotate(self, q, k, cos, sin):  # noqa: ANN001, ANN201
        return rotate(q, k, cos, sin)


class InvariantMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def sum_in_rank_order(partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's partial sum, gathered (copies, no arithmetic) and added rank 0 first: the same additions for
    a row whatever else the message holds."""
    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, partial.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class InvariantRowParallelLinear(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum_in_rank_order(invariant_linear(x, self.weight), self.group)


class InvariantVocabParallelHead(VocabParallelHead):
    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight)


TWINS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: InvariantLinear, RMSNorm: InvariantRMSNorm, Attention: InvariantAttention, MLP: InvariantMLP,
    RowParallelLinear: InvariantRowParallelLinear, VocabParallelHead: InvariantVocabParallelHead}


def batch_invariant_twin(model: CausalLM) -> CausalLM:
    """A copy of `model` whose linear layers and RMSNorms are their batch-invariant classes, over the very
    same weight tensors (nothing on the device is copied; `model` itself is left as it was, for the engines
    that share it). Every path that runs the twin, captured or eager, runs the new forwards."""
    assert model.rope is not None, "call prepare(device) first"
    shared = [*model.parameters(), *model.buffers(), model.rope.cos, model.rope.sin,
              *(module.group for module in model.modules() if getattr(module, "group", None) is not None)]
    twin = copy.deepcopy(model, memo={id(item): item for item in shared})
    for module in twin.modules():
        module.__class__ = TWINS.get(type(module), type(module))
    return twin
