"""Markdown tables from evidence files: the source line each generated table starts with, and the runs that
`compare.py` and every step's `run.py --bench` write (`common/bench.py: write_evidence`).

A table is a list of lines (header, alignment, rows), every figure read from the evidence or computed from its
figures. `scripts/renderers.py` adds a table for each other kind of evidence, and `scripts/results_table.py` keeps
the READMEs' tables fresh; the notebooks print these directly.
"""

from __future__ import annotations

import re
from typing import Any

Doc = dict[str, Any]


def markdown(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """A table whose first `text_columns` columns are left-aligned (labels) and the others right-aligned (figures)."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"
    alignment = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    return [line(header), "|" + "|".join(alignment) + "|", *map(line, rows)]


def source_line(path: str, doc: Doc, only: list[str] | None = None) -> str:
    """Where a table is from: `<!-- results/x.json [records shown, if not all]: commit, device, model, dtype -->`."""
    selected = f" [{'; '.join(only)}]" if only else ""
    return (f"<!-- {path}{selected}: commit {doc['git_commit'][:10]}, {doc['device']}, {doc['model']}, "
            f"{doc['dtype']} -->")


def prompt_len(run: Doc) -> str:
    """A fixed workload's prompt length, from its name (batch8_in32_out128 -> 32); another workload's name."""
    fixed = re.fullmatch(r"batch\d+_in(\d+)_out\d+", run["workload"])
    return fixed.group(1) if fixed else run["workload"]


def render_runs(path: str, doc: Doc) -> list[str]:
    """Per system and batch: output tok/s, against HF's at the same batch, and the median TTFT and TPOT."""
    runs = doc["runs"]
    hf = {r["batch"]: r["output_tok_per_s"] for r in runs if r["system"] == "hf-generate"}
    # A file measured at several prompt lengths gets a column for it (the batch alone does not tell its runs apart).
    by_prompt = len({prompt_len(r) for r in runs}) > 1
    header = ["system", *(["prompt"] if by_prompt else []), "batch", "output tok/s", "vs HF", "TTFT ms (median)",
              "TPOT ms (median)"]
    rows = [[r["system"], *([prompt_len(r)] if by_prompt else []), str(r["batch"]), f"{r['output_tok_per_s']:.1f}",
             f"{r['output_tok_per_s'] / hf[r['batch']]:.2f}x" if r["batch"] in hf else "-",
             f"{r['ttft_ms_median']:.1f}", f"{r['tpot_ms_median']:.1f}"] for r in runs]
    return markdown(header, rows)


def render_pivot(path: str, doc: Doc) -> list[str]:
    """The same runs as output tok/s only: one row per batch, one column per system."""
    runs = doc["runs"]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    batches = list(dict.fromkeys(r["batch"] for r in runs))
    tok_s = {(r["system"], r["batch"]): r["output_tok_per_s"] for r in runs}
    rows = [[str(b), *(f"{tok_s[(s, b)]:.1f}" if (s, b) in tok_s else "-" for s in systems)] for b in batches]
    return markdown(["batch", *systems], rows, text_columns=0)
