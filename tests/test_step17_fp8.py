"""Step 17: FP8 weights. e4m3 by hand, a scale per row against one per tensor, and a tiny model whose projections
are FP8 giving, token for token, what HF gives with the dequantized weights."""

from __future__ import annotations

import copy
import gc
import weakref
from dataclasses import replace

import pytest
import torch

from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.reference import hf_model_for, reference_greedy
from common.sampling import SamplingParams
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig
from step09_chunked_prefill.engine import layer_flops_per_token
from step17_fp8_weights.engine import Fp8WeightsEngine, Fp8WeightsEngineConfig
from step17_fp8_weights import fp8
from step17_fp8_weights.fp8 import E4M3_MAX, PROJECTIONS, Fp8Linear, fp8_twin, quantize_projections, weight_bytes
from tests.helpers import check_graphs_match_step06_on_cuda, hf_tokens
from tests.test_sampling_controls import ALWAYS_PROPOSE


def test_a_row_by_hand() -> None:
    """The row's largest magnitude sets its scale (4.48 / 448 = 0.01) and lands on 448; 1.0 / 0.01 = 100 is not an
    e4m3 value (96 and 104 are: 8 steps of 8 between 64 and 128), and rounds to 96 (a tie goes to the even
    mantissa), so it comes back as 0.96."""
    q = fp8.quantize(torch.tensor([[4.48, -1.0, 0.5, 0.0]]))
    assert torch.allclose(q.scale, torch.tensor([0.01]))
    assert q.values.float().tolist() == [[448.0, -96.0, 48.0, 0.0]]
    assert torch.allclose(q.dequantize(), torch.tensor([[4.48, -0.96, 0.48, 0.0]]))


def test_every_weight_comes_back_within_a_sixteenth() -> None:
    weight = torch.randn(64, 256) * torch.logspace(-3, 0, 64)[:, None]  # rows whose ranges span 1,000x
    back = fp8.quantize(weight).dequantize()
    normal = weight.abs() >= weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX * 2**-6  # e4m3's normal range
    assert ((back - weight).abs() <= weight.abs() / 16 + 1e-12)[normal].all()


def test_a_scale_per_row_keeps_small_rows_that_one_per_tensor_loses() -> None:
    """e4m3 spans about 2^17 from its smallest subnormal to 448, so one scale for the tensor loses only rows far
    below the largest: here, rows a million to 30,000 times smaller come back as (mostly) zero."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 0, 64)[:, None]
    row_error = (fp8.quantize(weight).dequantize() - weight).norm(dim=1) / weight.norm(dim=1)
    tensor_error = (fp8.quantize(weight, per_row=False).dequantize() - weight).norm(dim=1) / weight.norm(dim=1)
    assert row_error.max() < 0.04  # every row within a few percent
    assert tensor_error[:8].min() > 0.5 and tensor_error[-32:].max() < 0.04


def test_the_layer_multiplies_by_the_dequantized_weight_to_float32s_rounding() -> None:
    weight, bias, x = torch.randn(24, 40), torch.randn(24), torch.randn(5, 40)
    layer = Fp8Linear(fp8.quantize(weight), bias)
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, fp8.quantize(weight).dequantize(), bias), atol=1e-5)
    assert layer.values.dtype == torch.float8_e4m3fn and layer.values.nbytes == weight.numel()


def test_a_tiny_model_with_fp8_projections_equals_hf_with_the_dequantized_weights() -> None:
    """Every path below the engine reads the projections through the module, so the engine needs no change to
    run FP8 weights on a CPU; the oracle is HF's model with each projection's weight replaced by its dequantized
    value."""
    engine_model, oracle = load_model("tiny-qwen2"), load_model("tiny-qwen2")  # the same seeded weights
    saved = quantize_projections(engine_model.model)
    for layer in oracle.model.model.layers:
        for path in PROJECTIONS:
            linear = layer.get_submodule(path)
            linear.weight.data = fp8.quantize(linear.weight.data).dequantize(linear.weight.dtype)
    assert saved > 0
    hf = hf_model_for(oracle)
    engine = PagedAttentionEngine(engine_model, PagedAttentionEngineConfig(device="cpu", num_blocks=64))
    prompts = [engine_model.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:3]]
    got = engine.generate(prompts, SamplingParams(max_tokens=12))
    eos = engine_model.tokenizer.eos_token_ids
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == reference_greedy(hf, prompt, 12, eos)


def dequantized(loaded: LoadedModel) -> LoadedModel:
    """The model with each projection's weight replaced by its FP8 value, dequantized: the float32 reference."""
    model = copy.deepcopy(loaded.model)
    for layer in model.model.layers:
        for path in PROJECTIONS:
            linear = layer.get_submodule(path)
            linear.weight.data = fp8.quantize(linear.weight.data).dequantize(linear.weight.dtype)
    return replace(loaded, model=model)


PATHS = {"eager": {}, "chunked": {"max_num_batched_tokens": 16}, "speculative": {"speculative_tokens": 4, **ALWAYS_PROPOSE},
         "overlap": {"overlap": True}, "preempted": {"block_size": 4, "num_blocks": 40}}


