"""The command line: a bad value is one line on stderr and exit code 2 before anything loads, and neither it nor
--help waits for torch; benchmarks write under the ignored runs/, never over the committed evidence in results/
nor over an earlier run's."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compare
from common import cli
from common.bench import RUNS_DIR, default_output
from common.engine import EngineConfig
from common.steps import STEP_NAMES, find_step
from step02_paged_kv.run import add_arguments
from step08_serve.run import build_parser as build_server_parser

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")


# ----- whole programs, as a user runs them ------------------------------------------------------------------

BAD_COMMAND_LINES = [
    pytest.param("step01_serial/run.py", ["--max-tokens", "0"], "error: --max-tokens must be at least 1 (got 0)",
                 id="max-tokens-0"),
    pytest.param("step01_serial/run.py", ["--device", "cuda"], "error: --device cuda is not available", id="no-cuda",
                 marks=NO_CUDA),
    pytest.param("step01_serial/run.py", ["--device", "cuda:99"], "error: --device cuda:99 is not available",
                 id="cuda-99"),
    pytest.param("step01_serial/run.py", ["--device", "nonsense"], "error: --device nonsense is not a device",
                 id="device-nonsense"),
    pytest.param("step01_serial/run.py", ["--bench", "--batch-sizes", "0"], "error: --batch-sizes takes",
                 id="bench-batch-0"),
    pytest.param("step01_serial/run.py", ["--prompts-file", "no/such/prompts.txt"],
                 "error: --prompts-file no/such/prompts.txt does not exist", id="prompts-file-missing"),
    pytest.param("step01_serial/run.py", ["--temperature", "-1"], "error: --temperature must be at least 0",
                 id="temperature-negative"),
    pytest.param("step01_serial/run.py", ["--no-such-flag"], "error: unrecognized arguments: --no-such-flag",
                 id="argparse-unknown-flag"),
    pytest.param("step02_paged_kv/run.py", ["--block-size", "0"], "error: --block-size must be at least 1 (got 0)",
                 id="block-size-0"),
    pytest.param("step08_serve/run.py", ["--device", "cuda"], "error: --device cuda is not available",
                 id="server-no-cuda", marks=NO_CUDA),
    pytest.param("step08_serve/run.py", ["--device", "nonsense"], "error: --device nonsense is not a device",
                 id="server-device-nonsense"),
    pytest.param("step08_serve/run.py", ["--port", "70000"], "error: --port must be between 1 and 65535",
                 id="server-port"),
    pytest.param("compare.py", ["--batch-sizes", "0"], "error: --batch-sizes takes", id="compare-batch-0"),
    pytest.param("compare.py", ["--steps", "step01_serial,step99"], "error: --steps has unknown names step99",
                 id="compare-steps"),
    pytest.param("compare.py", ["--no-hf", "--sampling", '{"logprobs": 50}'],
                 "error: argument --sampling: '{\"logprobs\": 50}': logprobs must be", id="compare-sampling-range"),
    pytest.param("compare.py", ["--no-hf", "--sampling", '{"max_tokens": 3}'],
                 "max_tokens belong to the workload: use --max-tokens", id="compare-sampling-workload"),
    pytest.param("compare.py", ["--sampling", '{"logprobs": 5}'], "error: --sampling sets the engines' requests only",
                 id="compare-sampling-beside-hf"),
]


@pytest.mark.parametrize(("script", "argv", "expected"), BAD_COMMAND_LINES)
def test_bad_value_is_one_line_and_exit_2_before_loading(script: str, argv: list[str], expected: str,
                                                         tmp_path: Path) -> None:
    # An empty model cache: loading any model (the embedded one, or a tiny one's tokenizer) would write to it.
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = subprocess.run([sys.executable, script, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"LLM_STEPS_CACHE": str(cache)})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "", "printed before the check: the run had started"
    assert not any(cache.iterdir()), "a model was loaded before the command line was checked"


# Runs a program as `python PROGRAM ARGS...` would, then prints which of the modules that take seconds to import
# it had loaded by the time it ended.
RUN_AND_NAME_HEAVY_MODULES = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("heavy modules loaded:", sorted({"torch", "transformers"} & set(sys.modules)))
"""

