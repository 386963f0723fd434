"""The benchmark scripts the GPU evidence run calls (scripts/gpu_suite.sh), run end to end on the CPU at a tiny
scale: each one finishes and writes its JSON. They read engines and requests in ways the engine tests do not
(a script that still read a removed engine attribute failed only on the GPU); this keeps them in step with the
engines. The CUDA-only ones (kernel benches, profile_step) are read here only where they can be on a CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

TINY = ["--model", "tiny-llama", "--device", "cpu"]


def written(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text(encoding="utf-8"))


def test_compare(tmp_path: Path) -> None:
    import compare

    out = tmp_path / "compare.json"
    assert compare.main([*TINY, "--batch-sizes", "2", "--max-tokens", "3", "--no-hf",
                         "--steps", "step06_paged_attention,step14_overlap_scheduling", "--output", str(out)]) == 0
    assert {run["system"] for run in written(out)["runs"]} == {"step06_paged_attention", "step14_overlap_scheduling"}


def test_compare_sampling_reaches_every_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--sampling: each engine request carries the fields, and the evidence names them."""
    import compare
    from common.engine import Engine

    seen = []
    add_request = Engine.add_request

    def recording_add(self, prompt, params=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(params)
        return add_request(self, prompt, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "add_request", recording_add)
    out = tmp_path / "compare.json"
    fields = {"presence_penalty": 0.5, "logprobs": 2}
    assert compare.main([*TINY, "--batch-sizes", "2", "--max-tokens", "3", "--no-hf", "--steps",
                         "step10_prefix_caching", "--sampling", json.dumps(fields), "--output", str(out)]) == 0
    assert seen and all(p.presence_penalty == 0.5 and p.logprobs == 2 for p in seen)
    assert written(out)["sampling"] == fields


def test_bench_prefill(tmp_path: Path) -> None:
    from step06_paged_attention.bench import bench_prefill

    out = tmp_path / "prefill.json"
    assert bench_prefill.main([*TINY, "--attn", "torch", "--batch-sizes", "2", "--prompt-lens", "16",
                               "--max-tokens", "3", "--output", str(out)]) == 0
    assert len(written(out)["runs"]) == 3  # step 03, step 06 without batched prefill, step 06


def test_bench_preempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from step07_preemption.bench import bench_preempt

    out = tmp_path / "preempt.json"
    monkeypatch.setattr(sys, "argv", ["bench_preempt.py", *TINY, "--requests", "3", "--min-len", "16",
                                      "--max-len", "32", "--swap-blocks", "2", "--output", str(out)])
    assert bench_preempt.main() == 0
    doc = written(out)
    assert len(doc["runs"]) == 4 and doc["swap_bandwidth"]["blocks"] == 2


@pytest.mark.parametrize("step", ["step07_preemption", "step14_overlap_scheduling"])
def test_bench_long_prompt(tmp_path: Path, step: str) -> None:
    from step09_chunked_prefill.bench import bench_long_prompt

    out = tmp_path / "long-prompt.json"
    assert bench_long_prompt.main([*TINY, "--step", step, "--budgets", "none", "--decoders", "2",
                                   "--long-prompt-len", "48", "--steady-steps", "2", "--burst-requests", "2",
                                   "--burst-prompt-len", "32", "--burst-max-tokens", "2", "--output", str(out)]) == 0
    doc = written(out)
    assert doc["stall"][0]["budget"] == "none" and doc["burst"][0]["survived"]


def test_bench_prefix(tmp_path: Path) -> None:
    from step10_prefix_caching.bench import bench_prefix

    out = tmp_path / "prefix.json"
    assert bench_prefix.main([*TINY, "--step", "step14_overlap_scheduling", "--requests", "2", "--prefix-len", "32",
                              "--suffix-len", "4", "--conversations", "2", "--turns", "2", "--user-len", "8",
                              "--max-tokens", "2", "--output", str(out)]) == 0
    assert len(written(out)["runs"]) == 4  # two scenarios, caching on and off


def test_bench_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from step14_overlap_scheduling.bench import bench_overlap

    out = tmp_path / "overlap.json"
    monkeypatch.setattr(sys, "argv", ["bench_overlap.py", *TINY, "--batches", "2", "--prompt-len", "8",
                                      "--max-tokens", "4", "--output", str(out)])
    assert bench_overlap.main() == 0
    row = written(out)["rows"][0]
    assert row["batch"] == 2 and row["gpu_ms"] is None and row["overlap"]["decode_steps"] > 0


def test_bench_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from step14_overlap_scheduling.bench import bench_host

    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["bench_host.py", "--batches", "2", "--prompt-len", "16", "--steps", "2",
                                      "--output", str(out)])
    threads = torch.get_num_threads()
    try:
        assert bench_host.main() == 0
    finally:
        torch.set_num_threads(threads)  # the script keeps the forward on one thread: not the other tests
    row = written(out)["rows"][0]["ms_per_step"]
    assert {"schedule", "prepare inputs", "forward", "process outputs", "detokenize"} <= set(row)
    assert row["forward"] > 0 and row["host, all of it"] > row["process outputs"] > 0


