"""step13's fused element-wise kernels against common/model.py's PyTorch versions, and the engine on them.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py), in float32;
on a GPU bfloat16 is checked too. Inputs are random, never zeros; shapes are uneven (a hidden size that is
not a power of two, GQA with fewer key heads than query heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed (it ships for Linux x86-64 only)")
from common.checks import compare_engines, staggered_generate  # noqa: E402
from common.config import tiny_config  # noqa: E402
from common.engine import EngineConfig  # noqa: E402
from common.loading import load_model  # noqa: E402
from common.model import RMSNorm, RotaryEmbedding, apply_rope  # noqa: E402
from common.prompts import PARITY_PROMPTS  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from step01_serial.engine import SerialEngine  # noqa: E402
from step13_fused_decode import fused_kernels  # noqa: E402
from step13_fused_decode.engine import FusedDecodeEngine, FusedDecodeEngineConfig  # noqa: E402
from step13_fused_decode.skinny_matmul import skinny_linear  # noqa: E402
from tests.helpers import in_vocab, tiny_with_small_vocab  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 16), "packed"])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...] | str) -> None:
    if shape == "packed":  # q's heads inside one packed q/k/v projection, as Qwen3 normalises them
        x = (torch.randn(3, 8 * 16, device=DEVICE, dtype=dtype) * 3)[:, : 4 * 16].view(3, 4, 16)
    else:
        x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3
    norm = RMSNorm(x.shape[-1], 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    torch.testing.assert_close(fused_kernels.rms_norm(x, norm.weight, norm.eps), norm(x),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    norm = RMSNorm(96, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(5, 96, device=DEVICE, dtype=dtype) * 3
    update = torch.randn_like(x)
    total, normed = fused_kernels.add_rms_norm(x, update, norm.weight, norm.eps)
    # One rounding of an exact float32 sum: the same as PyTorch's.
    assert torch.equal(total, x + update), (
        f"total is not x + update bit for bit: largest difference {(total - (x + update)).abs().max().item():.3g}")
    torch.testing.assert_close(normed, norm(x + update), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype],
                               msg=lambda m: f"normed is not RMSNorm(x + update):\n{m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_for_norm_leaves_the_rows_ready_for_the_norm(dtype: torch.dtype) -> None:
    embedding = torch.nn.Embedding(50, 96).to(DEVICE, dtype)
    norm = RMSNorm(96, 1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    ids = torch.tensor([7, 0, 49, 7, 3], device=DEVICE, dtype=torch.int32)  # a repeat and both ends
    stream, scaled, squares = fused_kernels.embed_for_norm(ids, embedding.weight, norm.weight)
    rows = embedding(ids.long())
    assert torch.equal(stream, rows)
    assert torch.equal(scaled, (rows.float() * norm.weight.float()).to(dtype))
    torch.testing.assert_close(squares[:, 0], rows.float().square().sum(dim=1), atol=1e-4, rtol=1e-5)
    # What the first projection makes of them (`skinny_linear` with the squares) is the projection of norm(rows).
    weight = torch.randn(40, 96, device=DEVICE, dtype=dtype)
    projected = skinny_linear(scaled, weight, squares=squares, eps=norm.eps)
    torch.testing.assert_close(projected, F.linear(norm(rows), weight), atol=4 * TOLERANCE[dtype], rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_rotate_and_write_kv_matches_apply_rope(dtype: torch.dtype, packed: bool) -> None:
    config = tiny_config("qwen2")
    rope = RotaryEmbedding(config, DEVICE)
    positions = torch.tensor([0, 7, 3, 120, 55], device=DEVICE)
    cos, sin = rope.lookup(positions, dtype)
    dim = config.head_dim
    if packed:  # column slices of one q/k/v projection, as step 12's packed projections return them
        q, k, v = torch.randn(5, 10 * dim, device=DEVICE, dtype=dtype).split([6 * dim, 2 * dim, 2 * dim], dim=-1)
        q, k, v = q.view(5, 6, dim), k.view(5, 2, dim), v.view(5, 2, dim)
    else:
        q = torch.randn(5, 6, dim, device=DEVICE, dtype=dtype)
        k, v = torch.randn(2, 5, 2, dim, device=DEVICE, dtype=dtype)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, dim, device=DEVICE, dtype=dtype)  # 6 blocks of 4 slots
    slots = torch.tensor([17, 2, 9, 23, 4], device=DEVICE, dtype=torch.int32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = fused_kernels.rotate_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q_out, apply_rope(q, cos, sin), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    written = slots.long()
    torch.testing.assert_close(k_cache.view(24, 2, dim)[written], apply_rope(k, cos, sin), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    assert torch.equal(v_cache.view(24, 2, dim)[written], v)
    untouched = torch.ones(24, dtype=torch.bool, device=DEVICE)
    untouched[written] = False  # every other slot keeps what it held
    assert torch.equal(k_cache.view(24, 2, dim)[untouched], k_before.view(24, 2, dim)[untouched])
    assert torch.equal(v_cache.view(24, 2, dim)[untouched], v_before.view(24, 2, dim)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_silu_mul(dtype: torch.dtype, packed: bool) -> None:
    if packed:  # the two halves of one gate/up projection, as step 12's packed projections return them
        gate, up = (torch.randn(3, 3000, device=DEVICE, dtype=dtype) * 4).split([1500, 1500], dim=-1)
    else:
        gate = torch.randn(3, 1500, device=DEVICE, dtype=dtype) * 4  # not a multiple of the block
        up = torch.randn_like(gate)
    torch.testing.assert_close(fused_kernels.silu_mul(gate, up), F.silu(gate) * up,
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_engine_with_fused_ops_matches_step01(model: str) -> None:
    """Requests arriving one per step, decoded through the fused kernels: step 01's tokens, or a
    difference HF shows to be a tie (float32 sums are rounded at other places). The tiny model with a vocabulary
    of 1000 (`tiny_with_small_vocab`): the whole one made the output head's kernel take 95% of the time in
    Triton's interpreter; its shape is checked by `test_step13_skinny_matmul.py`."""
    loaded = tiny_with_small_vocab(model, device=DEVICE)
    prompts = [in_vocab(loaded.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=8)
    expected = SerialEngine(loaded, EngineConfig(device=DEVICE)).generate(prompts, params)
    engine = FusedDecodeEngine(loaded, FusedDecodeEngineConfig(device=DEVICE, block_size=16, num_blocks=64,
                                                               attn="torch", fused_ops=True, max_graph_batch=4))
    outputs = staggered_generate(engine, prompts, params, arrive_every=1)
    reports = compare_engines(loaded, prompts, outputs, expected)
    assert all(r.ok for r in reports), [r.describe() for r in reports if not r.ok]
    assert sum(r.equal for r in reports) >= len(prompts) - 1


def test_engine_with_fused_ops_on_cublas_matches_step01() -> None:
    """`--no-skinny-matmul`: the o and down projections are cuBLAS's (PyTorch's on a CPU), and the add-and-norm
    kernel (`add_rms_norm`) adds each to the residual stream and normalises it for the next layer: step 01's
    tokens, or a difference HF shows to be a tie."""
    loaded = tiny_with_small_vocab("tiny-llama", device=DEVICE)
    prompts = [in_vocab(loaded.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=8)
    expected = SerialEngine(loaded, EngineConfig(device=DEVICE)).generate(prompts, params)
    engine = FusedDecodeEngine(loaded, FusedDecodeEngineConfig(device=DEVICE, block_size=16, num_blocks=64,
                                                               attn="torch", fused_ops=True, skinny_matmul=False,
                                                               max_graph_batch=4))
    outputs = staggered_generate(engine, prompts, params, arrive_every=1)
    reports = compare_engines(loaded, prompts, outputs, expected)
    assert all(r.ok for r in reports), [r.describe() for r in reports if not r.ok]
    differing = [i for i, r in enumerate(reports) if not r.equal]
    assert len(differing) <= 1, f"requests {differing} differ from step 01 (at ties): at most one may"


def test_mixed_steps_run_the_fused_twin_too() -> None:
    """With mixed-step graphs, a prompt's chunks and the decoders beside them run the fused twin (packed
    projections, fused element-wise kernels, RoPE and the KV write in one kernel) over step 12's tile list: step
    01's tokens, or a difference HF shows to be a tie. On a CPU in Triton's interpreter, on small shapes."""
    from step13_fused_decode.engine import FusedMixedGraphs

    loaded = tiny_with_small_vocab("tiny-qwen2", device=DEVICE)
    prompts = [in_vocab(loaded.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=8)
    expected = SerialEngine(loaded, EngineConfig(device=DEVICE)).generate(prompts, params)
    engine = FusedDecodeEngine(loaded, FusedDecodeEngineConfig(
        device=DEVICE, block_size=16, num_blocks=64, attn="triton", fused_ops=True, mixed_graphs=True,
        max_graph_batch=4, max_num_seqs=4, max_num_batched_tokens=40))  # prompts in chunks, decoders beside
    assert isinstance(engine.mixed, FusedMixedGraphs)
    outputs = staggered_generate(engine, prompts, params, arrive_every=2)
    reports = compare_engines(loaded, prompts, outputs, expected)
    assert all(r.ok for r in reports), [r.describe() for r in reports if not r.ok]
    assert sum(r.equal for r in reports) >= len(prompts) - 1


def test_fused_ops_need_the_graph_path() -> None:
    with pytest.raises(ValueError, match="drop --no-cuda-graph"):
        FusedDecodeEngine(load_model("tiny-llama"), FusedDecodeEngineConfig(device="cpu", num_blocks=8,
                                                                            cuda_graph=False, fused_ops=True))


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a GPU of compute capability 9.0 or later (none here)")
def test_kernels_launched_with_pdl_read_what_the_kernel_before_wrote() -> None:
    """A chain where each kernel reads the output of the one launched just before it, step 06's attention
    kernels, RoPE writing K/V and the output head's argmax among them: with programmatic dependent launch
    every kernel must wait for its predecessor, so the results are bit for bit those of ordinary launches."""
    from step06_paged_attention.triton_kernels import PagedAttentionKernels
    from step13_fused_decode.attention_pdl import PDLPagedAttentionKernels
    from step13_fused_decode.skinny_matmul import ArgmaxState, skinny_linear, skinny_linear_argmax

    x = torch.randn(8, 3584, device=DEVICE, dtype=torch.bfloat16)
    update = torch.randn_like(x)
    norm_weight = torch.rand(3584, device=DEVICE, dtype=torch.bfloat16) + 0.5
    weight = torch.randn(4096, 3584, device=DEVICE, dtype=torch.bfloat16) * 3584**-0.5
    # Step 06's attention in the chain: 8 sequences of 4 blocks each (8 query heads, 2 KV heads), their
    # blocks shuffled in the pool; each writes its new token's K/V and attends over its cached tokens.
    caches = torch.randn(2, 32, 16, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    block_table = torch.randperm(32, device=DEVICE, dtype=torch.int32).reshape(8, 4)
    seq_lens = torch.randint(10, 65, (8,), device=DEVICE, dtype=torch.int32)
    last = (seq_lens - 1).long()
    slots = (block_table.gather(1, (last // 16)[:, None]).squeeze(1).long() * 16 + last % 16).int()
    head = torch.randn(32000, 1024, device=DEVICE, dtype=torch.bfloat16) * 1024**-0.5
    argmax_state = ArgmaxState(DEVICE)
    angles = torch.rand(8, 1, 128, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    def chain(pdl: bool) -> list[torch.Tensor]:
        triton_kernels = PDLPagedAttentionKernels() if pdl else PagedAttentionKernels()  # step 06's, or launched early
        total, normed = fused_kernels.add_rms_norm(x, update, norm_weight, 1e-6, pdl=pdl)
        projected = skinny_linear(normed, weight, pdl=pdl)
        q, k, v = (projected[:, :1024].reshape(8, 8, 128), projected[:, 1024:1280].reshape(8, 2, 128),
                   projected[:, 1280:1536].reshape(8, 2, 128))
        k_cache, v_cache = caches.clone()
        triton_kernels.write_kv(k, v, k_cache, v_cache, slots)
        arrived = torch.zeros(16, dtype=torch.int32, device=DEVICE)
        attended = [triton_kernels.paged_decode(q, k_cache, v_cache, block_table, seq_lens, num_splits=splits,
                                                arrived=arrived).reshape(8, 1024)
                    for splits in (2, 16)]  # merged inside the decode kernel, and by a kernel of their own
        # Step 13's RoPE writing K/V before the decode kernel, which it lets start early (2 splits, merged
        # inside the decode kernel) or only once it has exited (16 splits, then the merge kernel).
        rope_k_cache, rope_v_cache = caches.clone()
        rotated = []
        for splits in (2, 16):
            q_rotated = fused_kernels.rotate_and_write_kv(q, k, v, cos, sin, rope_k_cache, rope_v_cache, slots,
                                                          pdl=pdl, decode_early=splits == 2)
            rotated.append(triton_kernels.paged_decode(q_rotated, rope_k_cache, rope_v_cache, block_table, seq_lens,
                                                       num_splits=splits, arrived=arrived).reshape(8, 1024))
        gated = fused_kernels.silu_mul(rotated[0], rotated[1], pdl=pdl)
        final = fused_kernels.rms_norm(gated, norm_weight[:1024], 1e-6, pdl=pdl)
        tokens = skinny_linear_argmax(final, head, pdl=pdl, state=argmax_state)  # counts in on kept buffers
        return [total, normed, projected, k_cache, *attended, rope_k_cache, *rotated, gated, final, tokens]

    expected = chain(pdl=False)
    for _ in range(3):
        for got, want in zip(chain(pdl=True), expected, strict=True):
            assert torch.equal(got, want)
