"""Step 11's speculation in the engines above it: verification steps on step 12's static buffers (replayed as
graphs on a GPU, run eagerly on the same buffers on a CPU), and step 14's overlap, which stops launching ahead
only while the next step may verify proposals."""

from __future__ import annotations

import pytest
import torch

from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step11_speculative_decoding.bench.oracle import OracleProposer
from step12_cuda_graph.engine import CudaGraphEngine, CudaGraphEngineConfig
from step12_cuda_graph.verify_graphs import VERIFY_MAX_TOKENS, verify_token_buckets
from step14_overlap_scheduling.engine import OverlapSchedulingEngine, OverlapSchedulingEngineConfig
from tests.helpers import (CheckedRun, assert_nothing_left, in_vocab, step01_tokens, tight_pool_case,
                           tiny_with_small_vocab)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_verification_buckets_are_small() -> None:
    assert verify_token_buckets(512) == [8, 16, 32, 64, 128, 256, 512]
    assert verify_token_buckets(40) == [8, 16, 32, 40]


def graph_engine(loaded: LoadedModel, k: int, **config: object) -> CudaGraphEngine:
    return CudaGraphEngine(loaded, CudaGraphEngineConfig(
        device=DEVICE, attn="torch" if DEVICE == "cpu" else "triton", mixed_graphs=True, speculative_tokens=k,
        speculative_token_cost=0.0, speculative_step_cost=0.0, **config))


def counting_runs(engine: CudaGraphEngine) -> list[int]:
    """Counts the verification steps that ran on the static buffers (the graphs' path)."""
    runs: list[int] = []
    graphs = engine.verify_graphs
    assert graphs is not None
    run = graphs.run
    graphs.run = lambda chunks, sampled: (runs.append(len(chunks)), run(chunks, sampled))[1]  # type: ignore
    return runs


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("k", [2, 8])
def test_verification_on_static_buffers_gives_step01s_tokens(name: str, k: int) -> None:
    tiny = load_model(name, DEVICE)  # float32: step 01's tokens on the same device are exact
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:5]]
    params = SamplingParams(max_tokens=30)
    engine = graph_engine(tiny, k, block_size=4, max_num_seqs=8)
    runs = counting_runs(engine)
    assert CheckedRun(engine).run(prompts, params) == step01_tokens(tiny, prompts, params)
    assert runs and engine.accepted_tokens > 0
    if DEVICE == "cuda":
        assert engine.verify_graphs.graphs, "verification steps were not captured on the GPU"
    assert engine.speculation_token_limit() == min(engine.token_budget, VERIFY_MAX_TOKENS)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_a_tiny_pool_with_verification_on_static_buffers(preempt: str) -> None:
    tiny = load_model("tiny-llama", DEVICE)
    prompts, params, expected, num_blocks = tight_pool_case(tiny)
    engine = graph_engine(tiny, 4, block_size=4, num_blocks=num_blocks, preempt=preempt)
    runs = counting_runs(engine)
    assert CheckedRun(engine).run(prompts, params) == expected
    assert runs and engine.preemptions > 0
    assert_nothing_left(engine)


def overlap_engine(loaded: LoadedModel, k: int, **config: object) -> OverlapSchedulingEngine:
    return OverlapSchedulingEngine(loaded, OverlapSchedulingEngineConfig(
        device=DEVICE, attn="torch" if DEVICE == "cpu" else "triton", overlap=True, mixed_graphs=True,
        speculative_tokens=k, **config))


def test_overlap_with_speculation_gives_step01s_tokens() -> None:
    tiny = load_model("tiny-qwen2", DEVICE)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=30)
    engine = overlap_engine(tiny, 4, block_size=4, speculative_token_cost=0.0)
    assert CheckedRun(engine).run(prompts, params) == step01_tokens(tiny, prompts, params)
    assert engine.accepted_tokens > 0


def test_overlap_comes_back_once_proposals_stop_paying() -> None:
    """Proposals always wrong: after a few verifications the rule checks none but the probes, and the steps in
    between are launched ahead again."""
    tiny = load_model("tiny-qwen2", DEVICE)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:2]]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = step01_tokens(tiny, prompts, params)
    engine = overlap_engine(tiny, 4, block_size=4, speculative_token_cost=0.012, speculative_step_cost=0.2,
                            speculative_decode_token_cost=0.004)  # a GPU's
    engine.proposer = OracleProposer(4, {tuple(p): c for p, c in zip(prompts, expected, strict=True)}, 0.0,
                                     tiny.model.config.vocab_size)
    assert CheckedRun(engine).run(prompts, params) == expected
    assert engine.accepted_tokens == 0 and engine.verify_rows > 0
    assert engine.steps_launched_ahead > 30


def test_step13_fuses_the_verification_rows_too() -> None:
    """Step 13's verification graphs run the fused twin of the model (packed projections, fused element-wise
    kernels, RoPE and the KV write in one kernel) over step 12's tile list: the same tokens as step 01. On a
    CPU the kernels run in Triton's interpreter, on small shapes."""
    from step13_fused_decode.engine import FusedDecodeEngine, FusedDecodeEngineConfig, FusedVerifyGraphs

    tiny = tiny_with_small_vocab("tiny-qwen3", DEVICE)
    prompts = [in_vocab(tiny.tokenizer.apply_chat_template(p)) for p in PARITY_PROMPTS[:3]]
    params = SamplingParams(max_tokens=12)
    engine = FusedDecodeEngine(tiny, FusedDecodeEngineConfig(
        device=DEVICE, attn="triton", block_size=16, fused_ops=True, mixed_graphs=True, max_num_seqs=4,
        max_model_len=512, max_num_batched_tokens=24, speculative_tokens=3, speculative_token_cost=0.0,
        speculative_step_cost=0.0))
    assert isinstance(engine.verify_graphs, FusedVerifyGraphs)
    runs = counting_runs(engine)
    assert CheckedRun(engine).run(prompts, params, arrive_every=3) == step01_tokens(tiny, prompts, params)
    assert runs and engine.accepted_tokens > 0


def test_sampled_verification_on_static_buffers_draws_step11s_tokens() -> None:
    """Rows that sample take the graphs' logits path (rejection sampling after the replay); seeded, they draw the
    very tokens step 11's eager forward draws."""
    from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeEngineConfig

    tiny = load_model("tiny-qwen3", DEVICE)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:4]]
    params = SamplingParams(max_tokens=30, temperature=0.1, seed=3)
    eager = SpeculativeEngine(tiny, SpeculativeEngineConfig(
        device=DEVICE, attn="torch" if DEVICE == "cpu" else "triton", block_size=4, speculative_tokens=4,
        speculative_token_cost=0.0, speculative_step_cost=0.0))  # as graph_engine's: the same steps verify
    engine = graph_engine(tiny, 4, block_size=4, max_num_seqs=8)
    runs = counting_runs(engine)
    expected = [c.token_ids for c in eager.generate(prompts, params)]
    assert [c.token_ids for c in engine.generate(prompts, params)] == expected
    assert runs and engine.accepted_tokens > 0

