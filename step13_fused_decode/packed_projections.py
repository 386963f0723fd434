"""Projections that read the same input, packed into one weight so that one matrix multiply serves them all.

In every layer q, k and v are projections of the same normalised hidden state, and so are the MLP's gate
and up. Five launches become two: in a replayed decode step each launch has a fixed cost, and k and v are
small matrices (Qwen2.5-7B: 3.7 MB each, against 26 MB for q) that one launch each cannot stream at full
bandwidth. The packed weight is the separate weights stacked by rows; the model's own layers are then made
views of it, so the memory is not held twice and every other path (prefill, the eager steps) reads the
very same numbers.

The single projections (o, down, the output head) are held here too, as packs of one, so that at small
batch sizes every projection can go through the skinny matrix multiply (`skinny_matmul.py`) instead of
cuBLAS. For a greedy step the head's pack returns the tokens themselves (`PackedLinear.argmax`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.model import CausalLM, RMSNorm
from step13_fused_decode import fused_kernels
from step13_fused_decode.skinny_matmul import (MAX_ROWS, ArgmaxState, SkinnyConfig, device_limits, skinny_config,
                                             skinny_linear, skinny_linear_add, skinny_linear_argmax)


@dataclass
class PreparedNorm:
    """A residual stream, made ready for the RMSNorm that reads it next by the kernel that wrote it.

    Past `MAX_ROWS` rows that kernel is the add-and-norm kernel, and `normed` is norm(stream). Up to
    `MAX_ROWS` it is the skinny matrix multiply that added its projection to the stream (or, before the first
    layer, the embedding lookup): `scaled` is the stream times the norm's weight and `squares` each row's sum
    of squares in parts, so the next projection normalises as it multiplies, and no norm kernel runs at all."""

    stream: torch.Tensor
    norm: RMSNorm | None  # None: made ready for no norm (embeddings looked up as they are)
    normed: torch.Tensor | None = None
    scaled: torch.Tensor | None = None
    squares: torch.Tensor | None = None


class PackedLinear:
    """Linear layers with one input, as one stacked weight (and bias); `__call__` returns each one's output.

    `norm_after` is the RMSNorm that reads this projection's output next, where the model adds it to the
    residual stream (o: the MLP's norm; down: the next layer's, or the final norm)."""

    def __init__(self, linears: tuple[nn.Linear, ...], skinny: bool = False, pdl: bool = False,
                 norm_after: RMSNorm | None = None) -> None:
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
        self.pdl = pdl  # the Triton kernels launched with programmatic dependent launch
        self.norm_after = norm_after
        self.argmax_state: ArgmaxState | None = None  # made by the first `argmax`; kept: graphs hold its address
        # The skinny kernel to launch and what it reads besides (`skinny_linear`'s kernel_args): none, its own.
        self.kernel_args: dict[str, Any] = {}

    def runs_skinny(self, x: torch.Tensor) -> bool:
        return self.skinny is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS

    def __call__(self, x: torch.Tensor, prepared: PreparedNorm | None = None) -> tuple[torch.Tensor, ...]:
        """Each part's projection of x; with `prepared` (x made ready for a norm), of that norm of x."""
        x, squares, eps = self.input_of(x, prepared)
        if squares is None:
            out = self.linear(x)
        else:
            out = skinny_linear(x, self.weight, self.bias, self.skinny, self.pdl, squares, eps, **self.kernel_args)
        # The parts come back as column slices of one output: each token's row of a part is contiguous,
        # consecutive tokens are a packed row apart. The kernels that read them take that stride.
        return out.split(self.sizes, dim=-1)

    def argmax(self, x: torch.Tensor, prepared: PreparedNorm | None = None) -> torch.Tensor:
        """Each row's argmax of this projection (a pack of one: the output head) of x, or with `prepared` of
        that norm of x, found by the skinny kernel without writing the outputs; for inputs that run skinny."""
        if len(self.sizes) != 1 or not self.runs_skinny(x):
            raise ValueError("argmax takes a pack of one, packed with skinny=True, and inputs that run skinny")
        if self.argmax_state is None:  # at the first call, which `DecodeGraphs` runs eagerly before it captures
            self.argmax_state = ArgmaxState(x.device)
        x, squares, eps = self.input_of(x, prepared)
        return skinny_linear_argmax(x, self.weight, self.bias, self.skinny, self.pdl, squares, eps, self.argmax_state,
                                    **self.kernel_args)

    @staticmethod
    def input_of(x: torch.Tensor, prepared: PreparedNorm | None) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """What the multiply reads for the projection of x, or of norm(x) with `prepared`: (input, squares,
        eps). With squares, the input is the stream scaled by the norm's weight, and the multiply divides by
        the root mean square (the skinny kernel); without, it is x or norm(x) as it stands."""
        if prepared is None:
            return x, None, 0.0
        if prepared.normed is not None:  # made ready by the add-and-norm kernel
            return prepared.normed, None, 0.0
        return prepared.scaled, prepared.squares, prepared.norm.eps

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_skinny(x):
            return skinny_linear(x, self.weight, self.bias, self.skinny, self.pdl, **self.kernel_args)
        return self.multiply(x)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """The projection of rows the skinny kernel does not take (cuBLAS)."""
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> PreparedNorm:
        """residual + this projection of x (a pack of one, without bias), made ready for `norm_after`."""
        norm = self.norm_after
        if norm is None or self.bias is not None:
            raise ValueError("only o and down are added to the residual stream: pack them with PackedProjections")
        if self.runs_skinny(x) and residual.is_contiguous():
            stream, scaled, squares = skinny_linear_add(x, self.weight, residual, norm.weight, self.skinny, self.pdl,
                                                        **self.kernel_args)
            return PreparedNorm(stream, norm, scaled=scaled, squares=squares)
        stream, normed = fused_kernels.add_rms_norm(residual, self.multiply(x), norm.weight, norm.eps, pdl=self.pdl)
        return PreparedNorm(stream, norm, normed=normed)


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
    `skinny_linear`; `pdl` launches the Triton kernels with programmatic dependent launch."""

    linear_class: type[PackedLinear] = PackedLinear  # what each pack is (a later step multiplies its own way)

    def __init__(self, model: CausalLM, skinny: bool = False, pdl: bool = False) -> None:
        self.packed: dict[tuple[nn.Linear, ...], PackedLinear] = {}
        self.skinny = skinny
        layers = model.model.layers
        for i, layer in enumerate(layers):
            attention, mlp = layer.self_attn, layer.mlp
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            for linears, norm_after in (((attention.q_proj, attention.k_proj, attention.v_proj), None),
                                        ((attention.o_proj,), layer.post_attention_layernorm),
                                        ((mlp.gate_proj, mlp.up_proj), None), ((mlp.down_proj,), next_norm)):
                self.packed[linears] = self.linear_class(linears, skinny, pdl, norm_after)
        self.packed[(model.lm_head,)] = self.linear_class((model.lm_head,), skinny, pdl)

    def normalises_in_matmul(self, rows: int) -> bool:
        """Whether a projection of `rows` rows takes its input as a `PreparedNorm`'s scaled rows and sums of
        squares (the skinny matrix multiply), so that no norm kernel is needed before it."""
        return self.skinny and rows <= MAX_ROWS

    def __getitem__(self, linears: tuple[nn.Linear, ...]) -> PackedLinear:
        packed = self.packed.get(linears)
        if packed is None:
            raise KeyError("these layers are not a group of the model that was packed: pack them with "
                           "PackedProjections(model) for the model they belong to")
        return packed
