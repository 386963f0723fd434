"""step15_batch_invariant: with --batch-invariant, a request's tokens and logits are the same bits alone and in
any batch; without it, they are not.

A request's logits are caught at the output head (a forward hook), every row the engine computes; a row of
request A alone must then appear, bit for bit, among the rows of A batched with others. Float32 logits over a
vocabulary are never equal by accident, so a row found is A's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from common.engine import Engine
from common.loading import LoadedModel, load_model
from common.model import CausalLM, apply_rope
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step04_multi_gpu.tensor_parallel import TensorParallelEngine
from step15_batch_invariant import attention, invariant_ops
from step15_batch_invariant.engine import BatchInvariantEngine, BatchInvariantEngineConfig
from step15_batch_invariant.invariant_ops import InvariantLinear, batch_invariant_twin
from tests.helpers import first_difference, step01_tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# A kernel test on CPU tensors runs in Triton's interpreter, which a GPU machine leaves off (probe.py and
# bench/bench_invariance.py check the kernels' bits on the GPU itself).
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine Triton's interpreter is "
                                      "off, so the kernel cannot run on the CPU tensors this test uses")
ALWAYS_PROPOSE = {"speculative_token_cost": 0.0, "speculative_step_cost": 0.0, "speculative_decode_token_cost": 0.0}


def engine_for(loaded: LoadedModel, invariant: bool = True, **config: object) -> BatchInvariantEngine:
    return BatchInvariantEngine(loaded, BatchInvariantEngineConfig(device="cpu", batch_invariant=invariant,
                                                                   **config))


def generate_recording(engine: Engine | TensorParallelEngine, prompts: Sequence[list[int]], params: SamplingParams = GREEDY,
                       model: CausalLM | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's tokens, and every logits row the output head (of `model`, by default the engine's) computed
    meanwhile."""
    rows: list[torch.Tensor] = []
    head = (model or engine.model).lm_head
    hook = head.register_forward_hook(lambda module, inputs, out: rows.extend(out.detach().clone()))
    try:
        tokens = [c.token_ids for c in engine.generate(list(prompts), params)]
    finally:
        hook.remove()
    return tokens, rows


def rows_found(wanted: list[torch.Tensor], among: list[torch.Tensor]) -> int:
    return sum(any(torch.equal(row, other) for other in among) for row in wanted)


def chat(loaded: LoadedModel, count: int, start: int = 0) -> list[list[int]]:
    return [loaded.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[start:start + count]]


# ----- the bug, and each fix, op by op ---------------------------------------------------------------------


def test_the_librarys_multiply_gives_a_row_other_bits_in_a_batch() -> None:
    """The lesson's first example: the same row, multiplied alone and as the first of eight."""
    a, b = torch.randn(8, 576, generator=torch.Generator().manual_seed(0)), torch.randn(576, 1536)
    alone, batched = torch.mm(a[:1], b), torch.mm(a, b)[:1]
    assert not torch.equal(alone, batched)
    assert torch.allclose(alone, batched, atol=1e-4)  # both right: they only round differently


@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 17, 40, 100])
def test_row_tiled_linear_gives_each_row_its_bits_alone(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 96, generator=gen), torch.randn(200, 96, generator=gen), torch.randn(200)
    batched = invariant_ops.row_tiled_linear(x, weight, bias)
    error = (batched - F.linear(x, weight, bias)).abs().max().item()
    assert error <= 1e-4, f"{rows} rows: not x @ weight.T + bias (largest difference {error:.3g})"
    for i in {0, rows // 2, rows - 1}:
        alone = invariant_ops.row_tiled_linear(x[i:i + 1], weight, bias)[0]
        differ = (batched[i] != alone).sum().item()
        assert differ == 0, (f"row {i} of {rows}: {differ} of its {alone.numel()} outputs differ from the row "
                             f"computed alone (largest by {(batched[i] - alone).abs().max().item():.3g})")


def test_split_attention_is_causal_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, n, 16, generator=gen) for n in (6, 3, 3))
    keys, values = F.pad(k, (0, 0, 0, 0, 0, 24))[None], F.pad(v, (0, 0, 0, 0, 0, 24))[None]  # 64 keys: 2 pieces
    out = attention.split_attention(q, keys, values, torch.arange(40))
    reference = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, enable_gqa=True).transpose(0, 1)
    error = (out - reference).abs().max().item()
    assert error <= 1e-5, f"40 rows over 64 keys (2 pieces): not causal attention (largest difference {error:.3g})"


