"""Plot step 05's evidence: one stacked bar per step, where its decode step's time goes.

    .venv/bin/python scripts/plot_profile.py results/gpu/profile-steps.json    # writes the .png next to it

Each bar is a row of the file (`step05_profiling/run.py`), its parts the row's `breakdown_ms`, bottom first:
the weight read (every weight once, at the measured copy bandwidth), the matrix multiplies' time above it,
attention, the other kernels, the gaps while the host launches the forward, and the host's other work that
the device waits for. A later step's gain shows as a part that shrinks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = ("#1f4e79", "#5b9bd5", "#70ad47", "#ffc000", "#ed7d31", "#c00000")  # BREAKDOWN's order


def short_name(variant: str) -> str:
    """"step06_paged_attention --sync-per-layer" -> "06 paged_attention\n--sync-per-layer"."""
    name = variant[4:] if variant.startswith("step") else variant
    return name.replace("_", " ", 1).replace(" --", "\n--")


def draw(ax, rows: list[dict], parts: list[str]) -> None:  # noqa: ANN001 - a matplotlib Axes
    labels = [short_name(row["variant"]) for row in rows]
    bottom = [0.0] * len(rows)
    for part, color in zip(parts, COLORS):
        values = [row["breakdown_ms"][part] for row in rows]
        ax.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per engine step (profiled)")
    ax.tick_params(axis="x", labelsize=7, labelrotation=60)


def write_plot(evidence: Path, output: Path, zoom_below_ms: float = 15.0) -> Path:
    """Every row, and beside it the fast rows alone (under `zoom_below_ms`), on a scale where their parts show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(evidence).read_text(encoding="utf-8"))
    rows = doc["rows"]
    parts = list(rows[0]["breakdown_ms"])
    fast = [row for row in rows if row["step_ms"] < zoom_below_ms]
    fig, axes = plt.subplots(1, 2 if fast else 1, figsize=(13, 5.5), squeeze=False,
                             gridspec_kw={"width_ratios": [len(rows), max(len(fast), 1) + 1]} if fast else None)
    draw(axes[0][0], rows, parts)
    axes[0][0].set_title("every step", fontsize=9)
    if fast:
        draw(axes[0][1], fast, parts)
        axes[0][1].set_title(f"the steps under {zoom_below_ms:.0f} ms, closer", fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Where a decode step's time goes: batch {doc['batch']}, {doc['model']} ({doc['dtype']}), "
                 f"{doc['device']}, commit {doc['git_commit'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("evidence", type=Path)
    p.add_argument("--output", type=Path, help="default: the evidence's name with .png")
    args = p.parse_args()
    print(f"wrote {write_plot(args.evidence, args.output or args.evidence.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
