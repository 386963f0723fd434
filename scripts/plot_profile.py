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


def write_plot(evidence: Path, output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(evidence).read_text(encoding="utf-8"))
    rows = doc["rows"]
    parts = list(rows[0]["breakdown_ms"])
    labels = [row["variant"].replace("_", "\n", 1) for row in rows]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 5))
    bottom = [0.0] * len(rows)
    for part, color in zip(parts, COLORS):
        values = [row["breakdown_ms"][part] for row in rows]
        ax.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per engine step")
    ax.set_title(f"Where a decode step's time goes: batch {doc['batch']}, {doc['model']} ({doc['dtype']}), "
                 f"{doc['device']}, commit {doc['git_commit'][:10]}", fontsize=9)
    ax.set_yscale("log" if max(bottom) / max(min(bottom), 1e-9) > 30 else "linear")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
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
