"""Projections that read the same input, packed into one weight so that one matrix multiply serves them all.

In every layer q, k and v are projections of the same normalised hidden state, and so are the MLP's gate
and up. Five launches become two: in a replayed decode step each launch has a fixed cost, and k and v are
small matrices (Qwen2.5-7B: 3.7 MB each, against 26 MB for q) that one launch each cannot stream at full
bandwidth. The packed weight is the separate weights stacked by rows; the model's own layers are then made
views of it, so the memory is not held twice and every other path (prefill, the eager steps) reads the
very same numbers.

The single projections (o, down, the output head) are held here too, as packs of one, so that at small
batch sizes every projection can go through the skinny matrix multiply (`skinny_matmul.py`) instead of
cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model import CausalLM
from step12_cuda_graph.skinny_matmul import MAX_ROWS, SkinnyConfig, device_limits, skinny_config, skinny_linear


class PackedLinear:
    """Linear layers with one input, as one stacked weight (and bias); `__call__` returns each one's output."""

    def __init__(self, linears: tuple[nn.Linear, ...], skinny: bool = False, pdl: bool = False) -> None:
        self.sizes = [linear.out_features for linear in linears]
        self.weight = stack_in_place([linear.weight for linear in linears])
        has_bias = [linear.bias is not None for linear in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("a packed projection needs a bias on every part or on none")
        self.bias = stack_in_place([linear.bias for linear in linears]) if all(has_bias) else None
        self.skinny: SkinnyConfig | None = None
        if skinny:
            self.skinny = skinny_config(self.weight.shape[0], self.weight.element_size(),
                                        **device_limits(self.weight.device))
        self.pdl = pdl  # the skinny kernel launched with programmatic dependent launch

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            out = skinny_linear(x, self.weight, self.bias, self.skinny, pdl=self.pdl)
        else:
            out = F.linear(x, self.weight, self.bias)
        # The parts come back as column slices of one output: each token's row of a part is contiguous,
        # consecutive tokens are a packed row apart. The kernels that read them take that stride.
        return out.split(self.sizes, dim=-1)


def stack_in_place(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along dim 0, with each part's parameter re-pointed at its rows of the result.

    If the parts already are adjacent rows of one tensor (packed before, by another engine on the same
    model), that tensor is returned as it is: nothing is copied and nothing is held twice."""
    first = parts[0]
    rows = sum(part.shape[0] for part in parts)
    storage = first.untyped_storage().data_ptr()
    one_tensor = all(part.is_contiguous() and part.untyped_storage().data_ptr() == storage for part in parts)
    adjacent = all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(parts, parts[1:]))
    if one_tensor and adjacent:
        return first.as_strided((rows, *first.shape[1:]), first.stride())
    stacked = torch.cat([part.detach() for part in parts])
    for part, rows_of_part in zip(parts, stacked.split([p.shape[0] for p in parts])):
        part.data = rows_of_part  # the old storage is freed once nothing else refers to it
    return stacked


class PackedProjections:
    """Every layer's q/k/v and gate/up packed, and o, down and the output head as packs of one; looked up by
    the tuple of layers the model asks for. With `skinny`, batches of at most `MAX_ROWS` rows use
    `skinny_linear`, launched with programmatic dependent launch if `pdl`."""

    def __init__(self, model: CausalLM, skinny: bool = False, pdl: bool = False) -> None:
        self.packed: dict[tuple[nn.Linear, ...], PackedLinear] = {}
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for linears in ((attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
                            (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)):
                self.packed[linears] = PackedLinear(linears, skinny, pdl)
        self.packed[(model.lm_head,)] = PackedLinear((model.lm_head,), skinny, pdl)

    def __call__(self, x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
        packed = self.packed.get(linears)
        return packed(x) if packed is not None else tuple(linear(x) for linear in linears)