@pytest.mark.parametrize("path", PATHS)
def test_every_path_with_fp8_weights_equals_the_dequantized_reference(tiny: LoadedModel, path: str) -> None:
    """The final engine with `quantization="fp8"` on each tiny architecture, along each path (prompts in chunks,
    proposals verified, the host overlapped, requests preempted), then the same prompts again (prefix-cache hits):
    HF's greedy tokens with the dequantized weights, token for token."""
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    expected = hf_tokens(dequantized(tiny), prompts, 16)
    engine = Fp8WeightsEngine(tiny, Fp8WeightsEngineConfig(device="cpu", quantization="fp8",
                                                           **({"num_blocks": 256} | PATHS[path])))
    for _ in range(2):  # the second time, every prompt's blocks are in the prefix cache
        assert [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=16))] == expected
    assert engine.hit_tokens > 0
    assert path != "preempted" or engine.preemptions > 0
    assert path != "speculative" or engine.accepted_tokens > 0


def test_the_twin_leaves_the_loaded_model_as_it_was_and_holds_half_the_projection_bytes(tiny: LoadedModel) -> None:
    before = {name: t.clone() for name, t in tiny.model.state_dict().items()}
    twin = fp8_twin(tiny.model)
    assert all(torch.equal(t, before[name]) for name, t in tiny.model.state_dict().items())
    assert isinstance(twin.model.layers[0].mlp.down_proj, Fp8Linear)
    assert twin.model.embed_tokens.weight is tiny.model.model.embed_tokens.weight  # shared, not copied
    # Each projection's float32 weight (4 bytes a value) becomes a byte a value and a float32 scale a row.
    weights = [layer.get_submodule(p).weight for layer in tiny.model.model.layers for p in PROJECTIONS]
    assert weight_bytes(tiny.model) - weight_bytes(twin) == sum(w.nbytes - w.numel() - 4 * w.shape[0] for w in weights)


def test_the_twin_keeps_the_loaded_models_multiply_adds_per_token(tiny: LoadedModel) -> None:
    """Step 09 sizes a GPU step's token budget by a layer's multiply-adds, counted from its parameters: FP8 changes a
    weight's bytes, not its multiply-adds, so the FP8 engine gets the budget the loaded model gets."""
    assert layer_flops_per_token(fp8_twin(tiny.model)) == layer_flops_per_token(tiny.model)


def test_the_memory_report_gives_the_projections_bytes_against_the_loaded_models(tiny: LoadedModel) -> None:
    engine = Fp8WeightsEngine(tiny, Fp8WeightsEngineConfig(device="cpu", num_blocks=16, quantization="fp8"))
    # Each float32 weight (4 bytes a value) is held as a byte a value and a float32 scale a row.
    weights = [layer.get_submodule(p).weight for layer in tiny.model.model.layers for p in PROJECTIONS]
    ratio = sum(w.numel() + 4 * w.shape[0] for w in weights) / sum(w.nbytes for w in weights)
    assert f"their projections 0 MiB ({ratio:.2f}x of " in engine.memory_report()


def test_a_model_loaded_for_fp8_frees_its_projections_before_the_kv_pool_is_sized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV pool is sized from the memory left once the engine holds its weights: the projections the model was
    loaded with must be gone by then, or the pool loses what FP8 saved."""
    from common import engine as common_engine

    loaded_projections: list[weakref.ref] = []

    def spied_load(*args: object) -> LoadedModel:
        loaded = load_model(*args)
        loaded_projections.extend(weakref.ref(layer.get_submodule(p).weight)
                                  for layer in loaded.model.model.layers for p in PROJECTIONS)
        return loaded

    alive_when_sized: list[int] = []

    def spied_budget(engine: Fp8WeightsEngine, config: Fp8WeightsEngineConfig) -> int:
        gc.collect()
        alive_when_sized.append(sum(ref() is not None for ref in loaded_projections))
        return 16

    monkeypatch.setattr(common_engine, "load_model", spied_load)
    monkeypatch.setattr(Fp8WeightsEngine, "blocks_in_budget", spied_budget)
    engine = Fp8WeightsEngine.from_config(Fp8WeightsEngineConfig(model="tiny-qwen2", device="cpu",
                                                                 quantization="fp8"))
    assert loaded_projections and alive_when_sized == [0]
    assert isinstance(engine.model.model.layers[0].mlp.down_proj, Fp8Linear)
    # The report's "as loaded" figures come from the FP8 layers themselves (their dtype), the model having no other.
    weights = [layer.get_submodule(p).values for layer in engine.model.model.layers for p in PROJECTIONS]
    ratio = sum(w.numel() + 4 * w.shape[0] for w in weights) / sum(4 * w.numel() for w in weights)
    assert f"their projections 0 MiB ({ratio:.2f}x of " in engine.memory_report()


def test_a_model_already_fp8_needs_the_flag(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="pass --quantization fp8"):
        Fp8WeightsEngine(replace(tiny, model=fp8_twin(tiny.model)), Fp8WeightsEngineConfig(device="cpu",
                                                                                           num_blocks=16))


def test_an_unknown_quantization_is_refused(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="the choices are fp8"):
        Fp8WeightsEngine(tiny, Fp8WeightsEngineConfig(device="cpu", num_blocks=16, quantization="int4"))


def test_batch_invariance_with_fp8_is_refused_in_one_line(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="drop --quantization or --batch-invariant"):
        Fp8WeightsEngine(tiny, Fp8WeightsEngineConfig(device="cpu", num_blocks=16, quantization="fp8",
                                                      batch_invariant=True))


def test_the_twins_state_is_the_dequantized_model_hf_runs_as_the_reference(tiny: LoadedModel) -> None:
    """What a reader of the FP8 model's state gets (as `hf_model_for` builds the dry run's reference from it): each
    projection's dequantized weight in the model's dtype, under the linear layer's names."""
    twin = fp8_twin(tiny.model)
    state = twin.state_dict()
    assert set(state) == set(tiny.model.state_dict())
    down = tiny.model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight"], fp8.quantize(down).dequantize(down.dtype))
    prompt = tiny.tokenizer.apply_chat_template(PARITY_PROMPTS[0])
    assert reference_greedy(hf_model_for(replace(tiny, model=twin)), prompt, 12, tiny.tokenizer.eos_token_ids) == \
        reference_greedy(hf_model_for(dequantized(tiny)), prompt, 12, tiny.tokenizer.eos_token_ids)


