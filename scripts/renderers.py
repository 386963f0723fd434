"""The markdown table of each kind of benchmark evidence, and how to tell the kinds apart.

Each `render_<kind>(path, doc)` returns a table's lines (header, alignment, rows); every figure in it is read from
`doc` or computed from its figures (ratios too). `RENDERERS` lists, in order, which kinds a document can be shown
as; scripts/results_table.py puts the table under its source line and keeps the READMEs' tables fresh. The tables
of compare.py's and run.py --bench's runs are `common/tables.py`'s, which the notebooks print too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.tables import Doc, markdown, render_pivot, render_runs
from scripts.decode_breakdown import breakdown_table


def first(doc: Doc, key: str) -> Doc:
    """The first record of the document's list `key`, or {} where it has none: what a kind's test looks at."""
    records = doc.get(key)
    return records[0] if isinstance(records, list) and records and isinstance(records[0], dict) else {}


def first_point(doc: Doc) -> Doc:
    """The first point of the first shape of a matrix-multiply benchmark's `shapes`, or {}."""
    shapes = doc.get("shapes")
    points = next(iter(shapes.values()), []) if isinstance(shapes, dict) else []
    return points[0] if points else {}


def span(values: list[float], unit: str) -> str:
    """The shortest and the longest of some times: "11.0 to 29.5 ms", or one figure where they are the same."""
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return f"{low} {unit}" if low == high else f"{low} to {high} {unit}"


# step 07 to step 10's benchmarks


def render_preempt(path: str, doc: Doc) -> list[str]:
    """step07_preemption/bench/bench_preempt.py: per KV budget and preemption mode, the throughput and what preemption
    cost."""
    rows = [[f"{r['budget']} ({r['num_blocks']} blocks)", r["preempt"], f"{r['output_tok_per_s']:.1f}",
             str(r["preemptions"]), str(r["swapped_blocks"]),
             f"{r['swap_gb_per_s']:.1f}" if r["swapped_blocks"] else "-"] for r in doc["runs"]]
    return markdown(["budget", "preempt", "output tok/s", "preemptions", "blocks swapped out", "swap GB/s"], rows,
                    text_columns=2)


def render_serve(path: str, doc: Doc) -> list[str]:
    """step08_serve/bench/bench_serve.py: per concurrency, the server through the SDK against the first concurrency
    measured and against the bare engine given the same requests."""
    runs = doc["runs"]
    base = runs[0]
    rows = [[str(r["concurrency"]), f"{r['output_tok_per_s']:.1f}",
             f"{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x",
             f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}", f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}",
             f"{r['direct_engine_tok_per_s']:.1f}", f"{r['output_tok_per_s'] / r['direct_engine_tok_per_s']:.2f}"]
            for r in runs]
    header = ["concurrency", "output tok/s", f"vs concurrency {base['concurrency']}", "TTFT p50 / p99 ms",
              "TPOT p50 / p99 ms", "bare engine tok/s", "server / engine"]
    return markdown(header, rows, text_columns=0)


def render_open_loop(path: str, doc: Doc) -> list[str]:
    """step08_serve/bench/bench_open_loop.py: per offered rate, the requests completed a second, TTFT and TPOT at p50
    and p99, and goodput (the requests within both targets, a second and as a share)."""
    def p50_p99(stats: Doc | None, digits: int) -> str:
        return "-" if stats is None else f"{stats['p50']:,.{digits}f} / {stats['p99']:,.{digits}f}"

    rows = [["all at once" if r["request_rate"] == "inf" else f"{r['request_rate']:g}", f"{r['request_throughput']:.2f}",
             p50_p99(r["ttft_ms"], 0), p50_p99(r["tpot_ms"], 1),
             f"{r['goodput_req_per_s']:.2f} ({r['goodput_share']:.0%})", str(r["failed"])] for r in doc["runs"]]
    return markdown(["offered req/s", "completed req/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "goodput req/s",
                     "failed"], rows, text_columns=1)


def render_soak(path: str, doc: Doc) -> list[str]:
    """step08_serve/bench/soak.py: each kind of request sent over the run and how it ended, then the checks (none
    lost, the KV pool back to empty, resident memory against its warm value)."""
    rows = [[outcome, f"{count:,}"] for outcome, count in sorted(doc["outcomes"].items())]
    checks = doc["checks"]
    rows += [["lost", f"{checks['lost_requests']:,}"], ["KV blocks used after", f"{checks['kv_blocks_used_after']:.0f}"],
             ["resident memory after vs warm", f"{checks['rss_after_vs_warm']:.3f}x"]]
    return markdown(["requests, by kind and outcome", "count"], rows, text_columns=1)


