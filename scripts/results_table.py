"""Print benchmark evidence as markdown tables, so README figures are copied from evidence, not typed.

    .venv/bin/python scripts/results_table.py results/cpu/decode-all-steps.json
    .venv/bin/python scripts/results_table.py --pivot results/gpu/decode-batch32-64.json   # tok/s, batch x system
    .venv/bin/python scripts/results_table.py --kind burst results/cpu/stall.json
    .venv/bin/python scripts/results_table.py --pivot --only "step01_serial; hf-generate" results/gpu/decode-batch1-8.json
    .venv/bin/python scripts/results_table.py --refresh README.md step0*/README.md    # rewrite every table from its file

The kind of a file is read from what it holds (scripts/renderers.py: `RENDERERS`, one `render_<kind>` each):

    runs, pivot           compare.py, run.py --bench (also --workload nanovllm): gpu/decode-*.json,
                          gpu/nanovllm-*.json, gpu/step06-*.json, cpu/decode-all-steps.json;
                          pivot is the same runs as tok/s only, batch x system
    preempt               step07_preemption/bench/bench_preempt.py: gpu/preempt.json
    serve                 step08_serve/bench/bench_serve.py: gpu/serve-*.json
    open-loop             step08_serve/bench/bench_open_loop.py: gpu/open-loop-*.json
    soak                  step08_serve/bench/soak.py: gpu/soak.json
    grammar,              step16_structured_output/bench/bench_grammar.py: */grammar.json; grammar-decode is its decode
    grammar-decode        tok/s free against constrained
    fp8-accuracy          step17_fp8_weights/bench/bench_accuracy.py: cpu/fp8-accuracy.json
    stall, burst          step09_chunked_prefill/bench/bench_long_prompt.py: gpu/stall-*.json, gpu/burst-*.json,
                          cpu/stall.json (a file holding both scenarios is shown as stall; --kind burst for the other)
    burst-serve           step09_chunked_prefill/bench/bench_burst_serve.py: gpu/burst-serve.json
    prefix                step10_prefix_caching/bench/bench_prefix.py: gpu/prefix-*.json, cpu/prefix.json
    kernel-bench          step06_paged_attention/run.py --kernel-bench: gpu/kernel-paged-decode*.json
    prefill-kernel-bench  step06_paged_attention/bench/prefill_kernel_bench.py: gpu/kernel-paged-prefill.json
    matmul-bench          step13_fused_decode/bench/matmul_bench.py: gpu/kernel-skinny-matmul.json
    profile, breakdown    step13_fused_decode/bench/profile_step.py: gpu/decode-profile.json; breakdown splits each
                          replayed step into the weight read and what lies above it (scripts/decode_breakdown.py)
    overlap               step14_overlap_scheduling/bench/bench_overlap.py: gpu/overlap.json
    host-per-step         step14_overlap_scheduling/bench/bench_host.py: cpu/host-per-step.json
    checkpoint-memory     scripts/check_checkpoint_memory.py: gpu/checkpoint-load-memory-*.json
    speculative           step11_speculative_decoding/bench/bench_speculative.py: cpu/speculative.json
    oracle, oracle-sweep  step11_speculative_decoding/bench/bench_oracle.py: gpu/speculative-*.json; oracle-sweep is the
                          time per token only, batch and k x acceptance
    tensor-parallel       step04_multi_gpu/bench/bench_tensor_parallel.py: cpu/tensor-parallel.json
    invariance-probe      step15_batch_invariant/bench/probe.py: */batch-invariance-probe.json
    invariance,           step15_batch_invariant/bench/bench_invariance.py: */batch-invariance*.json; invariance-cost is
    invariance-cost       the speed parts (mode on against off)
    invariance-matmul,    step15_batch_invariant/bench/bench_kernels.py: gpu/batch-invariance-kernels.json; the
    invariance-attention  multiply's tiles against cuBLAS, and decode attention three ways

In a README, every table generated here starts with its source line (`<!-- results/....json: ... -->`);
`--refresh` regenerates each such table in place, as the kind whose header shares the most columns with the
table's, and tests/test_results_tables.py fails when one differs.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.tables import source_line
from scripts.renderers import RENDERERS


# A table may show only some of a file's records: `<!-- results/x.json [step01_serial; hf-generate]: commit ... -->`.
# The names are the runs' systems (compare.py, run.py --bench), the profile points' variants (which hold commas),
# or a matmul benchmark's row counts ([1; 8]).
SELECTABLE = {"runs": "system", "points": "variant"}


def selected(path: str, doc: dict, only: list[str]) -> dict:
    """The document with only the named records, in their order in the file."""
    if "shapes" in doc:  # matmul_bench.py: one point per projection and row count
        rows = [n for n in doc["rows"] if str(n) in only]
        if len(rows) != len(only):
            raise ValueError(f"{path} has rows {doc['rows']}, not all of {'; '.join(only)}")
        return {**doc, "rows": rows,
                "shapes": {name: [p for p in points if p["rows"] in rows] for name, points in doc["shapes"].items()}}
    for records, key in SELECTABLE.items():
        if records in doc:
            unknown = set(only) - {r[key] for r in doc[records]}
            if unknown:
                raise ValueError(f"{path} has no {key} named {', '.join(sorted(unknown))}")
            return {**doc, records: [r for r in doc[records] if r[key] in only]}
    raise ValueError(f"{path}: only files with {' or '.join(SELECTABLE)} can be shown in part")


def tables_for(path: str, only: list[str] | None = None) -> dict[str, list[str]]:
    """Every table an evidence file can be shown as, by kind in `RENDERERS`' order, each under its source line;
    with `only`, of the named records alone."""
    doc = json.load(open(path, encoding="utf-8"))
    shown = selected(path, doc, only) if only else doc
    fitting = [r for r in RENDERERS if r.holds(shown)] if isinstance(doc, dict) else []
    tables = {r.kind: [source_line(path, doc, only), *r.render(path, shown)] for r in fitting}
    if not tables:
        raise ValueError(f"{path}: no table for this evidence: it is none of the kinds "
                         f"{', '.join(r.kind for r in RENDERERS)} (add a renderer to scripts/renderers.py)")
    return tables


def table_for(path: str, kind: str | None = None, only: list[str] | None = None) -> list[str]:
    """An evidence file's table as `kind`, or as the first kind it can be shown as."""
    tables = tables_for(path, only)
    if kind is None:
        return next(iter(tables.values()))
    if kind not in tables:
        raise ValueError(f"{path} cannot be shown as {kind}, only as: {', '.join(tables)}")
    return tables[kind]


