"""Step 05's figures: one stacked bar per step of where its decode step's time goes, or one step's timeline.

`write_plot` draws an evidence file of `step05_profiling/run.py`: each bar is a row, its parts the row's
`breakdown_ms`, bottom first: the weight read (every weight once, at the measured copy bandwidth), the matrix
multiplies' time above it, attention, the other kernels, the gaps between kernels the GPU had queued, the GPU
waiting while the host launches the forward, and the host's other work that the GPU waits for. A later step's
gain shows as a part that shrinks.

`write_timeline` draws one engine step of each trace as the trace viewer shows it: the host's phases as bars,
nested ones below the ones they sit in, and below them the GPU's kernels, coloured by kind, each trace a panel
on the same time scale. `scripts/plot_profile.py` draws either from the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

COLORS = ("#1f4e79", "#5b9bd5", "#70ad47", "#ffc000", "#a5a5a5", "#ed7d31", "#c00000")  # BREAKDOWN's order
PHASE_COLORS = {"schedule": "#8064a2", "prepare inputs": "#4bacc6", "forward": "#f79646", "sample": "#c0504d",
                "process outputs": "#9bbb59", "detokenize": "#7f7f7f", "attention": "#70ad47"}
KIND_COLORS = {"matrix multiply": "#5b9bd5", "attention": "#70ad47"}  # any other kernel: yellow


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


def draw_timeline(ax, trace: Path, step_index: int, width_ms: float | None) -> float:  # noqa: ANN001 - an Axes
    """One engine step of `trace`: host ranges by depth from the top, kernels on the bottom row. Returns its ms."""
    # The profiler's modules load torch: only a timeline needs them, not the bars.
    from common.profiling.kernels import category_of
    from common.profiling.phases import ATTENTION_RANGE, PHASES, STEP_RANGE
    from common.profiling.trace import load_events, nesting

    events = load_events(trace)
    step = sorted((e for e in events if e.cat == "user_annotation" and e.name == STEP_RANGE),
                  key=lambda e: e.start)[step_index]
    ranges = [e for e in events if e.cat == "user_annotation" and e.name in (*PHASES, ATTENTION_RANGE)
              and step.start <= e.start < step.end]
    kernels = [e for e in events if e.cat == "kernel" and e.end > step.start and e.start < step.end]
    depths = [depth for _, _, depth in nesting(ranges)] or [0]
    gpu_row = max(depths) + 2
    for r, _, depth in nesting(ranges):
        ax.barh(depth, r.dur / 1e3, left=(r.start - step.start) / 1e3, height=0.8, color=PHASE_COLORS[r.name])
    for k in kernels:
        ax.barh(gpu_row, max(k.dur, 0.5) / 1e3, left=(k.start - step.start) / 1e3, height=0.8,
                color=KIND_COLORS.get(category_of(k.name), "#ffc000"))
    ax.set_yticks([*range(max(depths) + 1), gpu_row], [*(f"host, depth {d}" for d in range(max(depths) + 1)), "GPU"],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, width_ms or step.dur / 1e3)
    ax.set_title(f"{trace.stem}: one engine step, {step.dur / 1e3:.2f} ms, {len(kernels)} kernels", fontsize=9)
    return step.dur / 1e3


def write_timeline(traces: list[Path], output: Path, step_index: int = 3) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 2.2 * len(traces) + 0.8), squeeze=False)
    for ax, trace in zip(axes[:, 0], traces):
        draw_timeline(ax, trace, step_index, None)
    axes[-1][0].set_xlabel("ms from the start of the step")
    legend = [Patch(color=c, label=name) for name, c in PHASE_COLORS.items()]
    legend += [Patch(color=c, label=f"{name} kernel") for name, c in KIND_COLORS.items()]
    legend.append(Patch(color="#ffc000", label="other kernel"))
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
