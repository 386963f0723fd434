"""Step 04's command line and what it asks of an engine: it offers the flags of the step it runs (the final
one's --batch-invariant by default), writes --output-json as every run.py does, and decides whether it can split
an engine from what the engine declares, not from its step's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.steps import STEP_NAMES, Step, engine_class
from step04_multi_gpu import run
from step04_multi_gpu.sharding import TensorParallelConfigError
from step04_multi_gpu.tensor_parallel import check_splits
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig


def parse(argv: list[str]):  # noqa: ANN201
    return run.build_step_parser(run.chosen_step(argv)).parse_args(argv)


def test_the_default_step_offers_its_own_flags() -> None:
    assert run.chosen_step([]) == STEP_NAMES[-1]
    assert parse(["--batch-invariant"]).batch_invariant is True
    assert "--batch-invariant" in run.build_step_parser(STEP_NAMES[-1]).format_help()


def test_an_earlier_step_refuses_a_later_steps_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--step", "step12_cuda_graph", "--no-cuda-graph"]).cuda_graph is False
    with pytest.raises(SystemExit) as exit_info:
        parse(["--step", "step12_cuda_graph", "--batch-invariant"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --batch-invariant" in capsys.readouterr().err


def test_a_step_that_cannot_be_split_is_refused_in_one_line_before_anything_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--step", "step01_serial", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tensor-parallel-size splits the engines of steps 06 and later, not step01_serial")
    assert err.count("\n") == 1


def test_output_json_has_every_run_pys_rows(tmp_path: Path) -> None:
    """Two ranks of the final engine, batch-invariant, on a tiny model: the rows of common/cli.py's run, in prompt
    order, and the run's own check (one process and HF) passes."""
    prompts = ["Hello", "Count to three:"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    out = tmp_path / "out.json"
    code = run.main(["--model", "tiny-qwen3", "--device", "cpu", "--tensor-parallel-size", "2", "--max-tokens", "4",
                     "--batch-invariant", "--prompts-file", str(tmp_path / "prompts.txt"), "--output-json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text(encoding="utf-8"))
    assert [row["prompt"] for row in rows] == prompts
    for row in rows:
        assert set(row) == {"prompt", "token_ids", "text", "finish_reason"}
        assert 1 <= len(row["token_ids"]) <= 4 and isinstance(row["text"], str)


def test_what_an_engine_declares_for_tensor_parallelism() -> None:
    assert not engine_class("step03_vectorized_gather").splits_over_ranks
    assert all(engine_class(name).splits_over_ranks for name in STEP_NAMES[STEP_NAMES.index("step06_paged_attention"):])
    assert not engine_class("step11_speculative_decoding").captures_cuda_graphs
    assert engine_class("step12_cuda_graph").captures_cuda_graphs
    final = engine_class(STEP_NAMES[-1])
    assert final.skips_all_reduces(final.config_class(device="cuda"))
    assert not final.skips_all_reduces(final.config_class(device="cuda", fused_ops=False))
    assert not engine_class("step12_cuda_graph").skips_all_reduces(engine_class("step12_cuda_graph").config_class())


class UnsplitEngine(PagedAttentionEngine):
    splits_over_ranks = False


class GraphEngine(PagedAttentionEngine):
    captures_cuda_graphs = True


class FusedEngine(PagedAttentionEngine):
    @classmethod
    def skips_all_reduces(cls, config: PagedAttentionEngineConfig) -> bool:
        return True


def declared(engine: type) -> Step:
    """A step whose engine is `engine`: whatever its name, only what the engine declares decides."""
    return Step("step06_paged_attention", "an engine of this test", f"{__name__}:{engine.__name__}")


@pytest.mark.parametrize("engine, device, backend, message", [
    (UnsplitEngine, "cpu", "gloo", "splits the engines of steps 06 and later, not step06_paged_attention"),
    (GraphEngine, "cuda", "gloo", "gloo's collectives cannot be captured in CUDA graphs"),
    (FusedEngine, "cuda", "nccl", "would skip their all-reduces: not split yet; add --no-fused-ops"),
])
def test_capabilities_are_read_from_the_engine(engine: type, device: str, backend: str, message: str) -> None:
    config = PagedAttentionEngineConfig(device=device)
    check_splits(declared(PagedAttentionEngine), config, backend)  # the same step's own engine splits
    with pytest.raises(TensorParallelConfigError, match=message):
        check_splits(declared(engine), config, backend)


def test_graphs_and_fused_kernels_split_on_a_cpu() -> None:
    """On a CPU no graph is captured and no fused kernel runs: those engines split there."""
    for engine in (GraphEngine, FusedEngine):
        check_splits(declared(engine), PagedAttentionEngineConfig(device="cpu"), "gloo")
