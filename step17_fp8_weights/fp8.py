"""FP8 weights: each projection's weight as 8-bit floats (e4m3) times one float32 scale per output row.

e4m3 is a sign bit, 4 exponent bits and 3 mantissa bits: 8 values per power of two, the largest finite one 448.
A row is divided by its scale, chosen so that its largest magnitude lands on 448, then rounded to the nearest e4m3
value; reading a weight back is that value times the row's scale (`Fp8Weight.dequantize`). With 3 mantissa bits,
a weight in e4m3's normal range comes back within 1/16 of itself.

Why a scale per output row, not one per tensor: e4m3 spans about 2^17 from its smallest subnormal to 448, so one
tensor-wide scale, set by the largest row, leaves a row tens of thousands of times smaller among the few subnormal
values or at zero; a row's own scale gives every row the whole of e4m3's precision. How far apart the rows of real
weights are is measured on the embedded model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.model import CausalLM
from step04_multi_gpu.sharding import RowParallelLinear

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class Fp8Weight:
    values: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] float32 (per row), or [1] (per tensor)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the multiply sees it: each e4m3 value times its row's scale, in float32, then `dtype`."""
        return (self.values.to(torch.float32) * self.scale[:, None]).to(dtype)


def quantize(weight: torch.Tensor, per_row: bool = True) -> Fp8Weight:
    """`weight` [out, in] to e4m3 with a scale per row (or one for the whole tensor), each value rounded to the
    nearest e4m3 value."""
    weight = weight.float()
    largest = weight.abs().amax(dim=1) if per_row else weight.abs().amax().reshape(1)
    scale = (largest / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero row keeps scale > 0
    return Fp8Weight((weight / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale)


class Fp8Linear(nn.Module):
    """A projection whose weight is kept as e4m3 values and row scales: half the bytes of bf16. On a GPU a decode
    step's few rows go through our kernel (`fp8_matmul`), and more rows in bf16 through cuBLAS's FP8 multiply with
    each row of x quantized too (`scaled_mm_rowwise`). Otherwise the values are widened to the input's dtype,
    multiplied, and each output feature scaled after: our kernel's arithmetic, up to the order of its sums."""

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # The values are a parameter that never trains: step 09 counts a layer's multiply-adds from its parameters
        # (a GPU step's token budget), and FP8 changes a weight's bytes, not its multiply-adds.
        self.values = nn.Parameter(weight.values, requires_grad=False)
        self.register_buffer("scale", weight.scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.values.shape
        self.dtype = dtype  # the model's: what the layer's output, and a reader of its state, get

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """A reader of the model's state (HF's model, built as the reference from it) gets a linear layer: the
        dequantized weight in the model's dtype, and the bias."""
        destination[prefix + "weight"] = self.weight.dequantize(self.dtype)
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.values, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.values, self.scale, self.bias)


class Fp8RowParallelLinear(Fp8Linear):
    """Step 04's projection split by its input features, in FP8: this rank's slice of x times its slice of the
    weight is a partial sum of the output, and the all-reduce adds every rank's. Each rank quantizes the whole
    weight, as one process would, and keeps its own columns: each row's scale is set by all of the row's weights,
    so the ranks' values are slices of one process's, and the scaled partial sums add up to its output."""

    def __init__(self, linear: RowParallelLinear, per_row: bool = True) -> None:
        world, rank = dist.get_world_size(linear.group), dist.get_rank(linear.group)
        own = linear.weight.detach()
        columns = own.shape[1]
        # The whole weight on every rank: each rank's slice in its place, zeros elsewhere, summed (exact).
        whole = own.new_zeros(own.shape[0], columns * world)
        whole[:, rank * columns : (rank + 1) * columns] = own
        dist.all_reduce(whole, group=linear.group)
        quantized = quantize(whole, per_row)
        values = quantized.values[:, rank * columns : (rank + 1) * columns].contiguous()
        super().__init__(Fp8Weight(values, quantized.scale), None, own.dtype)
        self.group = linear.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out, group=self.group)
        return out


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times the FP8 weight. On a GPU, by rows: our kernel up to its `MAX_ROWS`, and past that cuBLAS's
    FP8 multiply with each row of x quantized as a weight's row is (where it takes the operands). Otherwise
    `widened_linear`."""
    if x.is_cuda:
        from step17_fp8_weights import fp8_matmul  # Triton: loaded where there is a GPU

        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= fp8_matmul.MAX_ROWS:
            return fp8_matmul.fp8_matmul(rows, values, scale, bias).reshape(*x.shape[:-1], -1)
        if fp8_matmul.scaled_mm_fits(rows, values):
            x_values, x_scale = fp8_matmul.quantize_rows(rows)
            out = fp8_matmul.scaled_mm_rowwise(x_values, x_scale, values, scale, bias, x.dtype)
            return out.reshape(*x.shape[:-1], -1)
    return widened_linear(x, values, scale, bias)


def widened_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """x times the FP8 weight: its values widened to x's dtype (exactly), multiplied, and each output feature
    scaled after; our kernel's arithmetic, up to the order of its sums."""
    scaled = F.linear(x, values.to(x.dtype)) * scale.to(x.dtype)
    return scaled if bias is None else scaled + bias


def quantize_projections(model: CausalLM, per_row: bool = True) -> int:
    """Replace each decoder layer's seven projections by an `Fp8Linear`, in place; the embedding, the norms and the
    output head keep their dtype. Returns how many bytes of weights the model holds fewer."""
    saved = 0
    for layer in model.model.layers:
        for path in PROJECTIONS:
            parent_name, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, name)
            if isinstance(linear, RowParallelLinear):  # step 04's ranks: o and down split by input features
                fp8: Fp8Linear = Fp8RowParallelLinear(linear, per_row)
            else:
                bias = None if linear.bias is None else linear.bias.detach()
                fp8 = Fp8Linear(quantize(linear.weight.detach(), per_row), bias, linear.weight.dtype)
            saved += linear.weight.nbytes - fp8.values.nbytes - fp8.scale.nbytes
            setattr(parent, name, fp8)
    return saved


