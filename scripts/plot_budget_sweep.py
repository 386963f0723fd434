"""Plot step 09's budget sweep: the decoders' longest wait against the long prompt's time to first token.

    .venv/bin/python scripts/plot_budget_sweep.py results/gpu/stall-step09.json --output runs/stall-step09.png

Reads the evidence of `step09_chunked_prefill/bench/bench_long_prompt.py` (its "stall" rows) and writes a PNG next
to it (or to --output): one point per budget, x the long prompt's time to first token, y the decoders'
longest gap between two tokens as a multiple of their steady step. Every figure drawn is one in the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("evidence", type=Path)
    p.add_argument("--output", type=Path, default=None, help="the PNG (default: the evidence's name, .png)")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(args.evidence.read_text(encoding="utf-8"))
    # Budgets in increasing order, then none (a budget without limit): the curve runs from small to large.
    rows = sorted((r for r in doc["stall"] if "longest_gap_vs_steady" in r),
                  key=lambda r: float("inf") if r["budget"] == "none" else int(r["budget"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ttft = [r["long_prompt_ttft_ms"] for r in rows]
    gap = [r["longest_gap_vs_steady"] for r in rows]
    ax.plot(ttft, gap, "o-", color="tab:blue")
    for r, x, y in zip(rows, ttft, gap):
        ax.annotate(r["budget"] if r["budget"] == "none" else f"{r['budget']} tokens", (x, y),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    unchunked = next((r["long_prompt_ttft_ms"] for r in rows if r["budget"] == "none"), None)
    if unchunked:
        ax.axvline(1.5 * unchunked, color="grey", linestyle=":", linewidth=1)
        ax.text(1.5 * unchunked, ax.get_ylim()[1] * 0.7, " 1.5x unchunked", color="grey", fontsize=8)
    ax.axhline(8, color="grey", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[1], 8, "8x steady ", color="grey", fontsize=8, ha="right", va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel(f"time to first token of the {rows[0]['long_prompt_len']:,}-token prompt (ms)")
    ax.set_ylabel(f"decoders' longest gap / steady step ({rows[0]['steady_step_ms']:.1f} ms)")
    ax.set_title(f"{doc['step']}, {doc['model']}, {rows[0]['decoders']} decoders ({doc['device']}, "
                 f"{str(doc['git_commit'])[:7]})", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    output = args.output or args.evidence.with_suffix(".png")
    fig.savefig(output, dpi=120)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
