"""step08_serve/bench/bench_open_loop.py at a tiny scale on the CPU: against this project's server started as a
process, against a running server named by URL (started here in-process), its arrival schedule alone, its
refusals of bad flags, and the plot of its evidence."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.loading import load_model
from common.sampling import SamplingParams
from scripts import plot_open_loop
from step08_serve.bench import bench_open_loop
from step08_serve.bench.bench_open_loop import draw_lengths, poisson_arrivals
from step08_serve.launcher import running_server
from tests.test_step08_serve import Served

TINY_WORKLOAD = ["--num-requests", "12", "--prompt-len-range", "8,32", "--output-len-range", "4,12"]
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def evidence(path: Path) -> dict[str, Any]:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text(encoding="utf-8"))


def check_complete_run(run: dict[str, Any], output_lens: list[int]) -> None:
    """Every request answered in full, the counts adding up, and the figures consistent with one another."""
    assert run["requests_sent"] == len(output_lens) == len(run["requests"])
    assert run["completed"] == run["requests_sent"] and run["failed"] == 0 and run["errors"] == {}
    # ignore_eos: each request generated exactly the tokens it asked for, in the order they were drawn.
    assert [r["completion_tokens"] for r in run["requests"]] == output_lens
    assert run["output_tok_per_s"] * run["duration_s"] == pytest.approx(sum(output_lens))
    assert run["completion_tokens_mean"] == pytest.approx(statistics.mean(output_lens))
    for name in LATENCIES:
        stats = run[name]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert all(r["e2e_ms"] >= r["ttft_ms"] > 0 for r in run["requests"])
    assert run["goodput_req_per_s"] <= run["request_throughput"] + 1e-9
    assert 0 <= run["goodput_share"] <= 1


def test_against_this_projects_server(tmp_path: Path) -> None:
    out = tmp_path / "ours.json"
    assert bench_open_loop.main(["--model", "tiny-qwen2", "--device", "cpu", "--request-rates", "4,inf",
                                 *TINY_WORKLOAD, "--output", str(out)]) == 0
    doc = evidence(out)
    assert doc["server"] == "step08_serve/run.py" and doc["label"] == doc["step"]
    assert doc["engine_flags"] == ["--model", "tiny-qwen2", "--device", "cpu"]  # none of the benchmark's own
    assert doc["workload"]["request_rates"] == [4.0, "inf"] and doc["goodput"] == {"ttft_ms": 1000, "tpot_ms": 100}
    output_lens = [n for _, n in draw_lengths(12, (8, 32), (4, 12), seed=0)]
    assert [run["request_rate"] for run in doc["runs"]] == [4.0, "inf"]
    for run in doc["runs"]:
        check_complete_run(run, output_lens)
    at_4, at_inf = doc["runs"]
    # Open loop: each request left at its own arrival time, spread over about 12 / 4 seconds, as scheduled...
    scheduled = poisson_arrivals(12, 4.0, seed=0)
    assert at_4["send_span_s"] == pytest.approx(scheduled[-1], abs=0.3)
    assert 0.3 * 12 / 4 < at_4["send_span_s"] < 3 * 12 / 4
    assert [r["sent_s"] for r in at_4["requests"]] == pytest.approx(scheduled, abs=0.3)
    # ... and at inf all of them at once.
    assert at_inf["send_span_s"] < 0.5
    assert (tmp_path / "ours.png").stat().st_size > 0  # the plot beside the evidence (matplotlib is installed here)


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_the_rate() -> None:
    arrivals = poisson_arrivals(20_000, 8.0, seed=3)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert arrivals[0] == 0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8, rel=0.05)  # exponential: the spread equals the mean
    assert poisson_arrivals(50, 8.0, seed=3) == arrivals[:50]
    assert poisson_arrivals(50, 8.0, seed=4) != arrivals[:50]
    # Every rate draws the same gaps, scaled: the same requests, only closer together.
    assert poisson_arrivals(50, 2.0, seed=3) == pytest.approx([4 * t for t in arrivals[:50]])
    assert poisson_arrivals(5, float("inf"), seed=3) == [0.0] * 5


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[Served, str]]:
    """A running OpenAI-compatible server, answering to another model id than the one the prompts come from."""
    served = Served(load_model("tiny-qwen2"), "peer-model", num_blocks=600)
    with running_server(served.app) as url:
        yield served, url


def test_drives_a_running_server_by_its_url(peer: tuple[Served, str], tmp_path: Path) -> None:
    served, url = peer
    before = served.adds
    out = tmp_path / "peer.json"
    assert bench_open_loop.main(["--base-url", url, "--served-model", "peer-model", "--model", "tiny-qwen2",
                                 "--device", "cpu", "--request-rates", "8,inf", *TINY_WORKLOAD, "--label", "peer",
                                 "--output", str(out)]) == 0
    doc = evidence(out)
    assert doc["server"] == "external" and doc["base_url"] == url and doc["served_model"] == "peer-model"
    assert doc["label"] == "peer" and doc["model"] == "peer-model" and "engine_flags" not in doc
    output_lens = [n for _, n in draw_lengths(12, (8, 32), (4, 12), seed=0)]
    for run in doc["runs"]:
        check_complete_run(run, output_lens)
    assert served.adds - before == bench_open_loop.WARMUP_REQUESTS + 2 * 12  # every request reached that server
    served.assert_idle()


def test_a_failed_request_is_counted_with_its_error(tmp_path: Path) -> None:
    """A 64-token context: the longer prompts are refused (400), the middling ones get fewer tokens than asked."""
    served = Served(load_model("tiny-qwen2"), "short", num_blocks=600, max_model_len=64)
    out = tmp_path / "short.json"
    with running_server(served.app) as url:
        assert bench_open_loop.main(["--base-url", url, "--served-model", "short", "--model", "tiny-qwen2",
                                     "--device", "cpu", "--request-rates", "inf", "--num-requests", "12",
                                     "--prompt-len-range", "20,40", "--output-len-range", "12,12",
                                     "--output", str(out)]) == 0
    (run,) = evidence(out)["runs"]
    assert run["failed"] > 0 and run["completed"] + run["failed"] == run["requests_sent"] == 12
    assert sum(run["errors"].values()) == run["failed"] == sum(r["error"] is not None for r in run["requests"])
    assert any(e.startswith("BadRequestError") for e in run["errors"])
    assert any("tokens where 12 were asked" in e for e in run["errors"])
    assert run["goodput_share"] <= run["completed"] / 12


@pytest.mark.parametrize(("flags", "message"), [
    (["--request-rates", "0"], "--request-rates takes comma-separated numbers above 0"),
    (["--request-rates", "1,-2,inf"], "--request-rates takes"),
    (["--request-rates", "fast"], "--request-rates takes"),
    (["--prompt-len-range", "200,100"], "--prompt-len-range takes MIN,MAX, whole numbers of at least 1 with MIN no"),
    (["--output-len-range", "50"], "--output-len-range takes MIN,MAX"),
    (["--output-len-range", "0,5"], "--output-len-range takes MIN,MAX"),
    (["--goodput-ttft-ms", "0"], "--goodput-ttft-ms must be more than 0"),
    (["--goodput-tpot-ms", "-5"], "--goodput-tpot-ms must be more than 0"),
    (["--num-requests", "0"], "--num-requests must be at least 1"),
    (["--base-url", "http://127.0.0.1:9"], "--base-url needs --served-model"),
    (["--base-url", "127.0.0.1:9", "--served-model", "m"], "--base-url takes http://HOST:PORT"),
    (["--served-model", "m"], "--served-model names the model of a running server: give its --base-url"),
    (["--base-url", "http://127.0.0.1:9", "--served-model", "m", "--step", "step10_prefix_caching",
      "--max-num-seqs=4"], "--max-num-seqs, --step build this project's engine"),
])
def test_bad_flags_are_one_line_before_anything_starts(flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def no_server(argv: list[str]) -> None:
        raise AssertionError(f"a server was started with {argv}")

    monkeypatch.setattr(bench_open_loop, "server_process", no_server)
    assert bench_open_loop.main(["--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_plot_draws_two_files_side_by_side(peer: tuple[Served, str], tmp_path: Path) -> None:
    runs = {}
    for label, rates in (("ours", "4,inf"), ("peer", "8,inf")):
        runs[label] = tmp_path / f"{label}.json"
        assert bench_open_loop.main(["--base-url", peer[1], "--served-model", "peer-model", "--model", "tiny-qwen2",
                                     "--device", "cpu", "--request-rates", rates, "--num-requests", "4",
                                     "--prompt-len-range", "8,16", "--output-len-range", "4,8", "--label", label,
                                     "--output", str(runs[label])]) == 0
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from common.plots.latency import write_plot

    png = tmp_path / "side-by-side.png"
    assert plot_open_loop.main([str(runs["ours"]), str(runs["peer"]), "--output", str(png)]) == 0
    assert imread(png).shape[:2] == (672, 2040)  # three panels, 17 x 5.6 inches at 120 dpi
    # Goodput against different targets would not compare: refused.
    other = evidence(runs["peer"]) | {"goodput": {"ttft_ms": 50.0, "tpot_ms": 100.0}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different goodput targets"):
        write_plot([runs["ours"], tmp_path / "other.json"], tmp_path / "refused.png")


def test_without_ignore_eos_the_field_is_not_sent(peer: tuple[Served, str], tmp_path: Path) -> None:
    """--no-ignore-eos, for a peer that refuses the field: the requests go without it, and the evidence says so."""
    served, url = peer
    add = served.engine.add_request
    seen: list[SamplingParams] = []

    def recording_add(prompt, params, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(params)
        return add(prompt, params, *args, **kwargs)

    served.engine.add_request = recording_add  # type: ignore[method-assign]
    out = tmp_path / "no-ignore-eos.json"
    try:
        assert bench_open_loop.main(["--base-url", url, "--served-model", "peer-model", "--model", "tiny-qwen2",
                                     "--device", "cpu", "--request-rates", "inf", *TINY_WORKLOAD, "--no-ignore-eos",
                                     "--output", str(out)]) == 0
    finally:
        served.engine.add_request = add  # type: ignore[method-assign]
    doc = evidence(out)
    assert doc["workload"]["ignore_eos"] is False and seen and not any(p.ignore_eos for p in seen)
    assert doc["runs"][0]["completed"] + doc["runs"][0]["failed"] == 12