ANSWERED_BEFORE_TORCH = [
    *(pytest.param(f"{name}/run.py", ["--help"], 0, "", id=f"{name}-help") for name in STEP_NAMES),
    pytest.param("step01_serial/run.py", ["--max-tokens", "0"], 2, "error: --max-tokens must be at least 1 (got 0)\n",
                 id="max-tokens-0"),
    pytest.param("step07_preemption/run.py", ["--preempt", "never"], 2, "error: argument --preempt: invalid choice",
                 id="preempt-choice"),
    pytest.param("step09_chunked_prefill/run.py", ["--batched-prefill"], 2, "error: --batched-prefill does nothing",
                 id="refused-flag"),
    # With --step given, the server need not ask torch whether there is a GPU to pick its default step.
    pytest.param("step08_serve/run.py", ["--step", "step10_prefix_caching", "--help"], 0, "", id="server-help"),
    pytest.param("step08_serve/run.py", ["--step", "step10_prefix_caching", "--port", "0"], 2,
                 "error: --port must be between 1 and 65535", id="server-port"),
    pytest.param("compare.py", ["--help"], 0, "", id="compare-help"),
    pytest.param("compare.py", ["--repeats", "0"], 2, "error: --repeats must be at least 1", id="compare-repeats"),
]


@pytest.mark.parametrize(("script", "argv", "code", "stderr"), ANSWERED_BEFORE_TORCH)
def test_help_and_refusals_load_neither_torch_nor_transformers(script: str, argv: list[str], code: int,
                                                               stderr: str) -> None:
    """Torch and transformers take seconds to import (half a minute on a busy 2-core machine): a program imports
    them only once its command line is accepted."""
    proc = subprocess.run([sys.executable, "-c", RUN_AND_NAME_HEAVY_MODULES, script, *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.startswith(stderr), proc.stderr
    assert proc.stdout.splitlines()[-1] == "heavy modules loaded: []", proc.stderr


def test_progress_bars_stay_out_of_a_log_but_warnings_do_not() -> None:
    """Captured here, stderr is no terminal, as in a log file or CI: a progress bar would print a line per redraw."""
    show = "import warnings\nimport common\nfrom tqdm.auto import tqdm\n" \
           "for _ in tqdm(range(3), desc='converting'): pass\nwarnings.warn('a real warning')"
    env = {name: value for name, value in os.environ.items() if name != "TQDM_DISABLE"}
    proc = subprocess.run([sys.executable, "-c", show], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env, check=True)
    assert "converting" not in proc.stderr and "UserWarning: a real warning" in proc.stderr, proc.stderr


# ----- the checks themselves --------------------------------------------------------------------------------


def step_parser() -> argparse.ArgumentParser:
    """step 02's run.py command line: the shared flags and the paged KV cache's."""
    parser = cli.build_parser("test")
    add_arguments(parser)
    return parser


def test_defaults_pass_every_parser() -> None:
    cli.check_args(step_parser().parse_args([]))
    cli.check_args(build_server_parser("step09_chunked_prefill").parse_args([]))
    cli.check_args(compare.build_parser().parse_args([]))


def test_max_tokens_left_out_keeps_the_per_mode_default() -> None:
    """None means "not given": run 48, bench 128, dry run 12; only an explicit value is checked."""
    args = step_parser().parse_args([])
    assert args.max_tokens is None
    cli.check_args(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens must be at least 1 (got 0)"),
        (["--max-tokens", "-5"], "--max-tokens must be at least 1 (got -5)"),
        (["--temperature", "-0.5"], "--temperature must be at least 0 (got -0.5)"),
        (["--temperature", "nan"], "--temperature must be at least 0 (got nan)"),
        (["--prompt-len", "0"], "--prompt-len must be at least 1 (got 0)"),
        (["--repeats", "0"], "--repeats must be at least 1 (got 0)"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1 (got 0)"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1 (got 0)"),
        (["--block-size", "0"], "--block-size must be at least 1 (got 0)"),
        (["--num-blocks", "0"], "--num-blocks must be at least 1 (got 0)"),
        (["--kv-memory-gb", "0"], "--kv-memory-gb must be more than 0 (got 0.0)"),
        (["--batch-sizes", "1,0"], "--batch-sizes takes comma-separated whole numbers of at least 1"),
        (["--batch-sizes", "1,,4"], "--batch-sizes takes comma-separated whole numbers of at least 1"),
        (["--batch-sizes", "four"], "(got 'four')"),
        (["--dtype", "fp16"], "--dtype fp16 is not a dtype: give auto, float32, bfloat16, float16"),
        (["--device", "gpu"], "--device gpu is not a device: give auto, cpu, cuda, cuda:N or mps"),
        (["--prompts-file", "no/such/file.txt"], "--prompts-file no/such/file.txt does not exist"),
    ],
)
def test_check_args_names_the_flag_and_the_value(argv: list[str], message: str) -> None:
    with pytest.raises(cli.CommandLineError) as err:
        cli.check_args(step_parser().parse_args(argv))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("parser", "argv", "message"), [
    (lambda: step_parser_of("step12_cuda_graph"), ["--max-graph-batch", "0"], "--max-graph-batch must be at least 1"),
    (lambda: step_parser_of("step09_chunked_prefill"), ["--max-num-batched-tokens", "0"],
     "--max-num-batched-tokens must be at least 1"),
    (step_parser, ["--profile", "0"], "--profile must be at least 1 (got 0)"),
    (compare.build_parser, ["--hf-static-max-batch", "-1"], "--hf-static-max-batch must be at least 0 (got -1)"),
    (lambda: build_server_parser("step10_prefix_caching"), ["--tensor-parallel-size", "0"],
     "--tensor-parallel-size must be at least 1 (got 0)"),
    (lambda: build_server_parser("step10_prefix_caching"), ["--data-parallel-size", "0"],
     "--data-parallel-size must be at least 1 (got 0)"),
])
def test_each_flag_declares_its_minimum(parser, argv: list[str], message: str) -> None:  # noqa: ANN001
    """A flag's smallest value is declared with the flag (`type=at_least(n)`), a step's own flags too, and
    check_args refuses a smaller one in one line."""
    with pytest.raises(cli.CommandLineError) as err:
        cli.check_args(parser().parse_args(argv))
    assert message in str(err.value) and "\n" not in str(err.value)


