"""Every results table in the READMEs is exactly what its committed evidence file says."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from scripts.renderers import RENDERERS
from scripts.results_table import refresh, table_for

REPO = Path(__file__).resolve().parent.parent
READMES = sorted(str(p.relative_to(REPO)) for p in [REPO / "README.md", *REPO.glob("step*/README.md")])


@pytest.mark.parametrize("readme", READMES)
def test_readme_tables_match_their_evidence(readme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert refresh(readme, write=False) == [], "regenerate with: python scripts/results_table.py --refresh " + readme


def test_the_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table whose figure was edited by hand is reported."""
    monkeypatch.chdir(REPO)
    text = (REPO / "step01_serial/README.md").read_text(encoding="utf-8")
    tampered = tmp_path / "README.md"
    tampered.write_text(text.replace("| step01_serial | 1 |", "| step01_serial | 1 | 9", 1), encoding="utf-8")
    assert refresh(str(tampered), write=False) != []


GPU = "results/gpu"


def cell(table: list[str], row: int, column: str) -> str:
    """A figure of a rendered table (source line, header, alignment, then rows) by data row and column name."""
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]
    return cells(table[3 + row])[cells(table[1]).index(column)]


def stall_ratio(doc: dict) -> tuple[int, str, str]:
    row = doc["stall"][1]
    return 1, "gap / steady step", f"{row['longest_gap_ms'] / row['steady_step_ms']:.1f}x"


def unchunked_ratio(doc: dict) -> tuple[int, str, str]:
    none, default = doc["stall"]
    return 1, "TTFT / unchunked", f"{default['long_prompt_ttft_ms'] / none['long_prompt_ttft_ms']:.2f}x"


def prefix_computed(doc: dict) -> tuple[int, str, str]:
    cached = next(r for r in doc["runs"] if r["prefix_caching"] and r["scenario"] == "shared")
    return 1, "shared prefix: computed", f"{cached['prompt_tokens_computed']:,}"  # row 1: caching on, after off


def overlap_gain(doc: dict) -> tuple[int, str, str]:
    off, on = doc["rows"][0]["no_overlap"], doc["rows"][0]["overlap"]
    return 0, "gain", f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x"


def swap_bandwidth(doc: dict) -> tuple[int, str, str]:
    row = next(i for i, r in enumerate(doc["runs"]) if r["swapped_blocks"])
    return row, "swap GB/s", f"{doc['runs'][row]['swap_gb_per_s']:.1f}"


def kernel_share_of_copy(doc: dict) -> tuple[int, str, str]:
    return 2, "% of copy", f"{doc['points'][2]['kernel_gbs'] / doc['copy_bandwidth_gbs']:.0%}"


def matmul_cublas(doc: dict) -> tuple[int, str, str]:
    point = doc["shapes"]["o"][0]
    speed = f"{point['cublas_us']:.1f} us, {point['weight_mb'] / point['cublas_us']:.2f} TB/s"
    return 1, f"cuBLAS, {point['rows']} row", speed


def profile_ceiling(doc: dict) -> tuple[int, str, str]:
    point = doc["points"][1]
    ceiling = doc["weight_read_ceiling_ms"]
    return 1, f"of the {ceiling:.2f} ms ceiling", f"{ceiling / point['replay_ms_per_step']:.0%}"


# Per kind, a committed file and one of its figures as the table must show it, computed here from the JSON:
# (kind, file, figure(doc) -> (data row, column, text)).
def breakdown_gaps(d: dict) -> tuple[int, str, str]:
    """The first point's gaps between kernels: the replay less its kernels, and its share of the time above the
    weight read."""
    point = d["points"][0]
    gaps = point["replay_ms_per_step"] - point["kernel_ms_per_step"]
    above = point["replay_ms_per_step"] - min(point["ms_per_step_by_category"]["matrix multiply"],
                                              d["weight_read_ceiling_ms"])
    return 0, "gaps between kernels", f"{gaps:.2f} ms ({gaps / above:.0%})"


def decode_step_ms(doc: dict, rows: int, ms_of: Callable[[dict], float]) -> float:
    """bench_kernels.py: a decode step's multiplies of `rows` rows, every layer's and then the output head's."""
    return sum((1 if p["linear"] == "lm_head" else doc["layers"]) * ms_of(p) for p in doc["matmul"] if p["rows"] == rows)


