"""step13's skinny matrix multiply against F.linear, and the packed projections that use it.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py), in float32
(the interpreter's bfloat16 `tl.dot` returns wrong numbers); on a GPU bfloat16 is checked too. Shapes are uneven:
neither the output nor the input features are multiples of the tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed (it ships for Linux x86-64 only)")
from common.model import RMSNorm  # noqa: E402
from step13_fused_decode.packed_projections import PackedProjections  # noqa: E402
from step13_fused_decode.skinny_matmul import (  # noqa: E402
    MAX_ROWS, ArgmaxState, SkinnyConfig, skinny_config, skinny_linear, skinny_linear_add, skinny_linear_argmax)
from tests.helpers import tiny_with_small_vocab  # noqa: E402

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
def test_skinny_linear_add_makes_the_next_norm_ready(dtype: torch.dtype, rows: int) -> None:
    """residual + x W^T, with the next norm's input made ready in the same launch; then the next projection of
    norm(stream) from that, with no norm kernel: the same as the add, RMSNorm and F.linear one after another.
    Uneven sizes: the last band's columns past n must add nothing to the sums of squares."""
    n, k = 100, 200
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    weight = torch.randn(n, k, device=DEVICE, dtype=dtype) * k**-0.5
    residual = torch.randn(rows, n, device=DEVICE, dtype=dtype) * 3
    norm = RMSNorm(n, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.2)
    config = SkinnyConfig(block_n=32, block_k=64)
    stream, scaled, squares = skinny_linear_add(x, weight, residual, norm.weight, config)
    expected_stream = residual.float() + F.linear(x.float(), weight.float())
    torch.testing.assert_close(stream.float(), expected_stream, atol=TOLERANCE[dtype] * 3, rtol=TOLERANCE[dtype])
    assert squares.shape == (rows, 4) and squares.dtype == torch.float32  # one part per band of 32 columns
    torch.testing.assert_close(squares.sum(dim=1), stream.float().pow(2).sum(dim=1), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(scaled, (stream.float() * norm.weight.float()).to(dtype))

    after = torch.randn(60, n, device=DEVICE, dtype=dtype) * n**-0.5
    bias = torch.randn(60, device=DEVICE, dtype=dtype)
    got = skinny_linear(scaled, after, bias, config, squares=squares, eps=norm.eps)
    expected = F.linear(norm(stream).float(), after.float(), bias.float())
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * 3, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("model_name", ["tiny-qwen2", "tiny-llama"])  # with and without q/k/v biases
def test_skinny_projections_match_the_layers(model_name: str) -> None:
    """A layer's projections as the fused model runs them, each add made ready for the norm after it: at a
    decode batch (the skinny kernel, no norm kernel) and past MAX_ROWS (cuBLAS and the add-and-norm kernel).
    The last layer, so that its down projection is made ready for the final norm and the output head (its
    logits, and at a decode batch its greedy tokens). A vocabulary of 1000 (`tiny_with_small_vocab`): 32 bands
    of the output head, the last one uneven, where the whole one took Triton's interpreter 1536."""
    model = tiny_with_small_vocab(model_name, device=DEVICE).model
    layer = model.model.layers[-1]
    attention, mlp = layer.self_attn, layer.mlp
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
        norm.weight.data.normal_(1.0, 0.2)  # not the ones they start as: a weight left out would show
    packed = PackedProjections(model, skinny=True)
    qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
    for rows in (2, MAX_ROWS + 3):
        x = torch.randn(rows, model.config.hidden_size, device=DEVICE) * 3
        attended = torch.randn(rows, attention.o_proj.in_features, device=DEVICE)
        for got, linear in zip(packed[qkv](layer.input_layernorm(x)), qkv, strict=True):
            torch.testing.assert_close(got, linear(layer.input_layernorm(x)), atol=1e-4, rtol=1e-5)

        prepared = packed[attention.o_proj,].add(attended, x)
        stream = x + attention.o_proj(attended)
        torch.testing.assert_close(prepared.stream, stream, atol=1e-4, rtol=1e-5)
        normed = layer.post_attention_layernorm(stream)
        for got, linear in zip(packed[gate_up](prepared.stream, prepared), gate_up, strict=True):
            torch.testing.assert_close(got, linear(normed), atol=1e-4, rtol=1e-5)

        activation = F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed)
        prepared = packed[mlp.down_proj,].add(activation, stream)
        stream = stream + mlp.down_proj(activation)
        assert prepared.norm is model.model.norm
        (logits,) = packed[model.lm_head,](prepared.stream, prepared)
        torch.testing.assert_close(logits, model.lm_head(model.model.norm(stream)), atol=1e-4, rtol=1e-5)
        if rows <= MAX_ROWS:  # the greedy tokens, from the same kernel without the logits
            assert torch.equal(packed[model.lm_head,].argmax(prepared.stream, prepared), logits.argmax(dim=-1))


