"""Step 17's FP8 multiply: against the same product computed by PyTorch from the widened e4m3 values, at each row
count a decode step takes and on each tiny model's shapes. Without a GPU, in Triton's interpreter (conftest.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from step13_fused_decode.skinny_matmul import skinny_linear, skinny_linear_add
from step17_fp8_weights.fp8 import Fp8Weight, quantize
from step17_fp8_weights.fp8_matmul import (MAX_ROWS, Fp8Config, fp8_config, fp8_matmul, fp8_skinny_kernel,
                                           launch_args, quantize_rows)

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


UNCUT = Fp8Config(block_n=32, block_k=16, num_warps=4, num_stages=1, split_k=1)


@pytest.mark.parametrize("n, k, block_k, split_k", [
    (4608, 3584, 256, 4),    # q/k/v: 144 bands x 4 parts = 576, at least the 528 programs an H100 holds at once
    (3584, 3584, 256, 4),    # o: 112 bands would want 8 parts, but 3,584 of K in parts of 4 iterations allows 4
    (3584, 18944, 256, 8),   # down: 112 bands x 8 parts = 896
    (37888, 3584, 512, 1),   # gate/up: 1,184 bands fill the device uncut, at 512 of K an iteration
    (64, 72, 256, 1),        # a tiny model's K: too short to cut
])
def test_fp8_config_cuts_k_until_the_programs_fill_the_device(n: int, k: int, block_k: int, split_k: int) -> None:
    """Qwen2.5-7B's four projections at a decode tile of 16 bf16 rows, planned for an H100 (the interpreter's
    defaults: 132 multiprocessors, 227 KiB of shared memory each): the settings step 17's lesson works out."""
    config = fp8_config(MAX_ROWS, 2, torch.device("cpu"), n, k)
    assert (config.block_n, config.block_k, config.num_stages, config.split_k) == (32, block_k, 3, split_k)


@pytest.mark.parametrize("split_k", [2, 3, 4])
def test_k_cut_into_parts_gives_the_uncut_product(split_k: int) -> None:
    """A grid whose second axis cuts K into parts (K of 72 in tiles of 16: parts of 48 + 24, or 32 + 32 + 8, and with
    four parts one empty) gives the uncut product; for a second x too, as the last part of each band resets its
    count for the next launch."""
    generator = torch.Generator().manual_seed(split_k)
    weight, b = quantize(torch.randn(100, 72, generator=generator)), torch.randn(100, generator=generator)
    for x in torch.randn(2, 3, 72, generator=generator):
        args = (x.to(DEVICE), weight.values.to(DEVICE), weight.scale.to(DEVICE), b.to(DEVICE))
        torch.testing.assert_close(fp8_matmul(*args, config=replace(UNCUT, split_k=split_k)),
                                   fp8_matmul(*args, config=UNCUT), rtol=1e-5, atol=1e-5)


def test_k_cut_into_parts_adds_to_the_stream_and_normalises_as_uncut() -> None:
    """Step 13's fused ending after the parts are added up: o's output added to the residual stream with the next
    norm's sums of squares, then gate/up's input normalised by them, as with K uncut."""
    generator = torch.Generator().manual_seed(0)
    o, gate_up = quantize(torch.randn(64, 96, generator=generator)), quantize(torch.randn(80, 64, generator=generator))
    x, residual, norm_weight = torch.randn(2, 96), torch.randn(2, 64), torch.rand(64) + 0.5
    results = []
    for config in (UNCUT, replace(UNCUT, split_k=3)):
        def fp8(weight: Fp8Weight, n: int) -> dict:
            return {"kernel": fp8_skinny_kernel, "SCALE": weight.scale.to(DEVICE),
                    **launch_args(n, config, torch.device(DEVICE))}  # noqa: B023 (used within the iteration)

        stream, scaled, squares = skinny_linear_add(x.to(DEVICE), o.values.to(DEVICE), residual.to(DEVICE),
                                                    norm_weight.to(DEVICE), config, **fp8(o, 64))
        out = skinny_linear(scaled, gate_up.values.to(DEVICE), None, config, squares=squares, eps=1e-6,
                            **fp8(gate_up, 80))
        results.append((stream, out))
    for uncut, cut in zip(*results, strict=True):
        torch.testing.assert_close(cut, uncut, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][0].cpu(), residual + x @ o.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter rounds float32 to e4m3 without "
                    "carrying into the exponent (7.95 becomes 4.0): the kernel's cast is checked on a GPU")
@pytest.mark.parametrize("k", [72, 5000])  # 5,000: two blocks of the kernel's 4,096, the second ragged
def test_rows_quantized_in_one_launch_as_a_weights_rows_are(k: int) -> None:
    """What cuBLAS's row-wise FP8 multiply is given for x past our kernel's rows: each row's e4m3 values and scale, as
    `quantize` makes a weight's; an all-zero row keeps a scale above zero."""
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)) * torch.tensor([[1.0], [1e-3], [0.0]])
    values, scale = quantize_rows(x.to(DEVICE))
    expected = quantize(x)
    torch.testing.assert_close(scale.cpu(), expected.scale, rtol=0, atol=0)
    assert torch.equal(values.cpu().float(), expected.values.float())