def render_grammar(path: str, doc: Doc) -> list[str]:
    """step16_structured_output/bench/bench_grammar.py: per schema, the share of outputs that parse as JSON and that
    validate against the schema, unconstrained and under the grammar (greedy and sampled)."""
    def share(row: Doc, way: str, what: str) -> str:
        return f"{row[way][what]:.0%}"

    rows = [[r["schema"], str(r["prompts"]), share(r, "unconstrained", "parse"), share(r, "unconstrained", "valid"),
             share(r, "constrained greedy", "valid"), share(r, "constrained sampled", "valid")] for r in doc["outputs"]]
    return markdown(["schema", "prompts", "unconstrained: parses", "unconstrained: valid", "constrained greedy: valid",
                     "constrained sampled: valid"], rows, text_columns=1)


def render_grammar_decode(path: str, doc: Doc) -> list[str]:
    """bench_grammar.py's decode cost: per batch, output tok/s free, with every request constrained and with every
    other one, and each against free (the free requests beside constrained ones decode at the batch's pace)."""
    def way(row: Doc, name: str) -> list[str]:
        if name not in row:
            return ["-", "-"]
        return [f"{row[name]['tok_per_s']:,.1f}", f"{row[name]['vs_free']:.2f}x"]

    rows = [[str(r["batch"]), f"{r['free']['tok_per_s']:,.1f}", *way(r, "every request constrained"),
             *way(r, "every other request constrained")] for r in doc["decode"]]
    return markdown(["batch", "free tok/s", "all constrained tok/s", "vs free", "half constrained tok/s", "vs free"],
                    rows, text_columns=1)


def render_fp8_accuracy(path: str, doc: Doc) -> list[str]:
    """step17_fp8_weights/bench/bench_accuracy.py: per variant (float32, FP8 with a scale per row, with one per
    tensor), the weights' size, the text's perplexity and against float32, greedy agreement with float32 (the share
    of positions with the same token, and the tokens agreed before the first difference), the last layer's error."""
    def against(row: Doc, key: str, text: str) -> str:
        return "-" if key not in row else text.format(row[key])

    rows = [[r["variant"], f"{r['weight_bytes'] / 2**20:,.0f}", f"{r['perplexity']:.3f}",
             against(r, "perplexity_vs_float32", "{:.4f}x"), against(r, "same_token_share", "{:.0%}"),
             against(r, "agreed_prefix_mean", "{:.1f}"),
             "-" if "layer_relative_error" not in r else f"{r['layer_relative_error'][-1]:.1%}"] for r in doc["variants"]]
    return markdown(["weights", "MiB", "perplexity", "vs float32", "same token as float32", "tokens agreed",
                     "last layer's error"], rows, text_columns=1)


def render_fp8_decode(path: str, doc: Doc) -> list[str]:
    """step17_fp8_weights/bench/bench_fp8.py: per workload, output tok/s with the weights as loaded and with FP8
    projections, in one process, and FP8 as a ratio of as loaded."""
    loaded, fp8 = doc["tok_per_s"]["as loaded"], doc["tok_per_s"]["fp8"]
    rows = [[name, f"{loaded[name]:,.1f}", f"{fp8[name]:,.1f}", f"{fp8[name] / loaded[name]:.2f}x"] for name in fp8]
    return markdown(["workload", f"{doc['dtype'].removeprefix('torch.')} tok/s", "fp8 tok/s", "fp8 vs "
                     f"{doc['dtype'].removeprefix('torch.')}"], rows, text_columns=1)


def render_fp8_matmul(path: str, doc: Doc) -> list[str]:
    """step17_fp8_weights/bench/bench_fp8_matmul.py: per projection shape and row count, microseconds and the share of
    the copy bandwidth the weight's bytes were read at, for bf16 F.linear, cuBLAS's FP8 (one scale per tensor, one
    per row), our kernel at its default settings and at the best of the grid timed (where the file has one)."""
    kernels = ["bf16 F.linear", "_scaled_mm per tensor", "_scaled_mm per row", "fp8_matmul (ours)",
               "fp8_matmul best of grid"]
    rows = []
    for name, points in doc["shapes"].items():
        for point in points:
            by_kernel = {r["kernel"]: r for r in point["results"]}
            rows.append([name, f"{point['n']} x {point['k']}", str(point["rows"]),
                         *(f"{by_kernel[k]['us']:.1f} ({by_kernel[k]['share_of_copy']:.0%})" if k in by_kernel else "-"
                           for k in kernels)])
    return markdown(["projection", "n x k", "rows", *(f"{k} us (of copy)" for k in kernels)], rows, text_columns=3)


def budget_label(row: Doc) -> str:
    """A budget as bench_long_prompt.py names it, with the number the engine chose for "default"."""
    if row["budget"] == "default" and row.get("budget_tokens"):
        return f"default ({row['budget_tokens']})"
    return row["budget"]


def out_of_memory(row: Doc) -> str:
    # bench_long_prompt.py catches only torch.OutOfMemoryError: while building the engine, or while running.
    return "out of memory at start-up" if row["error"].startswith("at start-up") else "out of memory"


