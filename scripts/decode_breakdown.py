"""Where a replayed decode step's time goes, read from a profile of `step13_fused_decode/bench/profile_step.py`.

A decode step must read every weight once: the profile's `weight_read_ceiling_ms` (the weights' bytes at the
copy bandwidth measured in the same run). For each variant and batch in the file, the replayed step is split
into that weight read and what it spends above it:
- the matrix multiplies' time above the weight read (they are the kernels that read the weights);
- element-wise kernels: PyTorch's element-wise kernels and reductions, and the profile's "other" kernels
  (step 13's fused RoPE with its KV write, SiLU-and-multiply, the embedding, a copy);
- attention: step 06's decode kernels (and step 12's separate KV write);
- gaps between kernels: the replayed step less the sum of its kernels' GPU time. Negative where kernels
  overlap: with programmatic dependent launch (PDL) a kernel starts early, and its time includes its wait.
Kernel times come from eager runs of the same forward under torch.profiler, the step from graph replays.

    .venv/bin/python scripts/decode_breakdown.py results/gpu/decode-profile.json
    .venv/bin/python scripts/decode_breakdown.py results/gpu/decode-profile.json --plot results/gpu/decode-breakdown.png
"""

from __future__ import annotations

import argparse
import json

# profile_step.py's variant names, as the lessons name them.
LABELS = {"plain": "step 12: plain graphs", "fused ops, skinny matmul, PDL": "step 13: fused, PDL"}
ABOVE = ("matrix multiplies above it", "element-wise kernels", "attention", "gaps between kernels")
COLORS = {"weight read": "0.75", "matrix multiplies above it": "tab:blue", "element-wise kernels": "tab:orange",
          "attention": "tab:green", "gaps between kernels": "tab:red"}


def label_of(variant: str) -> str:
    return LABELS.get(variant, variant)


def segments(point: dict, ceiling_ms: float) -> dict[str, float]:
    """One profiled point's replayed step, in ms: the weight read, then each part of the time above it."""
    by = point["ms_per_step_by_category"]
    matmul = by.get("matrix multiply", 0.0)
    read = min(matmul, ceiling_ms)
    return {"weight read": read,
            "matrix multiplies above it": matmul - read,
            "element-wise kernels": by.get("element-wise and reductions", 0.0) + by.get("other", 0.0),
            "attention": by.get("attention", by.get("attention (ours)", 0.0)),  # the name before step 05
            "gaps between kernels": point["replay_ms_per_step"] - point["kernel_ms_per_step"]}


def breakdown_table(path: str, doc: dict) -> list[str]:
    """The markdown table's lines: one row per variant and batch, each part in ms and as a share of the time
    the step spends above the weight read."""
    ceiling = doc["weight_read_ceiling_ms"]
    lines = ["| variant | batch | replayed step | weight read (of the step) | above it | "
             + " | ".join(ABOVE) + " |", "|---|---:|---:|---:|---:|" + "---:|" * len(ABOVE)]
    for point in doc["points"]:
        parts = segments(point, ceiling)
        step = point["replay_ms_per_step"]
        above = step - parts["weight read"]
        cells = [f"{parts[name]:.2f} ms ({parts[name] / above:.0%})" for name in ABOVE]
        lines.append(f"| {label_of(point['variant'])} | {point['batch']} | {step:.2f} ms | "
                     f"{parts['weight read']:.2f} ms ({parts['weight read'] / step:.0%}) | {above:.2f} ms | "
                     + " | ".join(cells) + " |")
    return lines


def draw_bars(ax, doc: dict, points: list[dict], labelled: set[str]) -> None:  # noqa: ANN001 - a matplotlib Axes
    """The stacked bars into `ax`: the weight read, then the parts above it; a black tick at the replayed step,
    which lies below the bar's top where kernels overlap (drawn hatched)."""
    ceiling = doc["weight_read_ceiling_ms"]
    for x, point in enumerate(points):
        parts = segments(point, ceiling)
        bottom = 0.0
        for name in ("weight read", *ABOVE[:-1]):
            ax.bar(x, parts[name], bottom=bottom, width=0.6, color=COLORS[name],
                   label=None if name in labelled else name)
            labelled.add(name)
            bottom += parts[name]
        gaps, step = parts["gaps between kernels"], point["replay_ms_per_step"]
        if gaps >= 0:
            name = "gaps between kernels"
            ax.bar(x, gaps, bottom=bottom, width=0.6, color=COLORS[name], label=None if name in labelled else name)
        else:
            name = "kernels overlapping (PDL): the step ends below the bar"
            ax.bar(x, -gaps, bottom=step, width=0.6, facecolor="none", edgecolor="black", hatch="///", lw=0,
                   label=None if name in labelled else name)
        labelled.add(name)
        ax.plot([x - 0.36, x + 0.36], [step, step], color="black", lw=2)
        ax.annotate(f"{step:.2f} ms", (x, max(step, bottom)), xytext=(0, 4), textcoords="offset points",
                    ha="center", fontsize=9)
    ax.axhline(ceiling, color="black", ls="--", lw=1)
    ax.set_xticks(range(len(points)), [f"{label_of(p['variant'])}\nbatch {p['batch']}" for p in points], fontsize=8)


def plot(doc: dict, png: str) -> None:
    """One stacked bar per variant and batch, twice: the whole step, and the part above the weight read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceiling = doc["weight_read_ceiling_ms"]
    order = list(LABELS)
    points = sorted(doc["points"], key=lambda p: (p["batch"], order.index(p["variant"]) if p["variant"] in order
                                                  else len(order)))
    top = 1.08 * max(max(p["replay_ms_per_step"], p["kernel_ms_per_step"]) for p in points)
    fig, (whole, above) = plt.subplots(1, 2, figsize=(3 + 2.6 * len(points), 4.8))
    labelled: set[str] = set()
    draw_bars(whole, doc, points, labelled)
    draw_bars(above, doc, points, labelled)
    whole.set_ylim(0, top)
    whole.set_ylabel("ms per replayed decode step")
    whole.set_title(f"the whole step; dashed: the weight read at the copy bandwidth, {ceiling:.2f} ms", fontsize=9)
    above.set_ylim(ceiling - 0.1, top)
    above.set_title(f"the same bars above the weight read (axis from {ceiling - 0.1:.2f} ms)", fontsize=9)
    fig.suptitle(f"{doc['model']}, {doc['dtype']}, {doc['context']}-token contexts, {doc['device']}", fontsize=10)
    handles, names = whole.get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="a profile_step.py evidence file")
    p.add_argument("--plot", metavar="PNG", help="also draw one stacked bar per variant and batch into PNG")
    args = p.parse_args()
    doc = json.load(open(args.profile, encoding="utf-8"))
    print("\n".join(breakdown_table(args.profile, doc)))
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