def test_profile_step_finds_our_attention_kernels() -> None:
    """The decode profile's attention share is made of our kernels, found by their names (a rename once moved
    them to "other" without a word)."""
    pytest.importorskip("triton")
    from common.profiling.kernels import category_of
    from step06_paged_attention.triton_kernels import PagedAttentionKernels
    from step13_fused_decode.attention_pdl import PDLPagedAttentionKernels

    kernels = [getattr(PagedAttentionKernels, name) for name in ("write_kv_kernel", "decode_kernel", "merge_kernel")]
    kernels += [getattr(PDLPagedAttentionKernels, name).kernel  # step 13's PDL twins, wrapped for their launch
                for name in ("write_kv_kernel", "decode_kernel", "merge_kernel")]
    names = [kernel.fn.__name__ for kernel in kernels]  # the names the profiler shows
    assert all(category_of(name) == "attention" for name in names), names
    assert category_of("_rope_and_kv_write_kernel") != "attention"  # step 13's fused kernel: not attention


def test_bench_oracle_and_its_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run as step 11's lesson runs it (no --step), it runs step 11's engine, and says once that CPU times are for
    the shape of the curves."""
    from scripts import plot_speculative
    from step11_speculative_decoding.bench import bench_oracle

    out = tmp_path / "oracle.json"
    assert bench_oracle.main([*TINY, "--batch-sizes", "1,2", "--ks", "2", "--acceptances", "0,0.9", "--max-tokens", "6",
                              "--token-cost", "0", "--step-cost", "0", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count(bench_oracle.CPU_WARNING) == 1
    assert "[SpeculativeEngine] " in printed and "[CudaGraphEngine] " not in printed  # the engines' start-up lines
    assert written(out)["settings"]["step"] == "step11_speculative_decoding"
    runs = written(out)["runs"]
    assert [(r["batch"], r["k"]) for r in runs] == [(1, 0), (1, 2), (1, 2), (2, 0), (2, 2), (2, 2)]
    assert all(r["identical_to_off"] for r in runs if r["k"])  # float32 on a CPU: the oracle's a is exact
    assert plot_speculative.main([str(out), "--measured", str(out), "--output", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_bench_oracle_takes_a_later_step_on_request() -> None:
    from common.steps import STEPS
    from step11_speculative_decoding.bench import bench_oracle

    parser = bench_oracle.build_parser()
    assert parser.parse_args([]).step == "step11_speculative_decoding"
    assert parser.parse_args(["--step", STEPS[-1].name]).step == STEPS[-1].name
    with pytest.raises(SystemExit):
        parser.parse_args(["--step", "step10_prefix_caching"])  # it does not speculate


def test_bench_tensor_parallel_counts_two_all_reduces_a_layer(tmp_path: Path) -> None:
    from step04_multi_gpu.bench import bench_tensor_parallel

    out = tmp_path / "tp.json"
    assert bench_tensor_parallel.main(["--model", "tiny-qwen3", "--sizes", "1,2", "--batch-sizes", "1,2",
                                       "--max-tokens", "5", "--output", str(out)]) == 0
    runs = written(out)["runs"]
    assert [(r["tensor_parallel_size"], r["batch"]) for r in runs] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    from common.loading import load_model

    layers = load_model("tiny-qwen3").model.config.num_layers
    # Each forward: two all-reduces a layer and one for the embedding, of each token's hidden state.
    assert [r["all_reduces_per_step"] for r in runs] == [0, 0, 2 * layers + 1, 2 * layers + 1]


def test_bench_replicas_spreads_a_fixed_workload(tmp_path: Path) -> None:
    from step04_multi_gpu.bench import bench_replicas

    out = tmp_path / "replicas.json"
    assert bench_replicas.main(["--model", "tiny-qwen3", "--workload", "fixed", "--batch", "8", "--max-tokens", "4",
                                "--output", str(out)]) == 0
    runs = written(out)["runs"]
    assert [r["replicas"] for r in runs] == [1, 2]
    assert all(r["output_tokens"] == 32 for r in runs)
    assert sum(runs[1]["requests_routed"]) == 8 and min(runs[1]["requests_routed"]) >= 3


def test_bench_grammar_with_its_decode_cost(tmp_path: Path) -> None:
    """Outputs that parse, the grammar's own costs, and decode free against constrained, each way's requests
    carrying the format they are said to."""
    from step16_structured_output.bench import bench_grammar

    out = tmp_path / "grammar.json"
    assert bench_grammar.main([*TINY, "--prompts", "2", "--schemas", "enum", "--max-tokens", "24",
                               "--decode-batch-sizes", "1,4", "--decode-tokens", "6", "--output", str(out)]) == 0
    doc = written(out)
    assert doc["outputs"][0]["constrained greedy"]["valid"] == 1.0
    assert [row["batch"] for row in doc["decode"]] == [1, 4]
    assert set(doc["decode"][1]) >= {"free", "every request constrained", "every other request constrained"}
    assert all(doc["decode"][1][way]["tok_per_s"] > 0 for way in ("free", "every other request constrained"))


def test_bench_fp8_accuracy(tmp_path: Path) -> None:
    """Float32 against FP8 projections (a scale per row, one per tensor): perplexity, layer errors, agreement."""
    from step17_fp8_weights.bench import bench_accuracy

    out = tmp_path / "accuracy.json"
    assert bench_accuracy.main(["--model", "tiny-llama", "--prompts", "2", "--max-tokens", "4", "--text-tokens", "64",
                                "--output", str(out)]) == 0
    variants = written(out)["variants"]
    assert [v["variant"] for v in variants] == list(bench_accuracy.VARIANTS)
    assert variants[1]["weight_bytes"] < variants[0]["weight_bytes"]
    assert len(variants[1]["layer_relative_error"]) == 2 and 0 < variants[1]["layer_relative_error"][-1] < 1