def cut_every_pack_in_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make each FP8 pack cut K into two parts: `fp8_config` never cuts a tiny model's short K."""
    from step17_fp8_weights import fused_path

    settings = fused_path.fp8_config
    monkeypatch.setattr(fused_path, "fp8_config", lambda *args: replace(settings(*args), block_k=16, split_k=2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none here)")
@pytest.mark.parametrize("fused_ops, split", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_captured_graphs_with_fp8_weights_match_step06_on_cuda(model: str, fused_ops: bool, split: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 12's test with FP8 projections (our kernel, and on the fused path step 13's packs of them, with K whole
    and cut in two), against step 06 and HF over the same FP8 weights."""
    if split:
        cut_every_pack_in_two(monkeypatch)
    def make_engine(loaded: LoadedModel, num_blocks: int) -> Fp8WeightsEngine:
        return Fp8WeightsEngine(loaded, Fp8WeightsEngineConfig(
            device="cuda", block_size=16, num_blocks=num_blocks, attn="triton", max_graph_batch=8, fused_ops=fused_ops,
            quantization="fp8"))

    check_graphs_match_step06_on_cuda(model, make_engine, lambda loaded: replace(loaded, model=fp8_twin(loaded.model)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter is off on a GPU machine: "
                    "test_captured_graphs_with_fp8_weights_match_step06_on_cuda runs the packs there")
@pytest.mark.parametrize("split", [False, True])
def test_packed_fp8_projections_give_each_layers_output(tiny: LoadedModel, split: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 13's packs over FP8 projections (`fused_path.Fp8PackedLinear`): q/k/v through the skinny FP8 kernel (K
    whole, and cut in two), each part equal to its own `Fp8Linear`; o added to the residual stream as step 13 adds
    it; the head as it was."""
    from step17_fp8_weights.fused_path import Fp8Projections

    if split:
        cut_every_pack_in_two(monkeypatch)

    model = fp8_twin(tiny.model)
    attention = model.model.layers[0].self_attn
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    x = torch.randn(3, model.config.hidden_size)
    expected = [linear(x) for linear in qkv]
    packed = Fp8Projections(model, skinny=True)
    for got, want in zip(packed[qkv](x), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    residual = torch.randn(3, model.config.hidden_size)
    o_input = torch.randn(3, attention.o_proj.in_features)
    prepared = packed[attention.o_proj,].add(o_input, residual)
    torch.testing.assert_close(prepared.stream, residual + attention.o_proj(o_input), atol=1e-5, rtol=1e-5)
    assert packed[model.lm_head,].kernel_args == {} and packed[qkv].kernel_args["SCALE"].dtype == torch.float32
    assert packed[qkv].skinny.split_k == (2 if split else 1)


@pytest.mark.embedded
def test_the_embedded_model_with_fp8_weights_equals_hf_over_its_dequantized_weights(embedded: LoadedModel) -> None:
    """A checkpoint folder's model, once quantized, is checked against HF built from the engine's weights (the
    dequantized ones), not against the folder's: run.py's parity check on the embedded model passes."""
    from common.checks import check_against_reference

    engine = Fp8WeightsEngine(embedded, Fp8WeightsEngineConfig(device="cpu", quantization="fp8", num_blocks=64))
    assert engine.loaded.source_dir is None and embedded.source_dir is not None
    prompts = [embedded.tokenizer.apply_chat_template(PARITY_PROMPTS[2])]
    completions = engine.generate(prompts, SamplingParams(max_tokens=16))
    reports = check_against_reference(engine, prompts, completions, 16)
    assert all(report.equal for report in reports), [report.describe() for report in reports]