def argmax_state_is_empty(state: ArgmaxState) -> bool:
    """As every call must leave it, for the next call or the next replay of a graph."""
    return bool((state.best == torch.iinfo(torch.int64).min).all()) and state.arrived.tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_argmax_matches_argmax_of_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    """Small integers, so that every sum is exact whatever its order: the logits rounded to the dtype are then
    known exactly, and many are tied (the lowest column must win, across bands and within one)."""
    n, k = 100, 200  # 4 bands of 32 columns, the last one of 4; 200 = 3 steps of 64 and a bit
    x = torch.randint(-2, 3, (rows, k), device=DEVICE).to(dtype)
    weight = torch.randint(-2, 3, (n, k), device=DEVICE).to(dtype)
    bias = torch.randint(-8, 9, (n,), device=DEVICE).to(dtype) if with_bias else None
    state = ArgmaxState(DEVICE)
    got = skinny_linear_argmax(x, weight, bias, SkinnyConfig(block_n=32, block_k=64), state=state)
    logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert argmax_state_is_empty(state)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_argmax_of_a_normalised_input(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    """The output head's case: x made ready for the final norm by the kernel before (`skinny_linear_add`).
    The token is the argmax of the logits `skinny_linear` writes from the same input, and their largest."""
    n, k = 100, 200
    stream = torch.randn(rows, k, device=DEVICE, dtype=dtype) * 3
    norm = RMSNorm(k, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.2)
    scaled = (stream.float() * norm.weight.float()).to(dtype)
    squares = torch.stack([part.sum(dim=1) for part in stream.float().pow(2).tensor_split(3, dim=1)], dim=1)
    weight = torch.randn(n, k, device=DEVICE, dtype=dtype) * k**-0.5
    bias = torch.randn(n, device=DEVICE, dtype=dtype) if with_bias else None
    config = SkinnyConfig(block_n=32, block_k=64)
    got = skinny_linear_argmax(scaled, weight, bias, config, squares=squares, eps=norm.eps)
    assert torch.equal(got, skinny_linear(scaled, weight, bias, config, squares=squares, eps=norm.eps).argmax(-1))
    expected = F.linear(norm(stream).float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(expected.gather(1, got[:, None]).squeeze(1), expected.max(dim=1).values,
                               atol=TOLERANCE[dtype] * 3, rtol=TOLERANCE[dtype])


def test_skinny_linear_argmax_ties_go_to_the_lowest_column() -> None:
    """Rows made to order, one weight column each (x is one-hot): the same maximum in two bands, twice in
    one band, in the last band next to columns past n (never the best, although they would hold 0.0), all
    outputs negative, and all negative with a tie."""
    n, k, config = 100, 16, SkinnyConfig(block_n=32, block_k=16)
    wanted = -5.0 - torch.rand(5, n, device=DEVICE)  # [row, column]: the output each row should get
    wanted[0, [10, 70]] = 3.0  # bands 0 and 2
    wanted[1, [40, 45, 99]] = 2.0  # twice in band 1, and in the last band
    wanted[2, [96, 97]] = torch.tensor([-0.5, -0.25], device=DEVICE)  # the last band: 96..99, 28 past n
    wanted[3, 30] = -1.0  # band 0's last column, the only one above -5
    wanted[4, [33, 96]] = -0.5  # bands 1 and 3, all negative
    x = torch.eye(5, k, device=DEVICE)
    weight = torch.zeros(n, k, device=DEVICE)
    weight[:, :5] = wanted.T
    state = ArgmaxState(DEVICE)
    got = skinny_linear_argmax(x, weight, config=config, state=state)
    assert got.tolist() == [10, 40, 97, 30, 33]
    assert torch.equal(got, F.linear(x, weight).argmax(dim=-1))
    assert argmax_state_is_empty(state)


def test_skinny_linear_argmax_takes_minus_zero_for_zero() -> None:
    """-0.0 == 0.0, so torch.argmax takes the first of them; their bits differ, and must not decide here. The
    outputs are all negative but for a -0.0 (a negative number too small for float32, once normalised) in band
    0 and a 0.0 in band 2."""
    n, k, config = 100, 16, SkinnyConfig(block_n=32, block_k=16)
    x = torch.zeros(1, k, device=DEVICE)
    x[0, 0] = 1.0
    weight = torch.zeros(n, k, device=DEVICE)
    weight[:, 0] = -1.0
    weight[5, 0], weight[80, 0] = -1e-30, 0.0
    squares = torch.full((1, 1), k * 1e36, device=DEVICE)  # a root mean square of 1e18: -1e-30 becomes -1e-48
    logits = skinny_linear(x, weight, config=config, squares=squares, eps=1e-6)
    assert logits[0, 5] == 0.0 and logits[0, 5].signbit() and not logits[0, 80].signbit()
    got = skinny_linear_argmax(x, weight, config=config, squares=squares, eps=1e-6)
    assert got.tolist() == [5] and torch.equal(got, logits.argmax(dim=-1))


def test_skinny_linear_argmax_leaves_its_state_as_it_found_it() -> None:
    """A CUDA graph replays the same buffers every step: each call resets them for the next, so calls one
    after another on one state each get their own answer."""
    n, k, config = 300, 64, SkinnyConfig(block_n=32, block_k=32)
    state = ArgmaxState(DEVICE)
    assert argmax_state_is_empty(state)
    for rows in (4, 2, 4):
        x = torch.randint(-2, 3, (rows, k), device=DEVICE).float()
        weight = torch.randint(-2, 3, (n, k), device=DEVICE).float()
        got = skinny_linear_argmax(x, weight, config=config, state=state)
        assert torch.equal(got, F.linear(x, weight).argmax(dim=-1))
        assert argmax_state_is_empty(state)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("shared_memory", [100 * 1024, 227 * 1024])
@pytest.mark.parametrize("n", [896, 3584, 4608, 37888])
def test_skinny_config_fits_shared_memory(element_size: int, shared_memory: int, n: int) -> None:
    """The pipeline's tiles fit the device, whatever the dtype: a launch never runs out of shared memory."""
    config = skinny_config(n, element_size, multiprocessors=132, shared_memory=shared_memory)
    stage_bytes = (MAX_ROWS + config.block_n) * config.block_k * element_size
    assert config.num_stages >= 2 and config.num_stages * stage_bytes <= shared_memory