def parse_source(line: str) -> tuple[str, list[str] | None]:
    """The file and the selected records named by a table's source line."""
    source = line[len("<!-- "):].split(":", 1)[0]
    path, _, names = source.partition(" [")
    return path, [name.strip() for name in names.rstrip("]").split(";")] if names else None


def header_cells(line: str) -> set[str]:
    return {cell.strip() for cell in line.strip().strip("|").split("|")}


def refresh(markdown_path: str, write: bool) -> list[str]:
    """Regenerate every evidence table in a markdown file; return the sources of tables that differed."""
    lines = open(markdown_path, encoding="utf-8").read().split("\n")
    out, stale, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- results/") and line.endswith("-->"):
            source, only = parse_source(line)
            end = i + 1
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            # A file can be shown as several kinds (runs or pivot; stall or burst): the table keeps its own.
            shown = header_cells(lines[i + 1]) if end > i + 1 else set()
            fresh = max(tables_for(source, only).values(), key=lambda table: len(header_cells(table[1]) & shown))
            if fresh != lines[i:end]:
                stale.append(source)
            out += fresh
            i = end
        else:
            out.append(line)
            i += 1
    if write and stale:
        open(markdown_path, "w", encoding="utf-8").write("\n".join(out))
    return stale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--kind", choices=[r.kind for r in RENDERERS], help="the table to print (default: the file's first)")
    p.add_argument("--pivot", action="store_const", const="pivot", dest="kind", help="the same as --kind pivot")
    p.add_argument("--only", help="the systems (profile variants, matmul row counts) to show, separated by ';', in the file's order")
    p.add_argument("--refresh", action="store_true", help="the files are markdown: rewrite their evidence tables")
    args = p.parse_args()
    for path in args.files:
        try:
            if args.refresh:
                stale = refresh(path, write=True)
                print(f"{path}: {len(stale)} table(s) rewritten" if stale else f"{path}: up to date")
            else:
                only = [name.strip() for name in args.only.split(";")] if args.only else None
                print("\n".join(table_for(path, args.kind, only)) + "\n")
        except ValueError as err:
            sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