FIGURES = [
    ("runs", f"{GPU}/nanovllm-step14.json",
     lambda d: (0, "output tok/s", f"{d['runs'][0]['output_tok_per_s']:.1f}")),
    ("pivot", f"{GPU}/decode-batch1-8.json",
     lambda d: (0, d["runs"][0]["system"], f"{d['runs'][0]['output_tok_per_s']:.1f}")),
    ("preempt", "results/gpu/preempt.json", swap_bandwidth),
    ("serve", f"{GPU}/serve-step07.json",
     lambda d: (2, "vs concurrency 1", f"{d['runs'][2]['output_tok_per_s'] / d['runs'][0]['output_tok_per_s']:.2f}x")),
    ("grammar", "results/cpu/grammar.json", lambda d: (0, "constrained greedy: valid",
                                                        f"{d['outputs'][0]['constrained greedy']['valid']:.0%}")),
    ("soak", f"{GPU}/soak.json", lambda d: (len(d["outcomes"]), "count", f"{d['checks']['lost_requests']:,}")),
    ("fp8-accuracy", "results/cpu/fp8-accuracy.json",
     lambda d: (1, "vs float32", f"{d['variants'][1]['perplexity_vs_float32']:.4f}x")),
    ("fp8-decode", f"{GPU}/fp8-decode.json",
     lambda d: (0, "fp8 vs bfloat16", f"{d['fp8_vs_as_loaded']['batch1_in32_out128']:.2f}x")),
    ("fp8-matmul", f"{GPU}/fp8-matmul.json",
     lambda d: (6, "fp8_matmul (ours) us (of copy)", "{us:.1f} ({share_of_copy:.0%})".format(
         **d["shapes"]["gate_up"][0]["results"][3]))),
    ("grammar-decode", "results/cpu/grammar.json", lambda d: (
        1, "half constrained tok/s", f"{d['decode'][1]['every other request constrained']['tok_per_s']:,.1f}")),
    ("open-loop", f"{GPU}/open-loop-step16.json",
     lambda d: (2, "goodput req/s", f"{d['runs'][2]['goodput_req_per_s']:.2f} ({d['runs'][2]['goodput_share']:.0%})")),
    ("burst-serve", f"{GPU}/burst-serve.json",
     lambda d: (1, "TTFT median", f"{d['runs'][1]['ttft_ms_p50'] / 1e3:.1f} s")),
    ("prefix", f"{GPU}/prefix-step10.json", prefix_computed),
    ("stall", f"{GPU}/stall-step09.json", stall_ratio),
    ("stall", f"{GPU}/stall-step14.json", unchunked_ratio),
    ("stall", f"{GPU}/stall-step14.json",
     lambda d: (1, "budget (tokens)", f"default ({d['stall'][1]['budget_tokens']})")),
    ("burst", "results/cpu/stall.json",
     lambda d: (2, "all done in", f"{d['burst'][2]['elapsed_s']:.1f} s")),
    ("burst", f"{GPU}/burst-step07.json",
     lambda d: (0, "answered", f"0 of {d['settings']['burst_requests']}: out of memory")),
    ("kernel-bench", "results/gpu/kernel-paged-decode.json",
     kernel_share_of_copy),
    ("prefill-kernel-bench", "results/gpu/kernel-paged-prefill.json",
     lambda d: (0, f"{d['configs'][0]['q_len']:,} new over {d['configs'][0]['context']:,} cached",
                f"{d['configs'][0]['tflops']:.0f} TFLOP/s")),
    ("matmul-bench", f"{GPU}/kernel-skinny-matmul.json", matmul_cublas),
    ("profile", "results/gpu/decode-profile.json", profile_ceiling),
    ("breakdown", "results/gpu/decode-profile.json", breakdown_gaps),
    ("overlap", "results/gpu/overlap.json", overlap_gain),
    ("host-per-step", "results/cpu/host-per-step.json",
     lambda d: (2, "schedule", f"{d['rows'][2]['ms_per_step']['schedule']:.2f} ms")),
    ("step-profile", f"{GPU}/profile-steps.json",
     lambda d: (9, "syncs", f"{d['rows'][9]['syncs']:.0f}")),
    ("step-phases", f"{GPU}/profile-steps.json",
     lambda d: (0, "forward", f"{d['rows'][0]['host_ms']['forward']:.2f}")),
    ("step-breakdown", f"{GPU}/profile-steps.json",
     lambda d: (10, "host work not hidden", f"{d['rows'][10]['breakdown_ms']['host work not hidden']:.2f}")),
    ("checkpoint-memory", "results/gpu/checkpoint-load-memory-qwen2.5-7b.json",
     lambda d: (0, "peak / weights", f"{d['peak_allocated_bytes'] / d['weight_bytes']:.3f}x")),
    ("speculative", "results/cpu/speculative.json",
     lambda d: (1, "vs off", f"{d['runs'][1]['speedup']:.2f}x")),
    ("oracle", f"{GPU}/speculative-verify-step.json",
     lambda d: (1, "step vs off", f"{d['runs'][1]['ms_per_step'] / d['runs'][0]['ms_per_step']:.2f}x")),
    ("tensor-parallel", "results/cpu/tensor-parallel.json",
     lambda d: (2, "all-reduces per step", f"{d['runs'][2]['all_reduces_per_step']:.0f}")),
    ("invariance-probe", "results/cpu/batch-invariance-probe.json",  # row 0: the library's multiply
     lambda d: (0, "other bits at", ", ".join(n for n, r in d["results"][0]["sizes"].items() if not r["same"]))),
    ("invariance", "results/cpu/batch-invariance.json",
     lambda d: (0, "mode on", f"{d['together']['on']['same']} of {d['together']['on']['requests']}")),
    ("invariance-cost", "results/cpu/batch-invariance.json",
     lambda d: (0, "on / off", f"{next(iter(d['speed']['on_vs_off'].values())):.2f}x")),
    ("invariance-matmul", f"{GPU}/batch-invariance-kernels.json",  # row 0: one row, cuBLAS over a decode step
     lambda d: (0, "cuBLAS, ms", f"{decode_step_ms(d, 1, lambda p: p['cublas_ms']):.2f}")),
    ("invariance-attention", f"{GPU}/batch-invariance-kernels.json",  # row 2: batch 1, 4,096 tokens
     lambda d: (2, "step 15, workers by the batch, us",
                f"{d['attention'][2]['ms']['step 15, workers by the batch'] * 1e3:.1f}")),
    ("kernel-bits", f"{GPU}/kernel-bits-old-new.json",  # row 0: step 06's decode kernel, bf16, one split
     lambda d: (0, f"bits against {d['old_commit'][:10]}", "the same" if d["same_bits"]["bfloat16/decode/1"]
                else "other bits")),
    ("sampling-checks", f"{GPU}/sampling-checks.json",  # row 1: tiny-llama with speculation
     lambda d: (1, "controls as defined",
                f"{sum(v for k, v in d['controls'].items() if k.startswith('tiny-llama') and k.endswith('k=4'))} of 5")),
    ("oracle-sweep", f"{GPU}/speculative-sweep.json",  # row 1: batch 1, k = 4
     lambda d: (1, "a = 0.9", next(f"{r['time_per_token_vs_off']:.2f}x" for r in d["runs"]
                                   if (r["batch"], r["k"], r["acceptance"]) == (1, 4, 0.9)))),
]


