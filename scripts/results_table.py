"""Print benchmark evidence as markdown tables, so README figures are copied from evidence, not typed.

    .venv/bin/python scripts/results_table.py results/step01_serial/bench-cpu-smollm2-135m-instruct.json
    .venv/bin/python scripts/results_table.py --pivot results/compare/cuda-random-qwen2.5-7b.json   # tok/s, batch x system
    .venv/bin/python scripts/results_table.py --refresh README.md step0*/README.md    # rewrite every table from its file

In a README, every table generated here starts with its source line (`<!-- results/....json: ... -->`);
`--refresh` regenerates each such table in place, and tests/test_results_tables.py fails when one differs.
"""

from __future__ import annotations

import argparse
import json
import re


def source_line(path: str, doc: dict) -> str:
    return f"<!-- {path}: commit {doc['git_commit'][:10]}, {doc['device']}, {doc['model']}, {doc['dtype']} -->"


def prompt_len(run: dict) -> str:
    """A fixed workload's prompt length, from its name (batch8_in32_out128 -> 32); another workload's name."""
    fixed = re.fullmatch(r"batch\d+_in(\d+)_out\d+", run["workload"])
    return fixed.group(1) if fixed else run["workload"]


def detailed(path: str, doc: dict) -> list[str]:
    runs = doc["runs"]
    hf = {r["batch"]: r["output_tok_per_s"] for r in runs if r["system"] == "hf-generate"}
    # A file measured at several prompt lengths gets a column for it (the batch alone does not tell its runs apart).
    by_prompt = len({prompt_len(r) for r in runs}) > 1
    lines = [
        "| system |" + (" prompt |" if by_prompt else "") + " batch | output tok/s | vs HF | TTFT ms (median) | TPOT ms (median) |",
        "|---|" + ("---:|" if by_prompt else "") + "---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ratio = f"{r['output_tok_per_s'] / hf[r['batch']]:.2f}x" if r["batch"] in hf else "-"
        lines.append(
            f"| {r['system']} |" + (f" {prompt_len(r)} |" if by_prompt else "") + f" {r['batch']} | "
            f"{r['output_tok_per_s']:.1f} | {ratio} | {r['ttft_ms_median']:.1f} | {r['tpot_ms_median']:.1f} |"
        )
    return lines


def pivot(path: str, doc: dict) -> list[str]:
    runs = doc["runs"]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    batches = list(dict.fromkeys(r["batch"] for r in runs))
    tok_s = {(r["system"], r["batch"]): r["output_tok_per_s"] for r in runs}
    lines = ["| batch | " + " | ".join(systems) + " |", "|---:|" + "---:|" * len(systems)]
    for b in batches:
        cells = [f"{tok_s[(s, b)]:.1f}" if (s, b) in tok_s else "-" for s in systems]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def overlap(path: str, doc: dict) -> list[str]:
    """step14_overlap_scheduling/bench_overlap.py's evidence: per batch, a decode step's parts without and with
    overlap (ms per step)."""
    lines = ["| batch | GPU (replay alone) | host | step, no overlap | step, overlap | decode tok/s, no overlap | "
             "decode tok/s, overlap | gain |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in doc["rows"]:
        off, on, gpu = row["no_overlap"], row["overlap"], row["gpu_ms"]
        lines.append(f"| {row['batch']} | {'-' if gpu is None else f'{gpu:.2f}'} | {off['host_ms']:.2f} | "
                     f"{off['step_ms']:.2f} | {on['step_ms']:.2f} | {off['tokens_per_s']:.1f} | "
                     f"{on['tokens_per_s']:.1f} | {on['tokens_per_s'] / off['tokens_per_s']:.2f}x |")
    return lines


def table_for(path: str, pivoted: bool) -> list[str]:
    doc = json.load(open(path, encoding="utf-8"))
    if "runs" not in doc and "overlap" in doc.get("rows", [{}])[0]:
        return [source_line(path, doc), *overlap(path, doc)]
    return [source_line(path, doc), *(pivot if pivoted else detailed)(path, doc)]


def refresh(markdown_path: str, write: bool) -> list[str]:
    """Regenerate every evidence table in a markdown file; return the sources of tables that differed."""
    lines = open(markdown_path, encoding="utf-8").read().split("\n")
    out, stale, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!-- results/") and line.endswith("-->"):
            source = line[len("<!-- "):].split(":", 1)[0]
            end = i + 1
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            fresh = table_for(source, pivoted=lines[i + 1].startswith("| batch |"))
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
    p.add_argument("--pivot", action="store_true", help="output tok/s only, one row per batch, one column per system")
    p.add_argument("--refresh", action="store_true", help="the files are markdown: rewrite their evidence tables")
    args = p.parse_args()
    for path in args.files:
        if args.refresh:
            stale = refresh(path, write=True)
            print(f"{path}: {len(stale)} table(s) rewritten" if stale else f"{path}: up to date")
        else:
            print("\n".join(table_for(path, args.pivot)) + "\n")


if __name__ == "__main__":
    main()
