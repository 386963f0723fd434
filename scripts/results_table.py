"""Print a benchmark evidence file as a markdown table, so README figures are copied from evidence, not typed.

    python scripts/results_table.py results/step01_serial/bench-cpu-smollm2-135m-instruct.json
"""

from __future__ import annotations

import json
import sys


def markdown(path: str) -> str:
    doc = json.load(open(path, encoding="utf-8"))
    runs = doc["runs"]
    hf = {r["batch"]: r["output_tok_per_s"] for r in runs if r["system"] == "hf-generate"}
    lines = [
        f"<!-- {path}: commit {doc['git_commit'][:10]}, {doc['device']}, {doc['model']}, {doc['dtype']} -->",
        "| system | batch | output tok/s | vs HF | TTFT ms (median) | TPOT ms (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ratio = f"{r['output_tok_per_s'] / hf[r['batch']]:.2f}x" if r["batch"] in hf else "-"
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['output_tok_per_s']:.1f} | {ratio} | "
            f"{r['ttft_ms_median']:.1f} | {r['tpot_ms_median']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(markdown(p) for p in sys.argv[1:]))