@pytest.mark.parametrize("kind, path, figure", FIGURES, ids=[f"{kind}-{Path(path).stem}" for kind, path, _ in FIGURES])
def test_each_kind_shows_its_files_figures(kind: str, path: str, figure, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    table = table_for(path, kind)
    row, column, expected = figure(json.loads(Path(path).read_text(encoding="utf-8")))
    assert cell(table, row, column) == expected


def test_every_kind_has_a_case() -> None:
    assert {kind for kind, _, _ in FIGURES} == {r.kind for r in RENDERERS}


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in REPO.glob("results/**/*.json")))
def test_every_committed_evidence_file_has_a_table(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch by content finds a kind for each file, and its renderer copes with the file's variant."""
    monkeypatch.chdir(REPO)
    table = table_for(path)
    assert table[0].startswith(f"<!-- {path}: commit ") and len(table) >= 3


@pytest.mark.parametrize("path, kind", [
    ("results/cpu/stall.json", "stall"),
    (f"{GPU}/burst-step14.json", "burst"),
    (f"{GPU}/burst-serve.json", "burst-serve"),
    (f"{GPU}/step06-prefill-vs-paged.json", "runs"),
    (f"{GPU}/decode-profile.json", "profile"),
])
def test_a_file_is_shown_as_its_first_kind(path: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert table_for(path) == table_for(path, kind)


def test_unknown_evidence_is_an_error_naming_the_file(tmp_path: Path) -> None:
    unknown = tmp_path / "mystery.json"
    unknown.write_text(json.dumps({"git_commit": "0" * 40, "device": "cpu", "model": "m", "dtype": "float32",
                                   "widgets": [{"size": 1}]}), encoding="utf-8")
    with pytest.raises(ValueError, match="mystery.json: no table for this evidence"):
        table_for(str(unknown))


def test_a_kind_the_file_is_not_is_an_error_naming_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match=r"results/gpu/preempt.json cannot be shown as serve"):
        table_for("results/gpu/preempt.json", "serve")


def test_refresh_regenerates_any_kind_as_the_kind_the_table_is(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale table of a new kind is rewritten; a file shown as its second kind (burst) stays that kind."""
    monkeypatch.chdir(REPO)
    long_prompt = "results/cpu/stall.json"
    stall, burst = table_for(long_prompt, "stall"), table_for(long_prompt, "burst")
    stale_stall = [*stall[:3], stall[3].replace("| 1 |", "| 2 |", 1), *stall[4:]]
    readme = tmp_path / "README.md"
    readme.write_text("\n".join(["# lesson", *stale_stall, "", "text", *burst, "", "end"]), encoding="utf-8")
    assert refresh(str(readme), write=True) == [long_prompt]
    assert readme.read_text(encoding="utf-8") == "\n".join(["# lesson", *stall, "", "text", *burst, "", "end"])
    assert refresh(str(readme), write=False) == []


def test_a_table_can_show_some_records_and_refresh_keeps_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`[a; b]` after the file keeps a table to the named systems; refresh regenerates that part only."""
    monkeypatch.chdir(REPO)
    path = "results/gpu/decode-batch1-8.json"
    table = table_for(path, "pivot", ["step01_serial", "hf-generate"])
    assert table[0].startswith(f"<!-- {path} [step01_serial; hf-generate]: commit ")
    assert table[1] == "| batch | step01_serial | hf-generate |"
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    hf_at_1 = next(r for r in doc["runs"] if r["system"] == "hf-generate" and r["batch"] == 1)
    assert cell(table, 0, "hf-generate") == f"{hf_at_1['output_tok_per_s']:.1f}"
    readme = tmp_path / "README.md"
    readme.write_text("\n".join([table[0], *table[1:3], "| 1 | 0.0 | 0.0 |"]) + "\n", encoding="utf-8")
    assert refresh(str(readme), write=True) == [path]
    assert readme.read_text(encoding="utf-8").split("\n")[:len(table)] == table


def test_a_record_the_file_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match="no system named step99"):
        table_for("results/gpu/decode-batch1-8.json", "pivot", ["step99"])


# ----- every committed evidence file is listed in results/README.md and cited where a learner reads ----------

# Where a file counts as cited: the lessons and the top README, the notebooks (their code or saved output), the
# Python scripts that read it and this file's cases. Not the index itself, not the steps' NOTES.md (history, which
# names removed files through `git show`), not scripts/gpu_suite.sh (which names every file it writes).
CITING = ["README.md", "step*/README.md", "notebooks/*.ipynb", "scripts/*.py", "tests/test_results_tables.py"]


def evidence_files() -> list[str]:
    return sorted(str(p.relative_to(REPO / "results")) for p in (REPO / "results").rglob("*")
                  if p.is_file() and p.name != "README.md")


def test_every_evidence_file_is_in_the_index() -> None:
    index = (REPO / "results" / "README.md").read_text(encoding="utf-8")
    missing = [f for f in evidence_files() if f"`{f}`" not in index and f"`{Path(f).name}`" not in index]
    assert missing == [], f"list these in results/README.md: {missing}"


def test_the_index_lists_only_files_that_are_here() -> None:
    index = (REPO / "results" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`((?:gpu|cpu)/[^`\s]+)`", index))
    gone = sorted(listed - set(evidence_files()))
    assert gone == [], f"results/README.md lists files that are no longer here: {gone}"


def test_lessons_cite_only_files_that_are_here() -> None:
    """A removed file is read through `git show` in a step's NOTES.md, never cited by a lesson or the top README."""
    lessons = [REPO / "README.md", *REPO.glob("step*/README.md")]
    cited = {m for p in lessons for m in re.findall(r"results/((?:gpu|cpu)/[\w.-]+)", p.read_text(encoding="utf-8"))}
    gone = sorted(cited - set(evidence_files()))
    assert gone == [], f"lessons cite files that are not in results/: {gone}"


def test_every_evidence_file_is_cited() -> None:
    texts = [p.read_text(encoding="utf-8") for pattern in CITING for p in REPO.glob(pattern)]
    uncited = [f for f in evidence_files() if not any(Path(f).name in text for text in texts)]
    assert uncited == [], f"nothing cites these; cite them or delete them (git history keeps them): {uncited}"