def step_parser_of(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser(name)
    find_step(name).add_arguments(parser)
    return parser


def test_prompts_file_that_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(cli.CommandLineError, match="is not a file"):
        cli.check_args(step_parser().parse_args(["--prompts-file", str(tmp_path)]))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n", encoding="utf-8")
    cli.check_args(step_parser().parse_args(["--prompts-file", str(prompts)]))


@pytest.mark.parametrize("argv", [["--port", "0"], ["--port", "65536"], ["--max-num-seqs", "0"],
                                  ["--device", "tpu"], ["--num-blocks", "0"], ["--max-num-batched-tokens", "0"]])
def test_server_flags_are_checked(argv: list[str]) -> None:
    with pytest.raises(cli.CommandLineError):
        cli.check_args(build_server_parser("step09_chunked_prefill").parse_args(argv))


def test_device_names_what_this_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "available_devices", lambda: ["cpu", "cuda:0", "cuda:1"])
    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:01"):
        cli.check_device(good)
    with pytest.raises(cli.CommandLineError, match=r"--device cuda:2 is not available: this machine has: "
                                                   r"cpu, cuda:0, cuda:1"):
        cli.check_device("cuda:2")
    with pytest.raises(cli.CommandLineError, match="--device mps is not available"):
        cli.check_device("mps")
    with pytest.raises(cli.CommandLineError, match=r"is not a device.*\(this machine has: cpu, cuda:0, cuda:1\)"):
        cli.check_device("CUDA")


def test_this_machine_always_has_a_cpu() -> None:
    assert cli.available_devices()[0] == "cpu"
    cli.check_device("cpu")


def test_every_dtype_name_is_one_the_engine_accepts() -> None:
    """check_args and EngineConfig.resolved_dtype must agree on the names."""
    for name in cli.DTYPES:
        EngineConfig(device="cpu", dtype=name).resolved_dtype()
    with pytest.raises(ValueError):
        EngineConfig(device="cpu", dtype="half").resolved_dtype()


def test_parse_sizes_and_names() -> None:
    assert cli.parse_sizes("--batch-sizes", "1,4, 8") == [1, 4, 8]
    for bad in ("0", "", "1,", "-1", "2.5", "x"):
        with pytest.raises(cli.CommandLineError):
            cli.parse_sizes("--batch-sizes", bad)
    assert cli.parse_names("--steps", "a,b", ["a", "b", "c"]) == ["a", "b"]
    with pytest.raises(cli.CommandLineError, match="--steps has unknown names d: choose from a,b,c"):
        cli.parse_names("--steps", "a,d", ["a", "b", "c"])


def test_compare_checks_its_own_flags() -> None:
    assert compare.parse_max_batch(["step01_serial=8", "step02_paged_kv=4"]) == {"step01_serial": 8,
                                                                                 "step02_paged_kv": 4}
    for bad in ("step01_serial=0", "step01_serial", "nope=4", "step01_serial=x"):
        with pytest.raises(cli.CommandLineError, match="--max-batch takes STEP=N"):
            compare.parse_max_batch([bad])


