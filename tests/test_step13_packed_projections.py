"""step13's packed projections: the same outputs as the separate layers, no weight held twice, and the
kernels that read their strided slices (RoPE, the KV write) reading them right."""

from __future__ import annotations

import pytest
import torch

from common.loading import load_model
from step13_fused_decode.packed_projections import PackedProjections


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage behind the model's parameters."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("model_name", ["tiny-qwen2", "tiny-llama"])  # with and without q/k/v biases
def test_packed_outputs_match_the_separate_layers(model_name: str) -> None:
    model = load_model(model_name).model
    layer = model.model.layers[1]
    attention, mlp = layer.self_attn, layer.mlp
    x = torch.randn(5, model.config.hidden_size)
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up = (mlp.gate_proj, mlp.up_proj)
    expected = [[linear(x) for linear in linears] for linears in (qkv, gate_up)]
    before = storage_bytes(model)
    packed = PackedProjections(model)
    for linears, outputs in zip((qkv, gate_up), expected):
        got = packed[linears](x)
        assert len(got) == len(outputs)
        for g, e in zip(got, outputs):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        for linear, e in zip(linears, outputs):  # the layers themselves, now views of the packed weight
            torch.testing.assert_close(linear(x), e, atol=1e-5, rtol=1e-5)
    assert storage_bytes(model) == before, "packing must not keep a second copy of any weight"


def test_packing_twice_copies_nothing() -> None:
    model = load_model("tiny-llama").model
    first = PackedProjections(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    pointer = q_proj.weight.data_ptr()
    second = PackedProjections(model)
    assert q_proj.weight.data_ptr() == pointer
    key = next(iter(first.packed))
    assert second.packed[key].weight.data_ptr() == first.packed[key].weight.data_ptr()


def test_layers_not_packed_are_refused() -> None:
    model = load_model("tiny-llama").model
    packed = PackedProjections(model)
    other = torch.nn.Linear(model.config.hidden_size, 7)  # a layer the model does not have
    with pytest.raises(KeyError, match="not a group of the model"):
        packed[other,]


def test_only_the_residual_projections_are_added_to_the_stream() -> None:
    model = load_model("tiny-llama").model
    packed = PackedProjections(model)
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, model.config.hidden_size)
    with pytest.raises(ValueError, match="only o and down"):
        packed[attention.q_proj, attention.k_proj, attention.v_proj].add(x, x)
