"""Step 17's FP8 multiply: against the same product computed by PyTorch from the widened e4m3 values, at each row
count a decode step takes and on each tiny model's shapes. Without a GPU, in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from step17_fp8_weights.fp8 import quantize
from step17_fp8_weights.fp8_matmul import MAX_ROWS, fp8_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 8, MAX_ROWS])
@pytest.mark.parametrize("n, k, bias", [(96, 96, False), (192, 96, True), (100, 72, True)])
def test_the_kernel_computes_the_scaled_product(rows: int, n: int, k: int, bias: bool) -> None:
    """(x V^T) * scale + bias, V the widened e4m3 values: what the kernel must give, up to the order of its sums.
    The shapes include ragged ones (100 features, K of 72) that leave parts of the last tiles empty."""
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    weight = quantize(torch.randn(n, k, generator=generator))
    x = torch.randn(rows, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    values, scale = weight.values.to(DEVICE), weight.scale.to(DEVICE)
    got = fp8_matmul(x.to(DEVICE), values, scale, None if b is None else b.to(DEVICE)).cpu()
    expected = (x.double() @ weight.values.double().T) * weight.scale.double() + (0 if b is None else b.double())
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_it_equals_the_dequantized_weights_product_to_float32s_rounding() -> None:
    generator = torch.Generator().manual_seed(0)
    weight, x = quantize(torch.randn(64, 128, generator=generator)), torch.randn(8, 128, generator=generator)
    got = fp8_matmul(x.to(DEVICE), weight.values.to(DEVICE), weight.scale.to(DEVICE)).cpu()
    assert torch.allclose(got, torch.nn.functional.linear(x, weight.dequantize()), rtol=1e-5, atol=1e-5)
