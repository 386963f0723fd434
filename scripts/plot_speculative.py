"""Plot step 11's speed-up against acceptance: the time per output token with speculation, as a share of plain
decoding's, for each k, from what a verification step costs.

    .venv/bin/python scripts/plot_speculative.py results/gpu/speculative-verify-step.json \\
        --measured results/cpu/speculative-oracle.json --points results/gpu/speculative-sweep.json \\
        --output results/gpu/speculative-expected.png

Reads the evidence of `step11_speculative_decoding/bench/bench_oracle.py`. A curve per batch and k of the first file:
the step's cost against a decode step's (measured), divided by E = 1 + a + ... + a^k (the expected tokens per
row) for a from 0 to 1. With --measured, the points of a second file where the oracle's a is exact (float32),
time per token as measured, beside its own curves: the check that the curves can be trusted. With --points,
the times per token measured under the rule on the first file's device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.renderers import expected_tokens


def step_costs(doc: dict) -> dict[tuple[int, int], float]:
    """(batch, k) -> a verification step's time over a decode step's, at the batch (the mean over its runs)."""
    off = {r["batch"]: r["ms_per_step"] for r in doc["runs"] if r["k"] == 0}
    costs: dict[tuple[int, int], list[float]] = {}
    for r in doc["runs"]:
        if r["k"]:
            costs.setdefault((r["batch"], r["k"]), []).append(r["ms_per_step"] / off[r["batch"]])
    return {key: sum(values) / len(values) for key, values in costs.items()}


def draw(ax, doc: dict, batch: int, style: str, label: str, points: bool = False) -> None:  # noqa: ANN001
    """A curve per k at `batch`: the step's cost over E(a, k); with `points`, the measured times in its colour."""
    grid = [i / 50 for i in range(51)]
    for (b, k), cost in sorted(step_costs(doc).items()):
        if b != batch:
            continue
        (line,) = ax.plot(grid, [cost / expected_tokens(a, k) for a in grid], style, label=f"{label}, k = {k}")
        if points:
            runs = [r for r in doc["runs"] if r["batch"] == batch and r["k"] == k]
            ax.plot([r["acceptance"] for r in runs], [r["time_per_token_vs_off"] for r in runs], "o",
                    color=line.get_color(), markersize=5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("evidence", type=Path)
    p.add_argument("--measured", type=Path, default=None, help="a float32 oracle sweep to put beside its curves")
    p.add_argument("--points", type=Path, default=None,
                   help="a sweep under the rule (the same device): its measured times per token, as crosses")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--output", type=Path, default=None, help="the PNG (default: the evidence's name, .png)")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(args.evidence.read_text(encoding="utf-8"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, doc, args.batch, "-", f"{doc['device']}, expected")
    if args.measured:
        cpu = json.loads(args.measured.read_text(encoding="utf-8"))
        draw(ax, cpu, args.batch, ":", "CPU, expected (dots: measured, float32)", points=True)
    if args.points:
        sweep = json.loads(args.points.read_text(encoding="utf-8"))
        for k in sorted({r["k"] for r in sweep["runs"] if r["k"] and r["batch"] == args.batch}):
            runs = [r for r in sweep["runs"] if r["batch"] == args.batch and r["k"] == k]
            ax.plot([r["acceptance"] for r in runs], [r["time_per_token_vs_off"] for r in runs], "x", markersize=7,
                    label=f"{sweep['device']}, the rule, k = {k}: measured")
    ax.axhline(1, color="grey", linestyle="--", linewidth=1)
    ax.text(0.01, 1.02, "plain decoding", color="grey", fontsize=8)
    ax.set_xlabel("acceptance a (the chance that a proposal is kept)")
    ax.set_ylabel("time per output token / plain decoding's")
    ax.set_title(f"speculation at batch {args.batch}: a verification step's cost / E(a, k) "
                 f"({doc['model']}, {doc['dtype']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    output = args.output or args.evidence.with_suffix(".png")
    fig.savefig(output, dpi=120)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