def render_stall(path: str, doc: Doc) -> list[str]:
    """step09_chunked_prefill/bench/bench_long_prompt.py's stall: decoders decoding when one long prompt arrives. Per
    budget: the steps until its first token, how long they took, the decoders' longest wait between two tokens
    against their steady step, and the prompt's time to first token (against no budget, where the file has it)."""
    rows = doc["stall"]
    unchunked = next((r["long_prompt_ttft_ms"] for r in rows if r["budget"] == "none" and "error" not in r), None)
    against_unchunked = unchunked is not None and len(rows) > 1
    header = ["budget (tokens)", "steps to first token", "a step, shortest to longest", "steady step", "longest gap",
              "gap / steady step", "long prompt's TTFT", *(["TTFT / unchunked"] if against_unchunked else [])]
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([budget_label(r), out_of_memory(r), *["-"] * (len(header) - 2)])
            continue
        lines.append([budget_label(r), str(r["steps_until_first_token"]),
                      span(r["step_ms"], "ms") if "step_ms" in r else "-",  # files before it was recorded
                      f"{r['steady_step_ms']:.1f} ms", f"{r['longest_gap_ms']:.1f} ms",
                      f"{r['longest_gap_ms'] / r['steady_step_ms']:.1f}x", f"{r['long_prompt_ttft_ms']:.0f} ms",
                      *([f"{r['long_prompt_ttft_ms'] / unchunked:.2f}x"] if against_unchunked else [])])
    return markdown(header, lines)


def render_burst(path: str, doc: Doc) -> list[str]:
    """step09_chunked_prefill/bench/bench_long_prompt.py's burst: many long prompts at once on the bare engine. Per
    budget: whether every request was answered (or the engine ran out of memory), how fast, and what it left."""
    requests = doc["settings"]["burst_requests"]
    header = ["budget (tokens)", "answered", "all done in", "TTFT median", "TTFT longest", "output tok/s",
              "KV blocks in use after"]
    lines = []
    for r in doc["burst"]:
        if not r["survived"]:
            lines.append([budget_label(r), f"0 of {requests}: {out_of_memory(r)}", *["-"] * (len(header) - 2)])
            continue
        lines.append([budget_label(r), f"{requests} of {requests}", f"{r['elapsed_s']:.1f} s",
                      f"{r['ttft_ms_p50'] / 1e3:.1f} s", f"{r['ttft_ms_max'] / 1e3:.1f} s",
                      f"{r['output_tok_per_s']:.1f}", str(r["blocks_in_use_after"])])
    return markdown(header, lines)


def render_burst_serve(path: str, doc: Doc) -> list[str]:
    """step09_chunked_prefill/bench/bench_burst_serve.py: per burst of chat requests through the server, how many were
    answered, how fast, and the server's state after it (/health, and /metrics' running, waiting, blocks used)."""
    rows = [[f"{r['requests']:,}", f"{r['prompt_tokens_mean']:,.0f}", f"{r['answered']:,} of {r['requests']:,}",
             f"{r['elapsed_s']:.1f} s", f"{r['ttft_ms_p50'] / 1e3:.1f} s", f"{r['ttft_ms_p99'] / 1e3:.1f} s",
             f"{r['ttft_ms_max'] / 1e3:.1f} s", str(r["health_status"]),
             f"{r['llm_requests_running']:.0f} / {r['llm_requests_waiting']:.0f} / {r['llm_kv_blocks_used']:.0f}"]
            for r in doc["runs"]]
    header = ["requests at once", "prompt tokens (mean)", "answered", "all done in", "TTFT median", "TTFT p99",
              "TTFT longest", "/health after", "running / waiting / KV blocks after"]
    return markdown(header, rows, text_columns=0)