def fp8_twin(model: CausalLM, per_row: bool = True) -> CausalLM:
    """A copy of `model` whose projections are FP8 (`quantize_projections`), over the very same embedding, norms and
    head (nothing else is copied; `model` itself is left as it was, for the engines that share it). Once nothing
    holds `model`, its higher-precision projections are freed: the weights then take about half the memory."""
    assert model.rope is not None, "call prepare(device) first"
    shared = [*model.parameters(), *model.buffers(), model.rope.cos, model.rope.sin,
              *(module.group for module in model.modules() if getattr(module, "group", None) is not None)]
    twin = copy.deepcopy(model, memo={id(item): item for item in shared})
    quantize_projections(twin, per_row)
    return twin


def weight_bytes(model: CausalLM) -> int:
    """The bytes of the model's weights: its parameters and buffers (the FP8 values and scales among them)."""
    return sum(t.nbytes for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def projection_bytes(model: CausalLM, as_loaded: bool = False) -> int:
    """The bytes of the decoder layers' projections, which FP8 quantizes: their weights, or their FP8 values and
    scales (biases aside). `as_loaded`: the bytes they held before quantizing, in the dtype they were loaded in."""
    total = 0
    for layer in model.model.layers:
        for path in PROJECTIONS:
            linear = layer.get_submodule(path)
            if not isinstance(linear, Fp8Linear):
                total += linear.weight.nbytes
            elif as_loaded:
                total += linear.values.numel() * linear.dtype.itemsize
            else:
                total += linear.values.nbytes + linear.scale.nbytes
    return total


def holds_fp8(model: CausalLM) -> bool:
    """Whether the model's projections are FP8 already (quantized in place, or a twin)."""
    return isinstance(model.model.layers[0].get_submodule(PROJECTIONS[0]), Fp8Linear)
