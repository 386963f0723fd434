"""step13_fused_decode: its switches, and its replayed graphs against step 06 on a GPU (the fused kernels
themselves: test_step13_fused_kernels.py, test_step13_skinny_matmul.py, test_step13_packed_projections.py)."""

from __future__ import annotations

import pytest
import torch

from common.loading import load_model
from step13_fused_decode.engine import FusedDecodeEngine, FusedDecodeEngineConfig
from tests.helpers import check_graphs_match_step06_on_cuda


def test_cpu_says_it_runs_step12s_plain_path() -> None:
    """On a CPU nothing is captured, so fused ops are off by default: step 12's eager static-buffer decode."""
    engine = FusedDecodeEngine(load_model("tiny-llama"), FusedDecodeEngineConfig(device="cpu", num_blocks=16))
    assert "eager" in engine.graph_status() and "fused" not in engine.graph_status()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine Triton's interpreter is off, so the fused "
                    "path cannot run on the CPU device this test uses")
def test_pdl_needs_a_gpu_that_has_it() -> None:
    with pytest.raises(ValueError, match="drop --pdl"):
        FusedDecodeEngine(load_model("tiny-llama"), FusedDecodeEngineConfig(device="cpu", num_blocks=16,
                                                                            fused_ops=True, pdl=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (none here)")
@pytest.mark.parametrize("fused_ops, pdl", [(False, None), (True, False), (True, None)])  # None: where the GPU has it
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_captured_graphs_match_step06_on_cuda(model: str, fused_ops: bool, pdl: bool | None) -> None:
    """Step 12's test on the fused path, with and without programmatic dependent launch."""
    def make_engine(loaded, num_blocks: int) -> FusedDecodeEngine:  # noqa: ANN001
        engine = FusedDecodeEngine(loaded, FusedDecodeEngineConfig(device="cuda", block_size=16, num_blocks=num_blocks,
                                                                   attn="triton", max_graph_batch=8,
                                                                   fused_ops=fused_ops, pdl=pdl))
        assert getattr(engine.graphs, "pdl", False) == (fused_ops and pdl is None and engine.supports_pdl(engine.device))
        return engine

    check_graphs_match_step06_on_cuda(model, make_engine)