# step10_prefix_caching/bench/bench_prefix.py's scenarios: their columns, and each column's figure of a run.
PREFIX_SCENARIOS: dict[str, list[tuple[str, Callable[[Doc], str]]]] = {
    "shared": [("shared prefix: prompt tokens sent", lambda r: f"{r['prompt_tokens_sent']:,}"),
               ("shared prefix: computed", lambda r: f"{r['prompt_tokens_computed']:,}"),
               ("shared prefix: TTFT median / longest",
                lambda r: f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_max']:.0f} ms"),
               ("shared prefix: all done", lambda r: f"{r['elapsed_s']:.2f} s")],
    "chat": [("chat: prompt tokens sent", lambda r: f"{r['prompt_tokens_sent']:,}"),
             ("chat: computed", lambda r: f"{r['prompt_tokens_computed']:,}"),
             ("chat: hit rate", lambda r: f"{r['hit_rate']:.0%}"),
             ("chat: output tok/s", lambda r: f"{r['output_tok_per_s']:.1f}")],
}


def render_prefix(path: str, doc: Doc) -> list[str]:
    """step10_prefix_caching/bench/bench_prefix.py: caching off, then on, on each scenario the file holds (prompts
    sharing a prefix; multi-turn chat): the prompt tokens sent and computed, and what that bought."""
    run = {(r["prefix_caching"], r["scenario"]): r for r in doc["runs"]}
    scenarios = list(dict.fromkeys(r["scenario"] for r in doc["runs"]))
    columns = [(scenario, name, figure) for scenario in scenarios for name, figure in PREFIX_SCENARIOS[scenario]]
    rows = [["on" if caching else "off",
             *(figure(run[(caching, s)]) if (caching, s) in run else "-" for s, _, figure in columns)]
            for caching in sorted({r["prefix_caching"] for r in doc["runs"]})]  # off first: the baseline
    return markdown(["prefix caching", *(name for _, name, _ in columns)], rows)


# step 06, step 13 and step 14's kernel and step benchmarks


def render_kernel_bench(path: str, doc: Doc) -> list[str]:
    """step06_paged_attention/bench/kernel_bench.py (`run.py --kernel-bench`): the decode kernel per batch and context,
    checked then timed, against the device's copy bandwidth and dense SDPA on the same K/V."""
    header = ["batch x context", "K/V read", "splits", "GPU time", "our kernel", "% of copy", "dense SDPA",
              "kernel / SDPA"]
    lines = []
    for p in doc["points"]:
        if not p["correct"]:
            lines.append([f"{p['batch']} x {p['context']}", "-", str(p["splits"]),
                          f"wrong: max abs error {p['max_abs_error']:.3g}", *["-"] * (len(header) - 4)])
            continue
        lines.append([f"{p['batch']} x {p['context']}", f"{p['kv_megabytes']:.1f} MB", str(p["splits"]),
                      f"{p['kernel_ms'] * 1e3:.1f} µs", f"{p['kernel_gbs']:.0f} GB/s",
                      f"{p['kernel_gbs'] / doc['copy_bandwidth_gbs']:.0%}", f"{p['sdpa_dense_gbs']:.0f} GB/s",
                      f"{p['kernel_gbs'] / p['sdpa_dense_gbs']:.2f}x"])
    return markdown(header, lines)


def render_prefill_kernel_bench(path: str, doc: Doc) -> list[str]:
    """step06_paged_attention/bench/prefill_kernel_bench.py: the paged prefill kernel's useful TFLOP/s, one row per
    launch (query rows and keys a program, warps, stages), one column per chunk of new tokens over a cached prefix."""
    def point(config: Doc) -> tuple[int, int]:
        return config["q_len"], config["context"]

    def launch(config: Doc) -> tuple[int, int, int, int]:
        return config["block_m"], config["tile"], config["num_warps"], config["num_stages"]

    configs = doc["configs"]
    points, launches = list(dict.fromkeys(map(point, configs))), list(dict.fromkeys(map(launch, configs)))
    measured = {(point(c), launch(c)): c for c in configs}

    def figure(config: Doc | None) -> str:
        if config is None:
            return "-"
        return "fails its check" if "error" in config else f"{config['tflops']:.0f} TFLOP/s"

    rows = [[f"{m} x {t}, {w} warps, {s} stages", *(figure(measured.get((p, (m, t, w, s)))) for p in points)]
            for m, t, w, s in launches]
    header = ["query rows x keys a program", *(f"{q:,} new over {context:,} cached" for q, context in points)]
    return markdown(header, rows)


PROJECTION_NAMES = {"qkv": "q/k/v", "gate_up": "gate/up", "lm_head": "output head"}  # matmul_bench.py's, as said
ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


def render_matmul_bench(path: str, doc: Doc) -> list[str]:
    """step13_fused_decode/bench/matmul_bench.py: per projection and number of rows, cuBLAS against the skinny multiply
    with the settings the engine launches (`skinny_config`'s), as time per call and the weight's bytes per second."""
    # Imported here: it loads torch and Triton, which no other table needs. Its defaults are the H200's, the
    # device of these files.
    from step13_fused_decode.skinny_matmul import skinny_config

    def speed(us: float, megabytes: float) -> str:
        return f"{us:.1f} us, {megabytes / us:.2f} TB/s"

    header = ["projection", "weight", "MB",
              *(f"{system}, {n} row{'s' if n > 1 else ''}" for n in doc["rows"] for system in ("cuBLAS", "skinny"))]
    lines = []
    for name, points in doc["shapes"].items():
        shape = points[0]
        launched = vars(skinny_config(shape["n"], ELEMENT_SIZES[doc["dtype"]]))
        cells = [PROJECTION_NAMES.get(name, name), f"{shape['n']} x {shape['k']}", f"{shape['weight_mb']:.1f}"]
        for p in points:
            timed = next((s["ms"] for s in p["settings"] if s["config"] == launched and s["ms"] is not None), None)
            cells += [speed(p["cublas_us"], p["weight_mb"]),
                      "not timed" if timed is None else speed(timed * 1e3, p["weight_mb"])]
        lines.append(cells)
    return markdown(header, lines, text_columns=2)


def render_profile(path: str, doc: Doc) -> list[str]:
    """step13_fused_decode/bench/profile_step.py: per batch and variant, a replayed decode step, its kernels and their
    GPU time by category, and the time to read the weights once at the copy bandwidth as a share of the step."""
    points = doc["points"]
    categories = list(dict.fromkeys(c for p in points for c in p["ms_per_step_by_category"]))
    ceiling = doc["weight_read_ceiling_ms"]
    rows = [[str(p["batch"]), p["variant"], f"{p['replay_ms_per_step']:.3f} ms", f"{p['kernels_per_step']:.0f}",
             *(f"{p['ms_per_step_by_category'].get(c, 0.0):.3f} ms" for c in categories),
             f"{ceiling / p['replay_ms_per_step']:.0%}"] for p in points]
    header = ["batch", "variant", "replayed step", "kernels", *categories, f"of the {ceiling:.2f} ms ceiling"]
    return markdown(header, rows, text_columns=2)


def render_overlap(path: str, doc: Doc) -> list[str]:
    """step14_overlap_scheduling/bench/bench_overlap.py: per batch, a decode step's parts without and with overlap
    (ms per step)."""
    rows = []
    for row in doc["rows"]:
        off, on, gpu = row["no_overlap"], row["overlap"], row["gpu_ms"]
        rows.append([str(row["batch"]), "-" if gpu is None else f"{gpu:.2f}", f"{off['host_ms']:.2f}",
                     f"{off['step_ms']:.2f}", f"{on['step_ms']:.2f}", f"{off['tokens_per_s']:.1f}",
                     f"{on['tokens_per_s']:.1f}", f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x"])
    header = ["batch", "GPU (replay alone)", "host", "step, no overlap", "step, overlap", "decode tok/s, no overlap",
              "decode tok/s, overlap", "gain"]
    return markdown(header, rows, text_columns=0)


def render_host_per_step(path: str, doc: Doc) -> list[str]:
    """step14_overlap_scheduling/bench/bench_host.py: per batch, a decode step's time by phase (the host's and the
    model's)."""
    phases = list(dict.fromkeys(phase for row in doc["rows"] for phase in row["ms_per_step"]))
    rows = [[str(row["batch"]), *(f"{row['ms_per_step'][phase]:.2f} ms" for phase in phases)] for row in doc["rows"]]
    return markdown(["batch", *phases], rows, text_columns=0)


def render_checkpoint_memory(path: str, doc: Doc) -> list[str]:
    """scripts/check_checkpoint_memory.py: the peak memory of loading a checkpoint against its weights' size."""
    weights, peak = doc["weight_bytes"], doc["peak_allocated_bytes"]
    return markdown(["check", "weights", "peak allocated", "peak / weights"],
                    [[doc["check"], f"{weights / 1e9:.2f} GB", f"{peak / 1e9:.2f} GB", f"{peak / weights:.3f}x"]])


def render_speculative(path: str, doc: Doc) -> list[str]:
    """step11_speculative_decoding/bench/bench_speculative.py: per workload and k (0: speculation off), under the rule
    or with every proposal checked, the proposals kept, tokens per verification row, speed and sameness."""
    rows = []
    for run in doc["runs"]:
        k = run["speculative_tokens"]
        checked = "off" if k == 0 else ("every proposal" if run["token_cost"] == 0 else "the rule's")
        kept = "-" if not run["proposed"] else f"{run['accepted']:,} of {run['proposed']:,} ({run['acceptance_rate']:.0%})"
        per_row = "-" if run["tokens_per_verify_row"] is None else f"{run['tokens_per_verify_row']:.2f}"
        rows.append([run["workload"], str(k), checked, kept, per_row, f"{run['output_tok_per_s']:.1f}",
                     f"{run['speedup']:.2f}x", "yes" if run["identical_to_off"] else "NO"])
    header = ["prompts", "k", "proposals checked", "kept", "tokens per verification", "output tok/s", "vs off",
              "same tokens"]
    return markdown(header, rows, text_columns=3)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification row of k proposals emits when each is kept with chance a: 1 + a + ... + a^k."""
    return sum(a**j for j in range(k + 1))


def replays(run: dict) -> str:
    """Whether the oracle replayed the run's own tokens (its a exact), and after how many runs; older files lack it."""
    if "oracle_exact" not in run:
        return "-"
    return f"{'yes' if run['oracle_exact'] else 'NO'}, run {run['rounds']}"


def render_oracle(path: str, doc: Doc) -> list[str]:
    """step11_speculative_decoding/bench/bench_oracle.py: per batch, k and the oracle's acceptance (k 0: speculation
    off), a step's time against a decode step's, tokens per verification row as measured and as expected,
    E = 1 + a + ... + a^k, time per output token as measured and as expected (the step's cost over E), whether the
    tokens are speculation off's, and whether the oracle's tokens were the run's own (so its a held)."""
    rows, off_ms = [], 0.0
    for run in doc["runs"]:
        k, a = run["k"], run["acceptance"]
        if k == 0:
            off_ms = run["ms_per_step"]
            rows.append([str(run["batch"]), "0", "-", f"{off_ms:.2f} ms", "1.00x", "-", "-", "1.00x", "-", "-", "-"])
            continue
        step = run["ms_per_step"] / off_ms
        rows.append([str(run["batch"]), str(k), f"{a:g}", f"{run['ms_per_step']:.2f} ms", f"{step:.2f}x",
                     f"{run['tokens_per_verify_row']:.2f}", f"{expected_tokens(a, k):.2f}",
                     f"{run['time_per_token_vs_off']:.2f}x", f"{step / expected_tokens(a, k):.2f}x",
                     "yes" if run["identical_to_off"] else "no", replays(run)])
    header = ["batch", "k", "oracle's a", "step", "step vs off", "tokens per verification", "expected (E)",
              "time per token vs off", "expected (step / E)", "same tokens as off", "oracle exact"]
    return markdown(header, rows, text_columns=0)


def render_oracle_sweep(path: str, doc: Doc) -> list[str]:
    """bench_oracle.py as a grid: per batch and k, the time per output token against speculation off at each of
    the oracle's acceptances (a * where the oracle's tokens were not the run's own, so its a did not quite hold)."""
    acceptances = sorted({r["acceptance"] for r in doc["runs"] if r["k"]})
    cells: dict[tuple[int, int], dict[float, str]] = {}
    for run in doc["runs"]:
        if run["k"]:
            mark = "" if run.get("oracle_exact", True) else " *"
            cells.setdefault((run["batch"], run["k"]), {})[run["acceptance"]] = (
                f"{run['time_per_token_vs_off']:.2f}x{mark}")
    rows = [[str(batch), str(k), *(by_a.get(a, "-") for a in acceptances)] for (batch, k), by_a in cells.items()]
    return markdown(["batch", "k", *(f"a = {a:g}" for a in acceptances)], rows, text_columns=0)


def render_tensor_parallel(path: str, doc: Doc) -> list[str]:
    """step04_multi_gpu/bench/bench_tensor_parallel.py: per size and batch, a decode step's time, the time per output
    token against one process, and rank 0's all-reduces per step (count, bytes each, host time inside them)."""
    rows = [[str(r["tensor_parallel_size"]), str(r["batch"]), f"{r['ms_per_step']:.2f} ms",
             f"{r['time_per_token_vs_one']:.2f}x", f"{r['all_reduces_per_step']:.0f}",
             f"{r['bytes_per_all_reduce'] / 1024:.1f} KiB" if r["all_reduces_per_step"] else "-",
             f"{r['host_ms_in_all_reduce_per_step']:.2f} ms" if r["all_reduces_per_step"] else "-"]
            for r in doc["runs"]]
    header = ["ranks", "batch", "step", "time per token vs one", "all-reduces per step", "each",
              "in all-reduces, per step"]
    return markdown(header, rows, text_columns=0)


def step_label(row: Doc) -> str:
    """A step 05 row's name, short: "06 paged_attention", "06 --sync-per-layer"."""
    name = row["variant"]
    return name[4:6] + " " + name[7:] if name.startswith("step") and name[4:6].isdigit() and name[6] == "_" else name


def render_step_profile(path: str, doc: Doc) -> list[str]:
    """step05_profiling/run.py: per step, a decode step's time without and with the profiler, what it launched,
    how often the host waited for the device, the device's idle time, and the weight read's share of the step."""
    on_gpu = any(r["kernels"] for r in doc["rows"])  # a CPU runs no kernels: it has no idle time to show
    rows = [[step_label(r), f"{r['step_ms_unprofiled']:.2f} ms", f"{r['step_ms']:.2f} ms", f"{r['launches']:.0f}",
             f"{r['kernels']:.0f}", f"{r['syncs']:.0f}",
             f"{r['step_ms'] - r['gpu_busy_ms']:.2f} ms" if on_gpu else "-",
             f"{r['weight_read_ms'] / r['step_ms_unprofiled']:.0%}"] for r in doc["rows"]]
    header = ["step", "step, no profiler", "step, profiled", "launches", "kernels", "syncs", "GPU idle",
              "weight read / step"]
    return markdown(header, rows)


def render_step_phases(path: str, doc: Doc) -> list[str]:
    """step05_profiling/run.py: per step, the host's own time in each phase of a profiled decode step, and the
    time the device was busy (kernels that overlap counted once)."""
    phases = list(doc["rows"][0]["host_ms"])
    rows = [[step_label(r), *(f"{r['host_ms'][p]:.2f}" for p in phases), f"{r['gpu_busy_ms']:.2f}"]
            for r in doc["rows"]]
    return markdown(["step (ms)", *phases, "GPU busy"], rows)


def render_step_breakdown(path: str, doc: Doc) -> list[str]:
    """step05_profiling/run.py: per step, where a profiled decode step's time went, the parts adding up to it."""
    parts = list(doc["rows"][0]["breakdown_ms"])
    rows = [[step_label(r), *(f"{r['breakdown_ms'][p]:.2f}" for p in parts), f"{r['step_ms']:.2f}"]
            for r in doc["rows"]]
    return markdown(["step (ms)", *parts, "step, profiled"], rows)


def render_invariance_probe(path: str, doc: Doc) -> list[str]:
    """step15_batch_invariant/bench/probe.py: per op and version, the call sizes at which the probed row came out with
    other bits than alone, and by how much at most."""
    rows = []
    for r in doc["results"]:
        differ = [size for size, v in r["sizes"].items() if not v["same"]]
        largest = max(v["max_abs_diff"] for v in r["sizes"].values())
        rows.append([r["op"], r["as_in"], ", ".join(r["sizes"]), ", ".join(differ) or "none",
                     f"{largest:.1e}" if largest else "0"])
    return markdown(["op", "as in", "sizes tried", "other bits at", "largest difference"], rows, text_columns=4)


def render_kernel_bits(path: str, doc: Doc) -> list[str]:
    """scripts/kernel_bits.py: each attention kernel's output, launched each way, against the older tree's."""
    rows = [[output, "the same" if same else "other bits"] for output, same in doc["same_bits"].items()]
    return markdown(["kernel output (dtype/kernel/launch)", f"bits against {doc['old_commit'][:10]}"], rows,
                    text_columns=2)


INVARIANCE_PARTS = {"together": "together, then one at a time: same tokens",
                    "server": "through the server, together, then one at a time: same text",
                    "speculation": "speculation on and off: same tokens"}


def render_invariance(path: str, doc: Doc) -> list[str]:
    """step15_batch_invariant/bench/bench_invariance.py: per comparison, how many requests came back the same, with
    the mode off and on."""
    rows = [[INVARIANCE_PARTS[part], *(f"{doc[part][m]['same']} of {doc[part][m]['requests']}" for m in ("off", "on"))]
            for part in INVARIANCE_PARTS if part in doc]
    return markdown(["requests", "mode off", "mode on"], rows)


def render_invariance_cost(path: str, doc: Doc) -> list[str]:
    """bench_invariance.py's speed parts: per workload, output tok/s with the mode off and on, and on / off."""
    speed = doc["speed"]
    rows = [[name, f"{off:.1f}", f"{speed['on'][name]:.1f}", f"{speed['on_vs_off'][name]:.2f}x"]
            for name, off in speed["off"].items()]
    return markdown(["workload", "tok/s, off", "tok/s, on", "on / off"], rows)


def render_invariance_matmul(path: str, doc: Doc) -> list[str]:
    """step15_batch_invariant/bench/bench_kernels.py's matmul part: per row count, a decode step's multiplies (every
    layer's, then the output head) by cuBLAS and by ours in the engine's tiles, and how many tiles of the sweep
    gave the bits of the engine's tile and of the row alone."""
    rows = []
    for count in dict.fromkeys(p["rows"] for p in doc["matmul"]):
        points = [p for p in doc["matmul"] if p["rows"] == count]
        weight = {p["linear"]: 1 if p["linear"] == "lm_head" else doc["layers"] for p in points}
        cublas = sum(weight[p["linear"]] * p["cublas_ms"] for p in points)
        ours = sum(weight[p["linear"]] * p["tiles"][p["engine_tile"]]["ms"] for p in points)
        tiles = [t for p in points for t in p["tiles"].values()]
        same = sum(t["same_as_engine_tile"] and t["row_same_as_alone"] for t in tiles)
        rows.append([str(count), f"{same} of {len(tiles)}", f"{cublas:.2f}", f"{ours:.2f}", f"{ours / cublas:.2f}x"])
    return markdown(["rows", "tiles with the same bits", "cuBLAS, ms", "ours, ms", "ours / cuBLAS"], rows,
                    text_columns=2)


def render_invariance_attention(path: str, doc: Doc) -> list[str]:
    """bench_kernels.py's attention part: one layer's decode attention, microseconds per call, three ways."""
    names = list(doc["attention"][0]["ms"])
    rows = [[str(p["batch"]), str(p["context"]), str(p["step15_workers"]),
             *(f"{p['ms'][n] * 1e3:.1f}" for n in names), "yes" if p["same_bits_as_prefill_rows"] else "no"]
            for p in doc["attention"]]
    return markdown(["batch", "context", "workers", *(f"{n}, us" for n in names), "step 15 = prefill bits"], rows,
                    text_columns=2)


def render_sampling_checks(path: str, doc: Doc) -> list[str]:
    """scripts/gpu_sampling_checks.py: per model and speculation setting, the controls that gave their definition's
    tokens, and the worst log-probability difference from HF's, of generated and of prompt tokens."""
    rows = []
    for key, logprobs in doc["logprobs"].items():
        model, k = key.split()
        controls = [ok for name, ok in doc["controls"].items() if name.split()[0] == model and name.endswith(k)]
        prompt = doc["prompt_logprobs"][key]
        rows.append([model, k.removeprefix("k="), f"{sum(controls)} of {len(controls)}",
                     f"{logprobs['max_abs_diff']:.1e}", "yes" if logprobs["top_ids_same"] else "no",
                     f"{prompt['max_abs_diff']:.1e}", "yes" if prompt["top_ids_same"] else "no"])
    return markdown(["model", "speculative tokens", "controls as defined", "logprobs vs HF", "same top",
                     "prompt logprobs vs HF", "same top"], rows, text_columns=2)


@dataclass(frozen=True)
class Renderer:
    kind: str
    holds: Callable[[Doc], bool]  # whether a document can be shown as this kind: its distinctive keys
    render: Callable[[str, Doc], list[str]]


# In order: a document is shown as the first kind that holds it, unless another one is asked for (by name, or by
# a README table's header).
RENDERERS = (
    Renderer("runs", lambda doc: "system" in first(doc, "runs"), render_runs),
    Renderer("pivot", lambda doc: "system" in first(doc, "runs"), render_pivot),
    Renderer("preempt", lambda doc: "preempt" in first(doc, "runs"), render_preempt),
    Renderer("serve", lambda doc: "concurrency" in first(doc, "runs"), render_serve),
    Renderer("burst-serve", lambda doc: "burst" in first(doc, "runs"), render_burst_serve),
    Renderer("open-loop", lambda doc: "goodput_req_per_s" in first(doc, "runs"), render_open_loop),
    Renderer("soak", lambda doc: "rss_after_vs_warm" in doc.get("checks", {}), render_soak),
    Renderer("grammar", lambda doc: "constrained greedy" in first(doc, "outputs"), render_grammar),
    Renderer("grammar-decode", lambda doc: "free" in first(doc, "decode"), render_grammar_decode),
    Renderer("fp8-accuracy", lambda doc: "perplexity" in first(doc, "variants"), render_fp8_accuracy),
    Renderer("fp8-decode", lambda doc: "fp8_vs_as_loaded" in doc, render_fp8_decode),
    Renderer("fp8-matmul", lambda doc: "results" in first_point(doc), render_fp8_matmul),
    Renderer("prefix", lambda doc: "scenario" in first(doc, "runs"), render_prefix),
    Renderer("stall", lambda doc: bool(first(doc, "stall")), render_stall),
    Renderer("burst", lambda doc: bool(first(doc, "burst")), render_burst),
    Renderer("kernel-bench", lambda doc: "splits" in first(doc, "points"), render_kernel_bench),
    Renderer("prefill-kernel-bench", lambda doc: "q_len" in first(doc, "configs"), render_prefill_kernel_bench),
    Renderer("matmul-bench", lambda doc: "cublas_us" in first_point(doc), render_matmul_bench),
    Renderer("profile", lambda doc: "replay_ms_per_step" in first(doc, "points"), render_profile),
    Renderer("breakdown", lambda doc: "replay_ms_per_step" in first(doc, "points"), breakdown_table),
    Renderer("overlap", lambda doc: "overlap" in first(doc, "rows"), render_overlap),
    Renderer("host-per-step", lambda doc: "ms_per_step" in first(doc, "rows"), render_host_per_step),
    Renderer("checkpoint-memory", lambda doc: "peak_allocated_bytes" in doc, render_checkpoint_memory),
    Renderer("speculative", lambda doc: "speculative_tokens" in first(doc, "runs"), render_speculative),
    Renderer("oracle", lambda doc: "acceptance" in first(doc, "runs"), render_oracle),
    Renderer("oracle-sweep", lambda doc: "acceptance" in first(doc, "runs"), render_oracle_sweep),
    Renderer("tensor-parallel", lambda doc: "tensor_parallel_size" in first(doc, "runs"), render_tensor_parallel),
    Renderer("step-profile", lambda doc: "breakdown_ms" in first(doc, "rows"), render_step_profile),
    Renderer("step-phases", lambda doc: "breakdown_ms" in first(doc, "rows"), render_step_phases),
    Renderer("step-breakdown", lambda doc: "breakdown_ms" in first(doc, "rows"), render_step_breakdown),
    Renderer("kernel-bits", lambda doc: "same_bits" in doc, render_kernel_bits),
    Renderer("invariance-probe", lambda doc: "as_in" in first(doc, "results"), render_invariance_probe),
    Renderer("invariance", lambda doc: any(isinstance(doc.get(part), dict) for part in INVARIANCE_PARTS),
             render_invariance),
    Renderer("invariance-cost", lambda doc: "on_vs_off" in doc.get("speed", {}), render_invariance_cost),
    Renderer("invariance-matmul", lambda doc: "engine_tile" in first(doc, "matmul"), render_invariance_matmul),
    Renderer("sampling-checks", lambda doc: "prompt_logprobs" in doc and "controls" in doc, render_sampling_checks),
    Renderer("invariance-attention", lambda doc: "same_bits_as_prefill_rows" in first(doc, "attention"),
             render_invariance_attention),
)