def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        step_parser().parse_args(["--bench", "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: argument --dry-run: not allowed with argument --bench (see --help)\n"


def test_main_returns_2_without_loading(capsys: pytest.CaptureFixture[str]) -> None:
    """In-process too: main() returns 2 (it does not raise), and says nothing on stdout."""
    assert cli.main("step01_serial", None, ["--max-tokens", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --max-tokens must be at least 1 (got 0)\n"


# ----- where benchmarks write -------------------------------------------------------------------------------


def test_default_output_is_under_runs_with_the_old_sub_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """runs/ in place of results/, and below it the path the committed evidence has."""
    monkeypatch.chdir(tmp_path)  # runs/ is relative: an earlier run's file in the checkout would change the name
    assert RUNS_DIR == Path("runs")
    assert default_output("compare", "cpu", "smollm2-135m-instruct") == Path(
        "runs/compare/cpu-smollm2-135m-instruct.json")
    assert default_output("step01_serial", "bench", "cuda", "random:qwen2.5-7b") == Path(
        "runs/step01_serial/bench-cuda-random-qwen2.5-7b.json")
    assert default_output("step08_serve", "serve", "cpu", "Qwen/Qwen2.5-7B-Instruct") == Path(
        "runs/step08_serve/serve-cpu-Qwen-Qwen2.5-7B-Instruct.json")


def test_a_second_run_with_the_same_settings_keeps_the_first_ones_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    written = []
    for _ in range(3):
        path = default_output("step01_serial", "bench", "cpu", "tiny-llama")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        written.append(path)
    assert written == [Path("runs/step01_serial/bench-cpu-tiny-llama.json"),
                       Path("runs/step01_serial/bench-cpu-tiny-llama-2.json"),
                       Path("runs/step01_serial/bench-cpu-tiny-llama-3.json")]


def test_bench_numbers_its_default_file_and_writes_a_given_one_exactly(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two benchmarks with the same settings: the second's evidence goes next to the first's, and a given
    --bench-output is written where asked (replaced, not numbered); each says where it wrote."""
    monkeypatch.chdir(tmp_path)
    quick = ["--bench", "--model", "tiny-llama", "--device", "cpu", "--batch-sizes", "1", "--prompt-len", "4",
             "--max-tokens", "2", "--no-hf"]
    for _ in range(2):
        assert cli.main("step01_serial", None, quick) == 0
        assert cli.main("step01_serial", None, [*quick, "--bench-output", "mine.json"]) == 0
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert wrote == ["wrote runs/step01_serial/bench-cpu-tiny-llama.json", "wrote mine.json",
                     "wrote runs/step01_serial/bench-cpu-tiny-llama-2.json", "wrote mine.json"]
    assert sorted(p.name for p in (tmp_path / "runs/step01_serial").iterdir()) == [
        "bench-cpu-tiny-llama-2.json", "bench-cpu-tiny-llama.json"]
    assert json.loads((tmp_path / "mine.json").read_text())["runs"]


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a checkout")
def test_runs_is_ignored_by_git() -> None:
    path = default_output("step01_serial", "bench", "cpu", "smollm2-135m-instruct")
    assert subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO).returncode == 0


BENCH_SCRIPTS = ["common/cli.py", "compare.py", "step06_paged_attention/bench/kernel_bench.py",
                 "step07_preemption/bench/bench_preempt.py", "step08_serve/bench/bench_serve.py",
                 "step08_serve/bench/bench_open_loop.py", "step08_serve/bench/soak.py",
                 "step13_fused_decode/bench/profile_step.py", "step13_fused_decode/bench/matmul_bench.py",
                 "step14_overlap_scheduling/bench/bench_host.py",
                 "step09_chunked_prefill/bench/bench_long_prompt.py",
                 "step09_chunked_prefill/bench/bench_burst_serve.py",
                 "step06_paged_attention/bench/prefill_kernel_bench.py",
                 "step10_prefix_caching/bench/bench_prefix.py",
                 "step11_speculative_decoding/bench/bench_speculative.py",
                 "step11_speculative_decoding/bench/bench_oracle.py"]


@pytest.mark.parametrize("script", BENCH_SCRIPTS)
def test_bench_scripts_default_to_runs(script: str) -> None:
    """Every benchmark builds its default path with default_output; none names results/ as a default."""
    source = (REPO / script).read_text(encoding="utf-8")
    assert "default_output(" in source
    assert 'Path("results' not in source