def test_split_attention_gives_a_row_the_same_bits_beside_longer_rows_and_more_padding() -> None:
    """Row 0 sees 20 keys: alone with 32 keys of room, or with a neighbour that sees 90 (three more pieces)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, generator=gen)
    keys, values = torch.randn(2, 96, 2, 8, generator=gen), torch.randn(2, 96, 2, 8, generator=gen)
    alone = attention.split_attention(q[:1], keys[:1, :32], values[:1, :32], torch.tensor([19]))
    together = attention.split_attention(q, keys, values, torch.tensor([19, 89]))
    differ = (alone[0] != together[0]).sum().item()
    assert differ == 0, (f"row 0 (20 keys) alone in 32 keys of room and beside a row of 90: {differ} of its "
                         f"{alone[0].numel()} outputs differ (largest by "
                         f"{(alone[0] - together[0]).abs().max().item():.3g})")


@INTERPRETER_ONLY
def test_the_invariant_matmul_kernel_gives_each_row_its_bits_alone() -> None:
    """Our Triton multiply, run here by Triton's interpreter: 150 rows span two tiles of 128, and each tile's
    first row is compared with itself alone. (The interpreter's dot is NumPy's, which rounds a row by its place
    in the tile and by the tile's shape; a GPU's tensor cores do neither, which probe.py checks there.)"""
    from step15_batch_invariant.matmul_kernel import invariant_matmul

    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(150, 48, generator=gen), torch.randn(40, 48, generator=gen), torch.randn(40)
    batched = invariant_matmul(x, weight, bias)
    assert torch.allclose(batched, F.linear(x, weight, bias), atol=1e-4)
    for i in (0, 128):
        assert torch.equal(batched[i], invariant_matmul(x[i:i + 1], weight, bias)[0])


@INTERPRETER_ONLY
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_pieces_decode_gives_each_token_its_prefill_bits(workers: int) -> None:
    """Step 15's GPU decode (run by Triton's interpreter): sequences of 5, 1,100 and 2,100 tokens (one to three
    1,024-key pieces), their pieces shared by 1 to 3 workers, against step 06's prefill kernel summing in the
    same pieces, each new token a one-row chunk and the last token of a 70-token chunk."""
    from step06_paged_attention.triton_kernels import paged_prefill
    from step15_batch_invariant.decode_kernel import attend_in_pieces, pieces_decode

    gen = torch.Generator().manual_seed(0)
    lens, block_size = [5, 1100, 2100], 16
    blocks = [-(-n // block_size) for n in lens]
    k, v = (torch.randn(sum(blocks), block_size, 2, 16, generator=gen) for _ in range(2))
    starts = [sum(blocks[:i]) for i in range(len(lens))]
    table = torch.tensor([[s + j if j < n else 0 for j in range(max(blocks))] for s, n in zip(starts, blocks)],
                         dtype=torch.int32)
    q = torch.randn(len(lens), 6, 16, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    decoded = pieces_decode(q, k, v, table, seq_lens, max(lens), workers)
    one_row_each = paged_prefill(q, k, v, table, torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens, 1,
                                 attend=attend_in_pieces)
    assert torch.equal(decoded, one_row_each)
    chunk = torch.cat([torch.randn(69, 6, 16, generator=gen), q[2:]])  # the last 70 tokens of the 2,100
    in_chunk = paged_prefill(chunk, k, v, table[2:], torch.tensor([0, 70], dtype=torch.int32), seq_lens[2:], 70,
                             attend=attend_in_pieces)
    assert torch.equal(in_chunk[-1], decoded[2])
    keys, values = (x[starts[1]:starts[1] + blocks[1]].flatten(0, 1)[None] for x in (k, v))  # 1,104 slots
    assert torch.allclose(decoded[1:2], attention.split_attention(q[1:2], keys, values, torch.tensor([1099]), 16),
                          atol=1e-5)


@INTERPRETER_ONLY
def test_the_rope_kernel_is_the_models_rope() -> None:
    from step15_batch_invariant.rope_kernel import rope

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen)
    cos, sin = torch.randn(5, 1, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
    assert torch.allclose(rope(x, cos, sin), apply_rope(x, cos, sin), atol=1e-6)


# ----- the engine: one request, alone and batched ------------------------------------------------------------


@pytest.mark.parametrize("budget", [16, 64])
def test_a_request_is_the_same_alone_and_batched_under_any_budget(tiny: LoadedModel, budget: int) -> None:
    prompts = chat(tiny, 5)
    alone_tokens, alone_rows = generate_recording(engine_for(tiny), prompts[:1])
    tokens, rows = generate_recording(engine_for(tiny, max_num_batched_tokens=budget), prompts)
    assert tokens[0] == alone_tokens[0], (
        f"budget {budget}, request 0 batched: {first_difference(alone_tokens[0], tokens[0])}")
    found = rows_found(alone_rows, rows)
    assert found == len(alone_rows) == GREEDY.max_tokens, (
        f"of request 0's {len(alone_rows)} logits rows alone ({GREEDY.max_tokens} expected), {found} come out bit for "
        "bit the same batched")


def test_the_tokens_are_still_the_reference_tokens(tiny: LoadedModel) -> None:
    prompts = chat(tiny, 4)
    tokens, _ = generate_recording(engine_for(tiny, max_num_batched_tokens=16), prompts)
    expected = step01_tokens(tiny, prompts, GREEDY)
    assert tokens == expected, f"not step 01's tokens: {first_difference(expected, tokens)}"


def test_a_prefix_cache_hit_gives_the_same_logits(tiny: LoadedModel) -> None:
    """Its second time, A's prompt is found in the cache: its K/V were computed in another batch, by the same
    arithmetic, so its logits are those of A alone."""
    prompts = chat(tiny, 4)
    _, alone_rows = generate_recording(engine_for(tiny), prompts[:1])
    engine = engine_for(tiny, max_num_batched_tokens=32)
    generate_recording(engine, prompts)
    hits_before = engine.stats()["prefix_cache_hits_total"]
    tokens, rows = generate_recording(engine, [prompts[0], *chat(tiny, 3, start=4)])
    assert engine.stats()["prefix_cache_hits_total"] > hits_before, "A's prompt was not found in the cache"
    found = rows_found(alone_rows, rows)
    assert found == len(alone_rows), (
        f"of A's {len(alone_rows)} logits rows alone, {found} come out bit for bit the same after a cache hit")


def test_speculation_on_and_off_gives_the_same_logits(tiny: LoadedModel) -> None:
    """A verification row computes A's next token as a decode step would: with n-gram proposals checked at
    every chance, A batched with others gives the rows of A decoded alone without speculation."""
    prompts = [tiny.tokenizer.apply_chat_template("one two three one two three one two three one two")] + chat(tiny, 3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone_tokens, alone_rows = generate_recording(engine_for(tiny), prompts[:1], params)
    engine = engine_for(tiny, speculative_tokens=3, **ALWAYS_PROPOSE)
    tokens, rows = generate_recording(engine, prompts, params)
    assert engine.stats()["speculative_proposed_total"] > 0  # verification rows did run
    assert tokens[0] == alone_tokens[0]
    assert rows_found(alone_rows, rows) == len(alone_rows)


@pytest.mark.embedded
def test_the_embedded_model_alone_and_batched_with_the_mode_on_and_off(embedded: LoadedModel) -> None:
    """The real model, multi-byte text among the prompts: with the mode off some of A's logits rows differ in
    a batch (the bug the step fixes); with it on, none does."""
    prompts = chat(embedded, 6)
    found = {}
    for invariant in (False, True):
        alone_tokens, alone_rows = generate_recording(engine_for(embedded, invariant), prompts[:1])
        tokens, rows = generate_recording(engine_for(embedded, invariant, max_num_batched_tokens=32), prompts)
        found[invariant] = rows_found(alone_rows, rows)
        if invariant:
            assert tokens[0] == alone_tokens[0]
    assert found[True] == GREEDY.max_tokens
    assert found[False] < GREEDY.max_tokens


# ----- what the mode turns on, and what it refuses -------------------------------------------------------------


def test_the_twin_shares_the_weights_and_leaves_the_model_as_it_was(tiny: LoadedModel) -> None:
    twin = batch_invariant_twin(tiny.model)
    assert type(twin.lm_head) is InvariantLinear and type(tiny.model.lm_head) is torch.nn.Linear
    assert twin.model.layers[0].mlp.up_proj.weight is tiny.model.model.layers[0].mlp.up_proj.weight


@pytest.mark.parametrize("flags, refusal", [({"skinny_matmul": True}, "--skinny-matmul"),
                                            ({"fused_ops": True}, "drop --fused-ops"),
                                            ({"attn": "flash_attn"}, "--attn torch")])
def test_what_the_mode_cannot_run_is_refused_in_one_line(tiny: LoadedModel, flags: dict, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        engine_for(tiny, **flags)


def test_over_three_ranks_a_request_is_the_same_alone_and_batched() -> None:
    """Step 04's tensor parallelism (gloo, 3 processes: tiny-llama's 3 KV heads) with the mode on: rank 0's logits
    rows of request A alone are among those of A batched with four others, bit for bit. Each rank multiplies its
    shard in one order, and the partial sums of a row-parallel layer are added in rank order."""
    tiny = load_model("tiny-llama", device="cpu")
    prompts = chat(tiny, 5)
    split = TensorParallelEngine("step15_batch_invariant", BatchInvariantEngineConfig(
        model="tiny-llama", device="cpu", batch_invariant=True, max_num_batched_tokens=16), 3)
    try:
        assert isinstance(split.engine.model.model.layers[0].mlp.down_proj, invariant_ops.InvariantRowParallelLinear)
        alone_tokens, alone_rows = generate_recording(split, prompts[:1], model=split.engine.model)
        tokens, rows = generate_recording(split, prompts[1:3] + prompts[:1] + prompts[3:], model=split.engine.model)
    finally:
        split.close()
    assert tokens[2] == alone_tokens[0]
    assert rows_found(alone_rows, rows) == len(alone_rows) == GREEDY.max_tokens
