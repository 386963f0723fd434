"""Step 05: the profiler's phases, its trace, and the table read back from it.

On the CPU: profiling steps 01, 06 and 09 on a tiny model writes a trace that loads as JSON with the named ranges,
and the named phases cover all but 10% of each step. The GPU half of the analysis (kernels to phases through
their launches, synchronizations, the GPU's idle time split by what the host was doing) is checked on a trace
written by hand, with every number known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.engine import EngineConfig
from common.loading import load_model
from common.profiling import trace
from common.profiling.phases import ENGINE_METHODS, PHASES, STEP_RANGE, instrument
from common.profiling.profiler import format_report, profile_steps
from common.profiling.trace import BREAKDOWN, Event, read_steps
from common.sampling import SamplingParams
from step05_profiling import run as profile_run

TINY = "tiny-llama"


def decoding(step: str, switches: dict | None = None):  # noqa: ANN201 - an engine
    loaded = load_model(TINY)
    variant = profile_run.Variant(step, step, switches or {})
    return profile_run.decoding_engine(variant, loaded, EngineConfig(model=TINY, device="cpu", dtype="float32"),
                                       batch=4, prompt_len=12, steps=4)


@pytest.mark.parametrize("step", profile_run.DRY_RUN_STEPS)
def test_trace_has_the_named_phases_and_they_cover_the_step(step: str, tmp_path: Path) -> None:
    engine = decoding(step)
    report = profile_steps(engine, 4, tmp_path / "trace.json")
    with open(tmp_path / "trace.json", encoding="utf-8") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    assert names.count(STEP_RANGE) == 4
    for phase in ("prepare inputs", "forward", "sample", "process outputs", "detokenize"):
        assert phase in names, phase
    assert ("schedule" in names) == (step != "step01_serial")  # step 01 admits inline: it has no scheduler
    for step_profile in report.steps:
        covered = sum(step_profile.host_ms[p] for p in PHASES)
        assert covered + step_profile.host_ms["not in a phase"] == pytest.approx(step_profile.ms, rel=1e-6)
        assert sum(step_profile.breakdown[c] for c in BREAKDOWN) == pytest.approx(step_profile.ms, rel=1e-6)
        assert step_profile.host_ms["forward"] > step_profile.host_ms["detokenize"]
    # Over the profiled steps (one step can catch a pause of the machine's in the little code outside the phases):
    summary = report.summary()
    assert summary["host_ms"]["not in a phase"] <= profile_run.PHASE_TOLERANCE * summary["step_ms"], summary["host_ms"]
    assert "forward" in format_report(report)


def test_profiling_changes_no_token_and_leaves_the_engine_as_it_was(tmp_path: Path) -> None:
    plain, profiled = decoding("step09_chunked_prefill"), decoding("step09_chunked_prefill")
    methods = {name: getattr(type(profiled), name) for names in ENGINE_METHODS.values() for name in names
               if hasattr(profiled, name)}
    requests = {id(engine): list(engine.requests.values()) for engine in (plain, profiled)}
    profile_steps(profiled, 3, tmp_path / "trace.json")
    for engine in (plain, profiled):
        while engine.has_unfinished():
            engine.step()
    tokens = [[r.output_token_ids for r in requests[id(engine)]] for engine in (plain, profiled)]
    assert tokens[0] == tokens[1] and all(len(t) > 4 for t in tokens[0])
    assert not {"step", *methods} & set(vars(profiled))  # the instance's wrappers are gone
    assert "forward" not in vars(profiled.model) and "compute_logits" not in vars(profiled.model)
    for name, method in methods.items():
        assert getattr(type(profiled), name) is method


def test_profiled_generation_gives_the_same_tokens(tmp_path: Path) -> None:
    from step01_serial.engine import SerialEngine
    from common.profiling.profiler import profile_generate

    loaded = load_model(TINY)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = SerialEngine(loaded, EngineConfig(model=TINY)).generate(prompts, params)
    profiled, report = profile_generate(SerialEngine(loaded, EngineConfig(model=TINY)), prompts, params, 3,
                                        tmp_path / "trace.json")
    assert [c.token_ids for c in profiled] == [c.token_ids for c in plain]
    assert len(report.steps) == 3


def test_sync_per_layer_shows_as_one_host_read_per_layer(tmp_path: Path) -> None:
    """The seed's bug, as the profiler finds it: step 06's ablation reads a value back in every layer."""
    layers = load_model(TINY).model.config.num_layers
    plain = profile_steps(decoding("step06_paged_attention"), 3, tmp_path / "plain.json")
    synced = profile_steps(decoding("step06_paged_attention", {"sync_per_layer": True}), 3, tmp_path / "sync.json")
    plain_syncs, synced_syncs = [s.syncs for s in plain.steps], [s.syncs for s in synced.steps]
    assert plain_syncs == [0, 0, 0], f"step 06 reads nothing back in a step: counted {plain_syncs} syncs in 3 steps"
    assert synced_syncs == [layers] * 3, (f"--sync-per-layer reads one value back in each of {layers} layers: "
                                          f"expected {[layers] * 3} syncs in 3 steps, counted {synced_syncs}")


def test_run_py_profile_flag_prints_the_table_and_writes_the_trace(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from common.cli import main

    monkeypatch.chdir(tmp_path)  # the trace goes to runs/profile/ under the working directory
    argv = ["--model", TINY, "--device", "cpu", "--max-tokens", "8", "--profile", "3"]  # cpu: the trace's name
    assert main("step06_paged_attention", None, argv) == 0
    out = capsys.readouterr().out
    assert "3 steps profiled" in out and "process outputs" in out and "parity with HF generate(): 4/4" in out
    traces = list((tmp_path / "runs" / "profile").glob("step06_paged_attention-cpu-tiny-llama*.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]


def test_dry_run_passes() -> None:
    assert profile_run.main(["--dry-run"]) == 0


# ----- the analysis on a GPU trace written by hand ---------------------------------------------------------


def ev(cat: str, name: str, start: float, dur: float, correlation: int | None = None, tid: int = 1) -> Event:
    return Event(cat, name, tid, start, dur, correlation)


def test_nesting_gives_own_times_and_depths() -> None:
    outer = ev("user_annotation", "sample", 0, 100)
    inner = ev("user_annotation", "forward", 10, 30)
    innermost = ev("user_annotation", "prepare inputs", 12, 5)
    after = ev("user_annotation", "process outputs", 100, 20)
    # Looked up on its module when the test runs, as the exercise 05-own-time swaps it there.
    got = {e.name: (own, depth) for e, own, depth in trace.nesting([after, innermost, outer, inner])}
    expected = {"sample": (70, 0), "forward": (25, 1), "prepare inputs": (5, 2), "process outputs": (20, 0)}
    wrong = {name: f"(own, depth) {got.get(name)}, expected {want}" for name, want in expected.items()
             if got.get(name) != want}
    assert not wrong, f"sample 0-100 > forward 10-40 > prepare inputs 12-17, then process outputs 100-120: {wrong}"


def test_gpu_trace_kernels_go_to_the_phase_that_launched_them() -> None:
    """One step of 1000 us: the host schedules (0-100), launches the forward (100-300: two kernels), then waits
    in sample (300-900, one sync) and processes outputs (900-1000). The GPU runs a matmul 150-650 and an attention
    kernel 650-750, then idles to the end."""
    events = [
        ev("user_annotation", STEP_RANGE, 0, 1000),
        ev("user_annotation", "schedule", 0, 100),
        ev("user_annotation", "forward", 100, 200),
        ev("cuda_runtime", "cudaLaunchKernel", 110, 5, correlation=1),
        ev("cuda_driver", "cuLaunchKernel", 200, 5, correlation=2),
        ev("user_annotation", "sample", 300, 600),
        ev("cuda_runtime", "cudaStreamSynchronize", 320, 500),
        ev("user_annotation", "process outputs", 900, 100),
        ev("kernel", "sm90_xmma_gemm_bf16", 150, 500, correlation=1, tid=7),
        ev("kernel", "paged_decode_split_kernel", 650, 100, correlation=2, tid=7),
    ]
    [step] = read_steps(events, weight_read_ms=0.3, on_gpu=True)
    counts = {"ms": step.ms, "launches": step.launches, "kernels": step.kernels, "syncs": step.syncs}
    assert counts == {"ms": 1.0, "launches": 2, "kernels": 2, "syncs": 1}, (
        f"one step of 1 ms, 2 launches, 2 kernels and one cudaStreamSynchronize; read {counts}")
    assert step.gpu_ms["forward"] == pytest.approx(0.6) and step.kernels_by_phase["forward"] == 2, (
        f"the forward launched both kernels (0.6 ms of GPU time); read {step.gpu_ms} and {step.kernels_by_phase}")
    assert step.host_ms["sample"] == pytest.approx(0.6) and step.host_ms["not in a phase"] == pytest.approx(0.0), (
        f"the host sampled for 0.6 ms and every microsecond is in a phase; read {step.host_ms}")
    assert step.gpu_busy_ms == pytest.approx(0.6), f"the GPU was busy 0.6 ms; read {step.gpu_busy_ms}"
    assert sum(step.breakdown.values()) == pytest.approx(step.ms), (
        f"the breakdown {step.breakdown} does not add up to the step's {step.ms} ms")
    assert step.breakdown == pytest.approx({
        "weight read": 0.3, "matmul above the weight read": 0.2, "attention": 0.1,
        "element-wise and other kernels": 0.0,
        "gaps between kernels": 0.035,  # 115-150: the matmul's launch call had returned, the kernel not begun
        "waiting for launches": 0.015,  # 100-115: nothing queued yet while the host launched the forward
        "host work not hidden": 0.35,  # idle while it scheduled (0-100) and after the kernels (750-1000)
    })


def test_server_profiles_the_next_steps_under_traffic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """POST /profile answers once that many steps have run with requests in flight; a bad value is refused."""
    import threading

    import httpx
    from openai import OpenAI

    from step08_serve.api_server import create_app
    from step08_serve.async_engine import AsyncEngine
    from step08_serve.launcher import running_server
    from step09_chunked_prefill.engine import ChunkedPrefillEngine, ChunkedPrefillEngineConfig

    monkeypatch.chdir(tmp_path)
    engine = ChunkedPrefillEngine(load_model(TINY), ChunkedPrefillEngineConfig(model=TINY, num_blocks=64))
    with running_server(create_app(AsyncEngine(engine), TINY, TINY)) as url:
        bad = httpx.post(f"{url}/profile", json={"steps": 0})
        assert bad.status_code == 400 and "steps" in bad.json()["error"]["message"]
        answers = []
        asking = threading.Thread(target=lambda: answers.append(httpx.post(f"{url}/profile", json={"steps": 3},
                                                                           timeout=120)))
        asking.start()
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text = client.completions.create(model=TINY, prompt="one two three", max_tokens=48, temperature=0)
        asking.join(timeout=120)
        assert text.choices[0].text is not None and answers and answers[0].status_code == 200
        answer = answers[0].json()
        assert answer["summary"]["steps_profiled"] == 3 and "forward" in answer["table"]
        assert (tmp_path / answer["trace"]).is_file()
    assert "step" not in vars(engine)  # the profiler let go of the engine


def test_overlapping_kernels_count_once_and_the_parts_add_up_to_the_step() -> None:
    """Step 13's dependent launch lets a kernel start before the one before it ends, and wait: the overlap goes
    to the kernel that started first, not to both. A 100 us step: a matmul 0-60, an element-wise kernel 40-100."""
    events = [
        ev("user_annotation", STEP_RANGE, 0, 100),
        ev("user_annotation", "forward", 0, 5),
        ev("cuda_runtime", "cudaGraphLaunch", 1, 3, correlation=9),
        ev("kernel", "_skinny_matmul_kernel", 0, 60, correlation=9, tid=7),
        ev("kernel", "_silu_mul_kernel", 40, 60, correlation=9, tid=7),
    ]
    [step] = read_steps(events, weight_read_ms=0.01, on_gpu=True)
    assert step.gpu_busy_ms == pytest.approx(0.1), (
        f"kernels 0-60 and 40-100 keep the GPU busy 0.1 ms, read {step.gpu_busy_ms}")
    matmul = step.breakdown["weight read"] + step.breakdown["matmul above the weight read"]
    assert matmul == pytest.approx(0.06), f"the matmul (first to start) gets 0.06 ms, got {matmul}: {step.breakdown}"
    other = step.breakdown["element-wise and other kernels"]
    assert other == pytest.approx(0.04), f"the element-wise kernel gets only 0.04 ms, got {other}: {step.breakdown}"
    assert sum(step.breakdown.values()) == pytest.approx(step.ms), (
        f"the breakdown {step.breakdown} does not add up to the step's {step.ms} ms")


def test_step04_refuses_profile_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Step 04's ranks are processes of their own: its run.py says so rather than ignore the flag."""
    from step04_multi_gpu.run import main

    with pytest.raises(SystemExit) as exited:
        main(["--profile"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile does nothing in this step" in err


def test_phase_timer_counts_each_phase_once() -> None:
    """The host-clock twin of the profiler's ranges: a phase's own time leaves out the phases inside it."""
    import time

    from common.profiling.phases import PhaseTimer

    timer = PhaseTimer()
    inner = timer.wrap("sample", lambda: time.sleep(0.02))

    def outer() -> None:
        time.sleep(0.01)
        inner()

    start = time.perf_counter()
    timer.wrap("forward", outer)()
    total = time.perf_counter() - start
    own = timer.own_seconds
    assert own["sample"] >= 0.02 and own["forward"] >= 0.01  # a sleep lasts at least what it is asked
    assert own["forward"] + own["sample"] == pytest.approx(total, abs=0.002)  # each instant counted once
