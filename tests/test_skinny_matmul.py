"""step12's skinny matrix multiply against F.linear, and the packed projections that use it.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py), in float32
(the interpreter's bfloat16 `tl.dot` returns wrong numbers); on a GPU bfloat16 is checked too. Shapes are uneven:
neither the output nor the input features are multiples of the tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed (it ships for Linux x86-64 only)")
from common.loading import load_model  # noqa: E402
from common.model import RMSNorm  # noqa: E402
from step12_cuda_graph.packed_projections import PackedProjections  # noqa: E402
from step12_cuda_graph.skinny_matmul import MAX_ROWS, SkinnyConfig, skinny_config, skinny_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    n, k = 100, 200  # 100 = 3 tiles of 32 and a bit; 200 = 3 steps of 64 and a bit
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    weight = torch.randn(n, k, device=DEVICE, dtype=dtype) * k**-0.5
    bias = torch.randn(n, device=DEVICE, dtype=dtype) if with_bias else None
    got = skinny_linear(x, weight, bias, SkinnyConfig(block_n=32, block_k=64))
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_skinny_linear_reads_strided_rows() -> None:
    """Rows a packed row apart (a slice of a wider activation) are read in place."""
    wide = torch.randn(4, 300, device=DEVICE)
    x = wide[:, :200]
    weight = torch.randn(50, 200, device=DEVICE)
    torch.testing.assert_close(skinny_linear(x, weight, config=SkinnyConfig(block_n=16, block_k=64)),
                               F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_skinny_linear_refuses_too_many_rows() -> None:
    with pytest.raises(ValueError, match="use F.linear"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_skinny_linear_folds_norm_activation_and_residual(dtype: torch.dtype, rows: int) -> None:
    """What comes before and after a projection, in its launch: the same as RMSNorm, F.linear, silu and the
    residual add one after another (uneven K: the sum of squares must skip the padding)."""
    n, k = 100, 200
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype) * 3
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.2)
    gate_up = torch.randn(2 * n, k, device=DEVICE, dtype=dtype) * k**-0.5
    bias = torch.randn(2 * n, device=DEVICE, dtype=dtype)
    residual = torch.randn(rows, 2 * n, device=DEVICE, dtype=dtype)
    config = SkinnyConfig(block_n=32, block_k=64)
    normed = norm(x).float()
    checks = {
        "norm": (skinny_linear(x, gate_up, bias, config, norm=norm),
                 F.linear(normed, gate_up.float(), bias.float())),
        "norm, gated": (skinny_linear(x, gate_up, None, SkinnyConfig(block_n=16, block_k=64), norm=norm, gated=True),
                        F.silu(F.linear(normed, gate_up[:n].float())) * F.linear(normed, gate_up[n:].float())),
        "residual": (skinny_linear(x, gate_up, bias, config, residual=residual),
                     residual.float() + F.linear(x.float(), gate_up.float(), bias.float())),
    }
    for name, (got, expected) in checks.items():
        assert got.dtype == dtype and got.shape == expected.shape, name
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * 3, rtol=TOLERANCE[dtype],
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_skinny_linear_refuses_a_gate_with_a_bias() -> None:
    with pytest.raises(ValueError, match="without bias"):
        skinny_linear(torch.randn(2, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE),
                      torch.randn(6, device=DEVICE), gated=True)


@pytest.mark.parametrize("model_name", ["tiny-qwen2", "tiny-llama"])  # with and without q/k/v biases
def test_skinny_projections_match_the_layers(model_name: str) -> None:
    """A layer's projections, each with the norm before it or the residual add after it as the model asks,
    at a decode batch (the skinny kernel) and past MAX_ROWS (the norm kernel, then cuBLAS)."""
    model = load_model(model_name, device=DEVICE).model
    layer = model.model.layers[1]
    attention, mlp = layer.self_attn, layer.mlp
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
        norm.weight.data.normal_(1.0, 0.2)  # not the ones they start as: a weight left out would show
    packed = PackedProjections(model, skinny=True)
    qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
    for rows in (2, MAX_ROWS + 3):
        x = torch.randn(rows, model.config.hidden_size, device=DEVICE) * 3
        attended = torch.randn(rows, attention.o_proj.in_features, device=DEVICE)
        normed, normed_mlp = layer.input_layernorm(x), layer.post_attention_layernorm(x)
        activation = F.silu(mlp.gate_proj(normed_mlp)) * mlp.up_proj(normed_mlp)
        checks = [
            (packed[qkv](x, layer.input_layernorm), [linear(normed) for linear in qkv]),
            (packed[attention.o_proj,](attended, residual=x), [x + attention.o_proj(attended)]),
            ([packed[gate_up].gated(x, layer.post_attention_layernorm)], [activation]),
            (packed[mlp.down_proj,](activation, residual=x), [x + mlp.down_proj(activation)]),
            (packed[model.lm_head,](x, model.model.norm), [model.lm_head(model.model.norm(x))]),
        ]
        for got, expected in checks:
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("shared_memory", [100 * 1024, 227 * 1024])
@pytest.mark.parametrize("n", [896, 3584, 4608, 37888])
@pytest.mark.parametrize("gated", [False, True])
def test_skinny_config_fits_shared_memory(element_size: int, shared_memory: int, n: int, gated: bool) -> None:
    """The pipeline's tiles fit the device, whatever the dtype: a launch never runs out of shared memory."""
    config = skinny_config(n, element_size, multiprocessors=132, shared_memory=shared_memory, gated=gated)
    weight_rows = config.block_n * (2 if gated else 1)
    stage_bytes = (MAX_ROWS + weight_rows) * config.block_k * element_size
    assert config.num_stages >= 2 and config.num_stages * stage_bytes <= shared_memory
